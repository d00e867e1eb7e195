"""Ragged paged attention (prefill / chunked prefill / prefix-cache extend), Triton backend.

Several sequences' new query tokens come concatenated in one ``q``; their K/V
(including the new tokens') are already in the paged pool.  An XLA-side work
list (``_planning.ragged_work_list``) cuts every sequence's tokens into tiles
of ``tokens_per_tile`` tokens; grid = (tile, kv_head).  A program stacks its
tokens x the KV head's query group into one ``tile_rows x D`` matrix (heads
padded to a power of two), walks the KV tiles from the sliding-window start to
the last key any of its queries sees, and masks per row: causally, or up to
each query's limit when ``query_limits`` are given (Gemma 3's image tokens see
their whole image), and by the window, which counts back from the query's own
position either way.  The padded tail of ``q`` is a pseudo-sequence with no
keys: its rows come out 0.  Attention sinks (one logit per query head) start
each row's softmax state.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _planning as planning
from pallas_kernels._cost import attention_cost, kv_bytes_per_key, nbytes, visible_keys
from pallas_kernels.triton import _common as common


def _ragged_kernel(
    tile_seq_ref: Any,  # int32[num_tiles]
    tile_first_row_ref: Any,
    tile_rows_ref: Any,
    tile_first_pos_ref: Any,
    tile_kv_len_ref: Any,
    page_table_ref: Any,  # int32[max_seqs, table_width]
    q_ref: Any,  # [num_tokens + tokens_per_tile, group_padded, D] (this KV head)
    k_pages_ref: Any,  # [num_pages, page_size, D] (this KV head)
    v_pages_ref: Any,
    *refs: Any,
    plan: planning.RaggedPlan,
    page_size: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool,
    has_sinks: bool,
    has_limits: bool,
    num_aliased: int,
) -> None:
    if quantized:
        k_scales_ref, v_scales_ref, *refs = refs
    else:
        k_scales_ref = v_scales_ref = None
    sinks_ref, *refs = refs if has_sinks else (None, *refs)  # f32[tile_rows] (this KV head's heads per token)
    limits_ref, *refs = refs if has_limits else (None, *refs)  # int32[num_tokens + tokens_per_tile, group_padded]
    (out_ref,) = refs[num_aliased:]

    # Walk the work list last-to-first.  The order is irrelevant on a GPU; in
    # interpret mode (sequential) it makes each sequence's last, partial tile run
    # after the next sequence's tiles, so a store that ignored the row mask would
    # clobber them visibly instead of being silently overwritten.
    tile_idx = plan.num_tiles - 1 - pl.program_id(0)
    seq = tile_seq_ref[tile_idx]
    first_row = tile_first_row_ref[tile_idx]
    num_valid = tile_rows_ref[tile_idx]
    first_pos = tile_first_pos_ref[tile_idx]
    kv_len = tile_kv_len_ref[tile_idx]

    tokens, heads = plan.tokens_per_tile, plan.group_padded
    rows = plan.tile_rows
    kv_tile = plan.pages_per_block * page_size
    head_dim = q_ref.shape[-1]

    q = q_ref[common.ds(first_row, tokens)].reshape(rows, head_dim)
    row_token = lax.div(lax.broadcasted_iota(jnp.int32, (rows,), 0), heads)
    row_valid = row_token < num_valid
    q = jnp.where(row_valid[:, None], q, jnp.zeros_like(q))  # other sequences' rows
    q_pos = first_pos + row_token

    # Keys any row of this tile may see: up to its last query's position, or its valid rows' largest limit.
    busy = num_valid > 0
    if limits_ref is None:
        q_limit, kv_end = q_pos, first_pos + num_valid
    else:  # callers pass limits >= the row's position: a row sees its own key and every earlier one
        q_limit = limits_ref[common.ds(first_row, tokens)].reshape(rows)
        kv_end = jnp.max(jnp.where(row_valid, q_limit, -1)) + 1
    kv_end = jnp.where(busy, jnp.minimum(kv_len, kv_end), 0)
    kv_start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    tile_lo = lax.div(kv_start, kv_tile)
    tile_hi = lax.div(kv_end + kv_tile - 1, kv_tile)
    offsets = lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)

    def body(kv_tile_idx: jax.Array, state: Any) -> Any:
        page_ids = page_table_ref[
            seq, common.ds(kv_tile_idx * plan.pages_per_block, plan.pages_per_block)
        ]
        key_pos = kv_tile_idx * kv_tile + offsets
        in_range = key_pos < kv_end
        allowed = in_range[None, :] & (key_pos[None, :] <= q_limit[:, None])
        if sliding_window is not None:
            allowed = allowed & (key_pos[None, :] > q_pos[:, None] - sliding_window)
        return common.attend_kv_tile(
            state,
            q,
            page_ids,
            in_range,
            allowed,
            k_pages_ref=k_pages_ref,
            v_pages_ref=v_pages_ref,
            k_scales_ref=k_scales_ref,
            v_scales_ref=v_scales_ref,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
        )

    sinks = None if sinks_ref is None else sinks_ref[...]
    state = lax.fori_loop(tile_lo, tile_hi, body, common.init_softmax_state(rows, head_dim, sinks))
    out, _ = common.finish_softmax(state)
    out = out.astype(out_ref.dtype).reshape(tokens, heads, head_dim)
    token_valid = lax.broadcasted_iota(jnp.int32, (tokens, heads, head_dim), 0) < num_valid
    common.masked_store(out_ref.at[common.ds(first_row, tokens)], out, token_valid)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "pages_per_compute_block",
        "num_warps",
        "num_stages",
        "interpret",
        "poison_output",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    query_limits: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Ragged multi-sequence attention; see ``pallas_kernels.ragged_paged_attention``.

    ``query_limits`` (int32[num_tokens], rows as q's): the last key position each query sees, at least its own
    (not checked: a smaller one hides the query's own key); None compiles the causal kernel.

    ``poison_output=True`` (tests only) starts the output buffer as NaN so rows
    the kernel fails to write show up.
    """
    common.require_backend(interpret)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = planning.validate_paged_kv(
        num_q_heads, head_dim, k_pages, v_pages, k_scales, v_scales
    )
    max_seqs = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != max_seqs:
        raise ValueError(
            f"page_indices must be [max_seqs={max_seqs}, pages_per_seq]; got {page_indices.shape}"
        )
    if cu_q_lens.shape != (max_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [max_seqs + 1 = {max_seqs + 1}]; got {cu_q_lens.shape}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1; got {sliding_window}")
    pages_per_seq = page_indices.shape[1]
    plan = planning.plan_ragged(
        num_tokens,
        num_q_heads,
        num_kv_heads,
        max_seqs,
        page_size,
        pages_per_seq,
        pages_per_compute_block=pages_per_compute_block,
        kv_itemsize=k_pages.dtype.itemsize,
        head_dim=head_dim,
    )
    scale = planning.default_sm_scale(head_dim) if sm_scale is None else float(sm_scale)

    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, pages_per_seq * page_size)
    work = planning.ragged_work_list(
        cu_q_lens, kv_lens, jnp.asarray(num_seqs), num_tokens, plan.tokens_per_tile, plan.num_tiles
    )
    width = planning.cdiv(pages_per_seq, plan.pages_per_block) * plan.pages_per_block
    page_table = planning.sanitize_page_indices(page_indices, kv_lens, page_size, width)

    group, heads, tokens = plan.group_size, plan.group_padded, plan.tokens_per_tile
    padded_tokens = num_tokens + tokens  # a tile starting at any row stays in bounds
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_rows = jnp.pad(q_rows, ((0, tokens), (0, 0), (0, heads - group), (0, 0)))

    quantized = k_scales is not None
    tile_spec = pl.BlockSpec((plan.num_tiles,), lambda t, h: (0,))
    rows_spec = pl.BlockSpec((padded_tokens, None, heads, head_dim), lambda t, h: (0, h, 0, 0))
    pages_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda t, h: (h, 0, 0, 0))
    in_specs = [tile_spec] * 5 + [
        pl.BlockSpec((max_seqs, width), lambda t, h: (0, 0)),
        rows_spec,
        pages_spec,
        pages_spec,
    ]
    inputs = [*work, page_table, q_rows, k_pages, v_pages]
    if quantized:
        scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda t, h: (h, 0, 0))
        in_specs += [scale_spec, scale_spec]
        inputs += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((None, plan.tile_rows), lambda t, h: (h, 0)))
        inputs.append(planning.group_sinks(sinks, num_q_heads, num_kv_heads, heads, repeats=tokens))
    if query_limits is not None:
        if query_limits.shape != (num_tokens,):
            raise ValueError(f"query_limits must be [num_tokens = {num_tokens}]; got {query_limits.shape}")
        limits = jnp.pad(query_limits.astype(jnp.int32), (0, tokens))  # a row's limit for each of its heads
        in_specs.append(pl.BlockSpec((padded_tokens, heads), lambda t, h: (0, 0)))
        inputs.append(jnp.broadcast_to(limits[:, None], (padded_tokens, heads)))

    out_shape = jax.ShapeDtypeStruct((padded_tokens, num_kv_heads, heads, head_dim), q.dtype)
    aliases: dict[int, int] = {}
    num_aliased = 0
    if poison_output:
        num_aliased = 1
        aliases[len(inputs)] = 0
        inputs.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        in_specs.append(rows_spec)

    kernel = functools.partial(
        _ragged_kernel,
        plan=plan,
        page_size=page_size,
        sm_scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=quantized,
        has_sinks=sinks is not None,
        has_limits=query_limits is not None,
        num_aliased=num_aliased,
    )
    # every tile of the static work list counted busy, each as far into its sequence as the table reaches
    keys = visible_keys(width * page_size, sliding_window, tokens, plan.pages_per_block * page_size)
    cost = attention_cost(query_rows=plan.num_tiles * num_kv_heads * plan.tile_rows, keys=keys, head_dim=head_dim,
                          kv_bytes_per_key=kv_bytes_per_key(head_dim, k_pages.dtype, quantized),
                          kv_reads=plan.num_tiles * num_kv_heads * keys,
                          io_bytes=2 * nbytes(q_rows) + nbytes(page_table, *work), soft_cap=soft_cap is not None)
    out = pl.pallas_call(
        kernel,
        grid=(plan.num_tiles, num_kv_heads),
        in_specs=in_specs,
        out_specs=rows_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=common.compiler_params(num_warps, num_stages),
        cost_estimate=cost,
        interpret=interpret,
        name=f"jaxserve_ragged_paged_r{plan.tile_rows}_p{plan.pages_per_block}x{page_size}",
    )(*inputs)
    return out[:num_tokens, :, :group].reshape(num_tokens, num_q_heads, head_dim)

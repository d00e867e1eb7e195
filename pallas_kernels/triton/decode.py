"""Paged-attention decode kernel (one new query token per sequence), Triton backend.

Grid: (batch, kv_head, kv_split).  Each program loads the query heads of one
KV head as a tile of ``group_rows`` rows (padded to a power of two >= 16, so
GQA/MQA share one K/V load per KV head), walks its share of the sequence's
page table in tiles of ``pages_per_block`` pages, and keeps an online softmax
in float32.  With more than one split the programs write normalized partial
outputs plus their log-sum-exp, merged afterwards in XLA (flash-decoding).
Attention sinks (one logit per query head) start split 0's softmax state.
Only tiles that overlap ``[max(0, length - sliding_window), length)`` are read.
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


def _decode_kernel(
    lengths_ref: Any,  # int32[batch]
    page_table_ref: Any,  # int32[table_width] (this sequence's row)
    q_ref: Any,  # [group_rows, D]
    k_pages_ref: Any,  # [num_pages, page_size, D] (this KV head)
    v_pages_ref: Any,
    *refs: Any,
    plan: planning.DecodePlan,
    page_size: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool,
    has_sinks: bool,
    num_aliased: int,
) -> None:
    if quantized:
        k_scales_ref, v_scales_ref, *refs = refs
    else:
        k_scales_ref = v_scales_ref = None
    sinks_ref, *refs = refs if has_sinks else (None, *refs)  # f32[group_rows] (this KV head's query heads)
    refs = refs[num_aliased:]  # NaN-poisoned buffers aliased to the outputs
    if plan.num_splits == 1:
        (out_ref,) = refs
        lse_ref = None
    else:
        out_ref, lse_ref = refs

    batch_idx = pl.program_id(0)
    split_idx = pl.program_id(2)
    tile = plan.pages_per_block * page_size
    rows = plan.group_rows

    length = lengths_ref[batch_idx]
    first_key = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    split_first_tile = split_idx * plan.blocks_per_split
    tile_lo = jnp.maximum(split_first_tile, lax.div(first_key, tile))
    tile_hi = jnp.minimum(split_first_tile + plan.blocks_per_split, lax.div(length + tile - 1, tile))

    q = q_ref[...]
    offsets = lax.broadcasted_iota(jnp.int32, (tile,), 0)

    def body(tile_idx: jax.Array, state: Any) -> Any:
        page_ids = page_table_ref[common.ds(tile_idx * plan.pages_per_block, plan.pages_per_block)]
        key_pos = tile_idx * tile + offsets
        in_range = (key_pos < length) & (key_pos >= first_key)
        allowed = jnp.broadcast_to(in_range[None, :], (rows, tile))
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

    sinks = None
    if sinks_ref is not None:  # the sink counts once per row: in the first split only
        sinks = jnp.where(split_idx == 0, sinks_ref[...], planning.MASK_VALUE)
    state = lax.fori_loop(tile_lo, tile_hi, body, common.init_softmax_state(rows, q.shape[1], sinks))
    out, lse = common.finish_softmax(state)
    out_ref[...] = out.astype(out_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = lse


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "pages_per_compute_block",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "poison_output",
    ),
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Decode attention over a paged KV cache; see ``pallas_kernels.paged_attention``.

    ``poison_output=True`` (tests only) hands the kernel NaN-filled output
    buffers, so any element the kernel fails to write shows up as NaN.
    """
    common.require_backend(interpret)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = planning.validate_paged_kv(
        num_q_heads, head_dim, k_pages, v_pages, k_scales, v_scales
    )
    planning.validate_decode_request(batch, lengths, page_indices, sliding_window)
    pages_per_seq = page_indices.shape[1]
    plan = planning.plan_decode(
        num_q_heads,
        num_kv_heads,
        page_size,
        pages_per_seq,
        pages_per_compute_block=pages_per_compute_block,
        num_splits=num_splits,
        kv_itemsize=k_pages.dtype.itemsize,
        head_dim=head_dim,
    )
    scale = planning.default_sm_scale(head_dim) if sm_scale is None else float(sm_scale)

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, pages_per_seq * page_size)
    page_table = planning.sanitize_page_indices(page_indices, lengths, page_size, plan.table_width)

    group, rows = plan.group_size, plan.group_rows
    q_tiles = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    quantized = k_scales is not None
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, plan.table_width), lambda b, h, s: (b, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0)),
        pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0)),
    ]
    inputs = [lengths, page_table, q_tiles, k_pages, v_pages]
    if quantized:
        scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda b, h, s: (h, 0, 0))
        in_specs += [scale_spec, scale_spec]
        inputs += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((None, rows), lambda b, h, s: (h, 0)))
        inputs.append(planning.group_sinks(sinks, num_q_heads, num_kv_heads, rows))

    if plan.num_splits == 1:
        out_shapes = [jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))]
    else:
        splits = plan.num_splits
        out_shapes = [
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ]

    aliases: dict[int, int] = {}
    num_aliased = 0
    if poison_output:
        num_aliased = len(out_shapes)
        for i, (shape, spec) in enumerate(zip(out_shapes, out_specs)):
            aliases[len(inputs)] = i
            inputs.append(jnp.full(shape.shape, jnp.nan, shape.dtype))
            in_specs.append(spec)

    kernel = functools.partial(
        _decode_kernel,
        plan=plan,
        page_size=page_size,
        sm_scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=quantized,
        has_sinks=sinks is not None,
        num_aliased=num_aliased,
    )
    keys = visible_keys(plan.table_width * page_size, sliding_window, 1, plan.pages_per_block * page_size)
    cost = attention_cost(query_rows=batch * num_kv_heads * rows, keys=keys, head_dim=head_dim,
                          kv_bytes_per_key=kv_bytes_per_key(head_dim, k_pages.dtype, quantized),
                          kv_reads=batch * num_kv_heads * keys, io_bytes=nbytes(q_tiles, page_table, *out_shapes),
                          soft_cap=soft_cap is not None)
    results = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, plan.num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        compiler_params=common.compiler_params(num_warps, num_stages),
        cost_estimate=cost,
        interpret=interpret,
        name=f"jaxserve_paged_decode_r{rows}_p{plan.pages_per_block}x{page_size}_s{plan.num_splits}",
    )(*inputs)

    if plan.num_splits == 1:
        out = results[0][:, :, :group]
    else:
        partial_out, partial_lse = results
        out = planning.merge_split_results(partial_out[..., :group, :], partial_lse[..., :group])
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)

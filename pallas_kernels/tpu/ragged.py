"""Mosaic TPU ragged paged attention: decode rows and prefill/extend chunks of one batch in one kernel call.

Queries come in the engine's layout, `q: [B, T, q_heads, head_dim]` with row `b`'s real tokens at
`q[b, :query_lens[b]]` (a decode row has 1, a prefill chunk up to `T`). Each grid cell
`(row, kv_head, query_block)` takes `query_block` tokens of one row together with the KV head's whole query
group as the rows of its matmuls (`query_block * group` of them), and cells past a row's query length only
write zeros. A cell walks the row's page table (its row only, in SMEM) a block of pages at a time,
copying each page's `[page_size, head_dim]` tile HBM -> VMEM with `make_async_copy` into one of two
buffers, so block `j + 1` is in flight while block `j` is computed (online softmax in float32). Each query sees
the keys up to its own position (causal) or, with `query_limits`, up to its limit (Gemma 3's image tokens see
their whole image): each cell's rows' limits come as a VMEM block, and its query block's largest limit is
scalar-prefetched to end its walk. It reads only the blocks that range (and the sliding window, which counts back
from the query's position) needs. Int8/fp8 pages come with float32 per-token
scales: each page's `[1, page_size]` row is copied alongside the page into its own sublane row of a
`[pages_per_block, page_size]` buffer (Mosaic copies no row into a lane slice), spread along the keys by an exact
selection matmul and applied to the scores and probabilities. Attention sinks (one logit per
query head, gpt-oss) start each row's online softmax as a key of that logit with no value. A latent pool (MLA,
`value_dim`) is copied once per block: its rows are the keys and their first `value_dim` lanes the values.

Each copy lands in a slice of the VMEM buffer; no DMA'd ref is reshaped or bitcast, so the same code runs in
Pallas' TPU interpret mode (`interpret=pltpu.InterpretParams()`) on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._cost import attention_cost, kv_bytes_per_key, nbytes, visible_keys
from pallas_kernels._planning import cdiv, default_sm_scale, group_sinks, sanitize_page_indices, validate_paged_kv

TARGET_BLOCK_TOKENS = 128  # keys per KV block (one 128-row tile of K and of V per block)
TARGET_QUERY_ROWS = 128  # matmul rows (query tokens x query heads of a group) per grid cell


def query_block_tokens(num_tokens: int, group: int) -> int:
    """Query tokens per grid cell: all `num_tokens` if their group's rows fit `TARGET_QUERY_ROWS`, else halved
    while they exceed it and stay even (the engine's token buckets are powers of two)."""
    tokens = num_tokens
    while tokens * group > TARGET_QUERY_ROWS and tokens % 2 == 0:
        tokens //= 2
    return tokens


def _kernel(context_lens, query_lens, *rest, sm_scale, sliding_window, soft_cap, group, query_tokens, page_size,
            pages_per_block, quantized, has_sinks, has_limits, value_dim):
    sinks_ref = block_limits = limits_ref = None
    if has_limits:  # int32[B * query blocks]: each query block's largest limit over its real tokens
        block_limits, *rest = rest
    q_ref, page_table, k_hbm, v_hbm, *rest = rest
    if quantized:
        k_scales_hbm, v_scales_hbm, *rest = rest
    if has_sinks:
        sinks_ref, *rest = rest  # f32[rows, 1]: this KV head's query heads, once per token
    if has_limits:
        limits_ref, *rest = rest  # int32[rows, 1]: each row's last visible key, once per query head
    if quantized:
        o_ref, k_buf, v_buf, ks_buf, vs_buf, sems = rest
    else:
        o_ref, k_buf, v_buf, sems = rest
    row, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    context, query_len = context_lens[row], query_lens[row]
    first_token = q_block * query_tokens
    block_tokens = pages_per_block * page_size

    def copies(block, slot):
        """The DMAs of KV block `block` into buffer `slot` (rebuilt identically to wait on them)."""
        out = []
        for p in range(pages_per_block):
            page = page_table[block * pages_per_block + p]
            tile = pl.ds(p * page_size, page_size)
            out.append(pltpu.make_async_copy(k_hbm.at[head, page], k_buf.at[slot, tile], sems.at[0, slot]))
            if value_dim is None:  # a latent pool (MLA) has no values of its own: they are the keys' first dims
                out.append(pltpu.make_async_copy(v_hbm.at[head, page], v_buf.at[slot, tile], sems.at[1, slot]))
            if quantized:  # a page's [1, page_size] scales into sublane row p (Mosaic copies no lane slices)
                one, row_p = pl.ds(page, 1), pl.ds(p, 1)
                out.append(pltpu.make_async_copy(k_scales_hbm.at[head, one], ks_buf.at[slot, row_p],
                                                 sems.at[2, slot]))
                out.append(pltpu.make_async_copy(v_scales_hbm.at[head, one], vs_buf.at[slot, row_p],
                                                 sems.at[3, slot]))
        return out

    def key_row(scales, block):
        """A block's scales `[pages_per_block, page_size]` (0 past the context: unowned slots may hold NaN) as the
        `[1, block_tokens]` row of its keys, by an exact 0/1 selection matmul (Mosaic refuses the reshape:
        "unsupported shape cast")."""
        page = jax.lax.broadcasted_iota(jnp.int32, scales.shape, 0)
        offset = jax.lax.broadcasted_iota(jnp.int32, scales.shape, 1)
        scales = jnp.where(block * block_tokens + page * page_size + offset < context, scales, 0.0)
        if pages_per_block == 1:
            return scales
        lane = jax.lax.broadcasted_iota(jnp.int32, (page_size, block_tokens), 1)
        select = (lane % page_size == jax.lax.broadcasted_iota(jnp.int32, (page_size, block_tokens), 0))
        spread = jax.lax.dot(scales, select.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)  # [pages, block_tokens]: page p's scales, tiled
        mine = jax.lax.broadcasted_iota(jnp.int32, spread.shape, 1) // page_size == jax.lax.broadcasted_iota(
            jnp.int32, spread.shape, 0)
        return jnp.sum(jnp.where(mine, spread, 0.0), axis=0, keepdims=True)

    @pl.when((first_token < query_len) & (context > 0))
    def _attend():
        rows = query_tokens * group
        token = first_token + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
        q_pos = context - query_len + token  # [rows, 1]
        real = token < query_len
        last_token = jnp.minimum(first_token + query_tokens, query_len) - 1
        kv_end = context - query_len + last_token + 1  # keys [kv_start, kv_end) are visible to some row
        q_limit = q_pos
        if has_limits:  # limits are at least their queries' positions: they only move the end
            kv_end = jnp.minimum(context, block_limits[row * pl.num_programs(2) + q_block] + 1)
            q_limit = limits_ref[...]
        kv_start = 0
        if sliding_window is not None:
            kv_start = jnp.maximum(context - query_len + first_token - sliding_window + 1, 0)
        first_block, end_block = kv_start // block_tokens, cdiv(kv_end, block_tokens)
        q = q_ref[...]

        for c in copies(first_block, 0):
            c.start()

        def body(block, carry):
            running_max, denominator, accumulator = carry
            slot = (block - first_block) % 2

            @pl.when(block + 1 < end_block)
            def _prefetch():
                for c in copies(block + 1, 1 - slot):
                    c.start()

            for c in copies(block, slot):
                c.wait()
            key_pos = block * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
            in_context = key_pos < context
            keys = k_buf[slot]
            values = v_buf[slot] if value_dim is None else keys[:, :value_dim]
            if quantized:  # int8 and fp8 convert exactly; the scales apply to scores and probabilities
                keys, values = keys.astype(q.dtype), values.astype(q.dtype)
            # slots past the context (pages the row does not own, the scratch page) may hold NaN or inf:
            # a zero probability times NaN is still NaN, so their values are zeroed, not just their scores masked
            value_pos = block * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
            values = jnp.where(value_pos < context, values, 0)
            scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            scores = scores * sm_scale
            if quantized:
                scores = scores * key_row(ks_buf[slot], block)
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (key_pos <= q_limit) & in_context & real
            if sliding_window is not None:
                visible &= key_pos > q_pos - sliding_window
            scores = jnp.where(visible, scores, -jnp.inf)
            new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))
            safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # rows with nothing visible yet
            probs = jnp.exp(scores - safe_max)
            rescale = jnp.exp(running_max - safe_max)
            denominator = denominator * rescale + jnp.sum(probs, axis=1, keepdims=True)
            if quantized:
                probs = probs * key_row(vs_buf[slot], block)
            accumulator = accumulator * rescale + jax.lax.dot(
                probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
            return new_max, denominator, accumulator

        if sinks_ref is None:
            running_max, denominator = jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
        else:
            running_max, denominator = sinks_ref[...], jnp.ones((rows, 1), jnp.float32)
        init = (running_max, denominator, jnp.zeros((rows, o_ref.shape[-1]), jnp.float32))
        _, denominator, accumulator = jax.lax.fori_loop(first_block, end_block, body, init)
        out = accumulator / jnp.maximum(denominator, 1e-30)
        o_ref[...] = jnp.where(real, out, 0.0).astype(o_ref.dtype)

    @pl.when((first_token >= query_len) | (context <= 0))
    def _padding():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages_per_block",
                                             "query_tokens", "value_dim", "interpret"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array | None, context_lens: jax.Array,
                           query_lens: jax.Array, page_tables: jax.Array, *, k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None, sm_scale: float | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, query_limits: jax.Array | None = None,
                           pages_per_block: int | None = None,
                           query_tokens: int | None = None, value_dim: int | None = None,
                           interpret: pltpu.InterpretParams | None = None) -> jax.Array:
    """Attention of each row's new tokens over its paged K/V (already holding those tokens): causal, or up to each
    query's limit.

    Args:
      q: [B, T, q_heads, head_dim]; row `b`'s tokens `q[b, :query_lens[b]]` sit at positions
        `context_lens[b] - query_lens[b] + i`; the rest is padding (its output is 0, its contents, even NaN,
        affect nothing). Query head `i` reads KV head `i // (q_heads // kv_heads)`.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] in q's dtype, or int8 / float8_e4m3fn with
        `k_scales`, `v_scales`: float32 [kv_heads, num_pages, page_size] (k = k_pages * k_scales).
      context_lens: int32 [B], keys per row after this step (0: an inactive row, all zeros).
      query_lens: int32 [B], real query tokens per row (<= T and <= context_lens).
      page_tables: int32 [B, pages_per_row]; entries past a row's `ceil(context / page_size)` are not read.
      sm_scale: logit scale, default 1 / sqrt(head_dim).
      sliding_window: if set, query at position p sees keys at positions > p - sliding_window only.
      soft_cap: if set, scaled scores are capped as soft_cap * tanh(s / soft_cap) (Gemma 2).
      sinks: if set, f32 [q_heads] attention sinks (gpt-oss): one more logit per query head in each softmax,
        with no value.
      query_limits: if set, int32 [B, T]: the last key position each query sees instead of its own (Gemma 3's
        image tokens see their whole image), clipped to the row's context; at least the query's position (not
        checked: a smaller one hides the query's own key). The sliding window still counts back from the query's
        position; padding's limits are ignored. None: causal, the same kernel as before limits existed.
      pages_per_block: pages per KV block (default: `TARGET_BLOCK_TOKENS` keys, at most the table's width).
      query_tokens: query tokens per grid cell, dividing T (default `query_block_tokens`).
      value_dim: Multi-head Latent Attention's pool (DeepSeek, absorbed): `v_pages` is None and each key's first
        `value_dim` dims (a multiple of 128) are its value, read from the same copy of the page; the output is
        `[B, T, q_heads, value_dim]`.
      interpret: `pltpu.InterpretParams()` to run in Pallas' TPU interpreter (any backend), None on a TPU.

    Returns:
      [B, T, q_heads, head_dim] in q's dtype.
    """
    batch, num_tokens, q_heads, head_dim = q.shape
    latent = value_dim is not None
    if latent and (k_scales is not None or value_dim % 128 or value_dim > head_dim):
        raise ValueError(f"value_dim {value_dim}: a latent pool is unquantized and its values are whole lanes of "
                         f"its {head_dim}-wide rows")
    v_pages = k_pages if latent else v_pages  # passed twice, copied once
    out_dim = value_dim if latent else head_dim
    kv_heads, num_pages, page_size = validate_paged_kv(q_heads, head_dim, k_pages, v_pages, k_scales, v_scales,
                                                       triton_tiles=False)
    quantized = k_scales is not None
    group = q_heads // kv_heads
    query_tokens = query_tokens or query_block_tokens(num_tokens, group)
    if num_tokens % query_tokens:
        raise ValueError(f"query_tokens ({query_tokens}) must divide the query length T ({num_tokens})")
    width = page_tables.shape[1]
    pages_per_block = pages_per_block or max(1, min(TARGET_BLOCK_TOKENS // page_size, width))
    width = cdiv(width, pages_per_block) * pages_per_block
    context_lens = context_lens.astype(jnp.int32)
    query_lens = jnp.clip(query_lens.astype(jnp.int32), 0, jnp.minimum(context_lens, num_tokens))
    table = sanitize_page_indices(jnp.clip(page_tables, 0, num_pages - 1), context_lens, page_size, width)
    scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale

    # [B, kv_heads, T * group, D]: a KV head's query group, token-major, as the rows of one matmul
    q_rows = q.reshape(batch, num_tokens, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, kv_heads, num_tokens * group, head_dim)
    rows = query_tokens * group
    block_tokens = pages_per_block * page_size

    def q_index(b, h, i, context_lens, query_lens, *_):  # cells past a row's tokens keep the last block
        last = jnp.maximum(query_lens[b] - 1, 0) // query_tokens
        return b, h, jnp.minimum(i, last), 0

    row_spec = pl.BlockSpec((None, None, rows, head_dim), q_index)
    out_spec = pl.BlockSpec((None, None, rows, out_dim), lambda b, h, i, *_: (b, h, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # one row of the table at a time: all of it, scalar-prefetched, overflowed SMEM (1 MiB) at 512 x 1024 pages
    table_spec = pl.BlockSpec((None, None, width), lambda b, h, i, *_: (b, 0, 0), memory_space=pltpu.SMEM)
    in_specs = [row_spec, table_spec, hbm, hbm]
    operands = [q_rows, table[:, None], k_pages, v_pages]  # [B, 1, width]: blocks span whole trailing dims
    scratch = [pltpu.VMEM((2, block_tokens, head_dim), k_pages.dtype),
               pltpu.VMEM((2, 8, 128) if latent else (2, block_tokens, head_dim), v_pages.dtype)]  # latent: unused
    if quantized:
        in_specs += [hbm, hbm]
        operands += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
        scratch += [pltpu.VMEM((2, pages_per_block, page_size), jnp.float32)] * 2
    if sinks is not None:
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda b, h, i, *_: (h, 0, 0)))
        operands.append(group_sinks(sinks, q_heads, kv_heads, group, repeats=query_tokens)[..., None])
    prefetch = [context_lens, query_lens]
    if query_limits is not None:
        if query_limits.shape != (batch, num_tokens):
            raise ValueError(f"query_limits must be [B, T] = {(batch, num_tokens)}; got {query_limits.shape}")
        limits = query_limits.astype(jnp.int32)
        real = jnp.arange(num_tokens, dtype=jnp.int32)[None, :] < query_lens[:, None]
        prefetch.append(jnp.where(real, limits, -1).reshape(batch, -1, query_tokens).max(axis=-1).reshape(-1))
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda b, h, i, *refs: (b, q_index(b, h, i, *refs)[2], 0)))
        operands.append(jnp.repeat(limits, group, axis=1)[..., None])  # [B, T * group, 1], token-major like q_rows
    scratch.append(pltpu.SemaphoreType.DMA((4 if quantized else 2, 2)))
    kernel = functools.partial(
        _kernel, sm_scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, group=group,
        query_tokens=query_tokens,
        page_size=page_size, pages_per_block=pages_per_block, quantized=quantized,
        has_sinks=sinks is not None, has_limits=query_limits is not None, value_dim=value_dim)
    cells = batch * kv_heads * (num_tokens // query_tokens)
    keys = visible_keys(width * page_size, sliding_window, query_tokens, block_tokens)
    key_bytes = kv_bytes_per_key(head_dim, k_pages.dtype, quantized) // (2 if latent else 1)
    cost = attention_cost(query_rows=batch * num_tokens * q_heads, keys=keys, head_dim=head_dim,
                          kv_bytes_per_key=key_bytes,
                          kv_reads=cells * keys, io_bytes=2 * nbytes(q) + 4 * table.size, soft_cap=soft_cap is not None)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(batch, kv_heads, num_tokens // query_tokens), in_specs=in_specs,
            out_specs=out_spec, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((*q_rows.shape[:-1], out_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        cost_estimate=cost,
        interpret=interpret if interpret is not None else False,
    )(*prefetch, *operands)
    out = out.reshape(batch, kv_heads, num_tokens, group, out_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, num_tokens, q_heads, out_dim)

"""Multi-head Latent Attention decode kernel (DeepSeek-V2/V3, absorbed), Triton backend.

The cache holds one latent row per token, ``[c | k_rope]`` (``latent_dim + rope_dim`` values, the width of
DeepSeek-V3's 512 + 64), in a pool of one "head"; every query head attends over it as multi-query attention:
its query is ``[q_latent | q_rope]`` (the no-rope query already moved into latent space), its score
``q_latent . c + q_rope . k_rope``, and its value the row's latent ``c``. Each row of the pool is read once for
both: the two parts of a KV tile are loaded as two column ranges (powers of two, as Triton's tiles need, where
their sum is not), scored as two products, and the latent part multiplies the probabilities.

Grid: (batch, head_blocks, kv_split). A program takes ``block_heads`` query heads (a power of two >= 16) of one
sequence, walks its share of the page table in tiles of ``pages_per_block`` pages with an online softmax in
float32, and writes ``[block_heads, latent_dim]``; with more than one split, normalized partials and their
log-sum-exp merged afterwards (flash-decoding), as the paged decode kernel does.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _planning as planning
from pallas_kernels._cost import attention_cost, nbytes
from pallas_kernels.triton import _common as common

BLOCK_HEADS = 16  # query heads per program: the float32 accumulator is [16, latent_dim]
TILE_TOKENS = {2: 64, 4: 32}  # keys per KV tile by the pool's itemsize: about 64 KiB of a 512 + 64 pool


def _mla_decode_kernel(lengths_ref: Any, page_table_ref: Any, q_latent_ref: Any, q_rope_ref: Any, pages_ref: Any,
                       *refs: Any, plan: planning.DecodePlan, page_size: int, sm_scale: float, latent_dim: int,
                       rope_dim: int, block_heads: int, num_aliased: int) -> None:
    """q_latent_ref [block_heads, latent], q_rope_ref [block_heads, rope], pages_ref [num_pages, page_size, width]
    (the pool's one head), page_table_ref int32[table_width] (this sequence's row)."""
    refs = refs[num_aliased:]  # NaN-poisoned buffers aliased to the outputs
    out_ref, lse_ref = refs if plan.num_splits > 1 else (*refs, None)
    batch_idx, split_idx = pl.program_id(0), pl.program_id(2)
    tile = plan.pages_per_block * page_size
    length = lengths_ref[batch_idx]
    first_tile = split_idx * plan.blocks_per_split
    tile_hi = jnp.minimum(first_tile + plan.blocks_per_split, lax.div(length + tile - 1, tile))
    q_latent, q_rope = q_latent_ref[...], q_rope_ref[...]
    offsets = lax.broadcasted_iota(jnp.int32, (tile,), 0)

    def body(tile_idx: jax.Array, state: Any) -> Any:
        acc, m_prev, l_prev = state
        page_ids = page_table_ref[common.ds(tile_idx * plan.pages_per_block, plan.pages_per_block)]
        in_range = tile_idx * tile + offsets < length
        latent = pages_ref[page_ids, :, common.ds(0, latent_dim)].reshape(tile, latent_dim)
        rope = pages_ref[page_ids, :, common.ds(latent_dim, rope_dim)].reshape(tile, rope_dim)
        latent = jnp.where(in_range[:, None], latent, jnp.zeros_like(latent))  # foreign slots may hold NaN
        rope = jnp.where(in_range[:, None], rope, jnp.zeros_like(rope))
        logits = (common.matmul(q_latent, latent.astype(q_latent.dtype), transpose_b=True)
                  + common.matmul(q_rope, rope.astype(q_rope.dtype), transpose_b=True)) * sm_scale
        allowed = jnp.broadcast_to(in_range[None, :], (block_heads, tile))
        logits = jnp.where(allowed, logits, planning.MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.where(allowed, jnp.exp(logits - m_next[:, None]), 0.0)
        pv = common.matmul(probs.astype(q_latent.dtype), latent.astype(q_latent.dtype), transpose_b=False)
        return correction[:, None] * acc + pv, m_next, correction * l_prev + jnp.sum(probs, axis=1)

    state = lax.fori_loop(first_tile, tile_hi, body,
                          common.init_softmax_state(block_heads, latent_dim))
    out, lse = common.finish_softmax(state)
    out_ref[...] = out.astype(out_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_compute_block", "num_splits", "num_warps",
                                             "num_stages", "interpret", "poison_output"))
def mla_paged_attention(q_latent: jax.Array, q_rope: jax.Array, pages: jax.Array, lengths: jax.Array,
                        page_indices: jax.Array, *, sm_scale: float, pages_per_compute_block: int | None = None,
                        num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                        interpret: bool = False, poison_output: bool = False) -> jax.Array:
    """Decode attention of every query head over one latent pool; see ``pallas_kernels.mla_paged_attention``.
    ``poison_output=True`` (tests only) hands the kernel NaN-filled output buffers."""
    common.require_backend(interpret)
    batch, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[-1]
    if pages.ndim != 4 or pages.shape[0] != 1 or pages.shape[-1] < latent_dim + rope_dim:
        raise ValueError(f"pages {pages.shape} must be one latent pool [1, num_pages, page_size, >= "
                         f"{latent_dim + rope_dim}]")
    if q_rope.shape[:2] != (batch, num_heads) or not all(planning.is_power_of_2(d) and d >= 16
                                                         for d in (latent_dim, rope_dim)):
        raise ValueError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape}: one row per head each, widths "
                         "powers of two >= 16")
    _, num_pages, page_size, width = pages.shape
    planning.validate_decode_request(batch, lengths, page_indices, None)
    pages_per_seq = page_indices.shape[1]
    target = TILE_TOKENS[min(4, max(2, pages.dtype.itemsize))]
    ppcb = pages_per_compute_block or planning.pages_per_kv_block(page_size, pages_per_seq, None, target)
    plan = planning.plan_decode(num_heads, 1, page_size, pages_per_seq, pages_per_compute_block=ppcb,
                                num_splits=num_splits, kv_itemsize=pages.dtype.itemsize, head_dim=latent_dim)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, pages_per_seq * page_size)
    page_table = planning.sanitize_page_indices(page_indices, lengths, page_size, plan.table_width)

    block_heads = max(16, min(BLOCK_HEADS, planning.next_power_of_2(num_heads)))
    head_blocks = planning.cdiv(num_heads, block_heads)
    padded = head_blocks * block_heads

    def tiles(q):
        q = jnp.pad(q, ((0, 0), (0, padded - num_heads), (0, 0))) if padded != num_heads else q
        return q.reshape(batch, head_blocks, block_heads, q.shape[-1])

    inputs = [lengths, page_table, tiles(q_latent), tiles(q_rope), pages[0]]
    in_specs = [pl.BlockSpec((batch,), lambda b, h, s: (0,)),
                pl.BlockSpec((None, plan.table_width), lambda b, h, s: (b, 0)),
                pl.BlockSpec((None, None, block_heads, latent_dim), lambda b, h, s: (b, h, 0, 0)),
                pl.BlockSpec((None, None, block_heads, rope_dim), lambda b, h, s: (b, h, 0, 0)),
                pl.BlockSpec((num_pages, page_size, width), lambda b, h, s: (0, 0, 0))]
    splits = plan.num_splits
    if splits == 1:
        out_shapes = [jax.ShapeDtypeStruct((batch, head_blocks, block_heads, latent_dim), q_latent.dtype)]
        out_specs = [pl.BlockSpec((None, None, block_heads, latent_dim), lambda b, h, s: (b, h, 0, 0))]
    else:
        out_shapes = [jax.ShapeDtypeStruct((batch, head_blocks, splits, block_heads, latent_dim), jnp.float32),
                      jax.ShapeDtypeStruct((batch, head_blocks, splits, block_heads), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, block_heads, latent_dim), lambda b, h, s: (b, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, block_heads), lambda b, h, s: (b, h, s, 0))]
    aliases: dict[int, int] = {}
    num_aliased = len(out_shapes) if poison_output else 0
    for i, (shape, spec) in enumerate(zip(out_shapes, out_specs) if poison_output else ()):
        aliases[len(inputs)] = i
        inputs.append(jnp.full(shape.shape, jnp.nan, shape.dtype))
        in_specs.append(spec)

    kernel = functools.partial(_mla_decode_kernel, plan=plan, page_size=page_size, sm_scale=float(sm_scale),
                               latent_dim=latent_dim, rope_dim=rope_dim, block_heads=block_heads,
                               num_aliased=num_aliased)
    keys = plan.table_width * page_size
    cost = attention_cost(query_rows=batch * padded, keys=keys, head_dim=latent_dim + rope_dim,
                          kv_bytes_per_key=width * pages.dtype.itemsize, kv_reads=batch * head_blocks * keys,
                          io_bytes=nbytes(q_latent, q_rope, page_table, *out_shapes), soft_cap=False)
    results = pl.pallas_call(
        kernel, grid=(batch, head_blocks, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shapes,
        input_output_aliases=aliases, compiler_params=common.compiler_params(num_warps, num_stages),
        cost_estimate=cost, interpret=interpret,
        name=f"jaxserve_mla_decode_h{block_heads}_p{plan.pages_per_block}x{page_size}_s{splits}",
    )(*inputs)
    if splits == 1:
        out = results[0]
    else:
        out = planning.merge_split_results(results[0], results[1])
    return out.reshape(batch, padded, latent_dim)[:, :num_heads].astype(q_latent.dtype)

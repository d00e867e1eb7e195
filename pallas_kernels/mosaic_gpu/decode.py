"""Paged-attention decode kernel (one new query token per sequence) on Mosaic GPU (Hopper).

Grid ``(batch, kv_head, split)``, one warpgroup per CTA.  A KV head's query group is
padded to a 64-row tile (wgmma's M; decode is bandwidth-bound, so idle rows cost little)
and TMA'd to SMEM once.  The program walks its split's share of the page table in tiles
of ``pages_per_block`` pages (a multiple of 64 tokens): one TMA per page of K and of V,
with the page id read from the sanitized page table in GMEM, then ``S = Q K^T`` by wgmma
(K transposed by a ref transform), an online softmax in float32 in the wgmma register
layout, the tile's invalid V rows zeroed in SMEM (a poisoned slot must not reach
``P V`` as ``0 * NaN``), P stored to SMEM in q's dtype, and ``P V`` by wgmma.  K/V tiles
go through a 2-slot SMEM ring: tile ``t + 1``'s TMAs are issued before tile ``t`` computes.
Quantized pools (int8 / float8_e4m3fn with per-token float32 scales): pages land in the
ring as they are and are converted exactly to q's dtype in registers, into a separate
SMEM tile for the wgmma; the K scales scale S's columns and the V scales P's columns (as
the Triton kernel).  A TMA moves a multiple of 128 bytes, so the scales (4 bytes a token)
are gathered per row in XLA and copied one tile at a time.
Each split writes a normalized partial output and its log-sum-exp, merged in XLA with
``_planning.merge_split_results`` (as the Triton decode kernel), so the batch-invariance
argument of ``pallas_kernels.paged_attention`` holds here too.

``interpret=True`` runs the kernel in Pallas' GPU interpreter (jax 0.10.2:
``jax._src.pallas.mosaic_gpu.interpret``) on the CPU.  That interpreter cannot run some
things this kernel uses, so only there they are replaced: ``plgpu.layout_cast``,
``plgpu.broadcasted_iota`` and ``plgpu.load(..., layout=...)`` (register layouts, which do
not change values; ``ref[...]`` and ``lax.broadcasted_iota`` instead) and the ``Q K^T``
wgmma with a transposed operand (a ``jnp.dot`` of the same SMEM tiles).
Everything else -- TMAs, barriers, page-table reads, masking, softmax, the ``P V``
wgmma, the SMEM -> GMEM stores -- is the same code in both modes.  The compiled path is
checked by lowering it for CUDA on the CPU (``lower(lowering_platforms=("cuda",))``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _planning as planning
from pallas_kernels._cost import attention_cost, kv_bytes_per_key, nbytes, visible_keys
from pallas_kernels.mosaic_gpu._limits import ROWS, STAGES, SWIZZLE_BYTES, check_tile, validate

def _smem_transforms(dtype: Any, swizzle: int = SWIZZLE_BYTES) -> tuple[Any, ...]:
    cols = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(swizzle))


def _to_compute(x: jax.Array, dtype: Any) -> jax.Array:
    """int8 / e4m3 / q's dtype -> q's dtype, exactly (e4m3 -> bf16 goes through f32: no direct cvt)."""
    if x.dtype == jnp.float8_e4m3fn:
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def _decode_kernel(
    lengths_gmem: Any,  # int32[batch]
    table_gmem: Any,  # int32[batch, table_width], sanitized
    q_gmem: Any,  # [batch, kv_heads, ROWS, D]
    k_gmem: Any,  # [kv_heads, num_pages, page_size, D]
    v_gmem: Any,
    *refs: Any,  # [k_scales, v_scales: f32[kv_heads, batch, tiles, tile]], out, lse
    quantized: bool,
    plan: planning.DecodePlan,
    page_size: int,
    head_dim: int,
    sm_scale: float,
    sliding_window: int | None,
    interpret: bool,
) -> None:
    if quantized:
        ks_gmem, vs_gmem, out_gmem, lse_gmem = refs
    else:
        out_gmem, lse_gmem = refs  # f32[batch, kv_heads, splits, ROWS(, D)]
    dtype = q_gmem.dtype
    pages = plan.pages_per_block
    tile = pages * page_size
    wgmma_layout = plgpu.Layout.WGMMA

    def layout(x: jax.Array, lay: Any) -> jax.Array:
        return x if interpret else plgpu.layout_cast(x, lay)

    def iota(shape: tuple[int, int], dim: int) -> jax.Array:
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout)

    def read(ref: Any) -> jax.Array:  # a quantized tile, from plain SMEM into the wgmma layout
        return ref[...] if interpret else plgpu.load(ref, (), layout=wgmma_layout)

    b = lax.axis_index("batch")
    h = lax.axis_index("kv_head")
    split = lax.axis_index("split")

    def scoped(q_smem, k_ring, v_ring, p_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, *quant):
        # quantized: K/V pages land in k_ring / v_ring as int8 / fp8 and are converted to q's dtype
        # into k_tile / v_tile; their per-token scales land in ks_ring / vs_ring.
        k_tile, v_tile, ks_ring, vs_ring = quant if quantized else (None,) * 4
        length = lengths_gmem[b]
        first_key = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
        split_first = split * plan.blocks_per_split
        tile_lo = jnp.maximum(split_first, lax.div(first_key, tile))
        tile_hi = jnp.minimum(split_first + plan.blocks_per_split, lax.div(length + tile - 1, tile))

        plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def fetch(t: jax.Array, slot: jax.Array) -> None:
            for p in range(pages):  # each barrier of k_bar / v_bar expects one arrival per copy
                page = table_gmem[b, t * pages + p]
                rows = pl.ds(p * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_gmem.at[h, page], k_ring.at[slot, rows], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_gmem.at[h, page], v_ring.at[slot, rows], v_bar.at[slot])
            if quantized:  # a TMA moves a multiple of 128 bytes: scales go per tile, gathered in XLA
                plgpu.copy_gmem_to_smem(ks_gmem.at[h, b, t], ks_ring.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(vs_gmem.at[h, b, t], vs_ring.at[slot], v_bar.at[slot])

        @pl.when(tile_lo < tile_hi)
        def _first_fetch() -> None:
            fetch(tile_lo, 0)

        def step(t: jax.Array, carry: Any) -> Any:
            acc, m, l = carry
            slot = lax.rem(t - tile_lo, STAGES)

            # Tile t - 1 used the other slot and its wgmmas are done (their results were read).
            @pl.when(t + 1 < tile_hi)
            def _prefetch() -> None:
                fetch(t + 1, lax.rem(t + 1 - tile_lo, STAGES))

            k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
            plgpu.barrier_wait(k_bar.at[slot])
            if quantized:
                k_tile[...] = _to_compute(read(k_smem), dtype)
                plgpu.commit_smem()
                k_smem = k_tile
            if interpret:
                s = jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)
            else:
                def qk(acc_ref: Any) -> jax.Array:
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, tile), jnp.float32))
            key = t * tile + iota((ROWS, tile), 1)
            allowed = (key < length) & (key >= first_key)
            s = s * sm_scale
            if quantized:
                k_scale = layout(ks_ring.at[slot][...], wgmma_layout.reduce(0))
                s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
            s = jnp.where(allowed, s, planning.MASK_VALUE)
            m_next = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_next)
            probs = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            l = l * alpha + probs.sum(axis=1)

            plgpu.barrier_wait(v_bar.at[slot])
            v_key = t * tile + iota((tile, head_dim), 0)
            v = _to_compute(read(v_smem) if quantized else v_smem[...], dtype)
            if quantized:
                v_smem = v_tile
                v_scale = layout(vs_ring.at[slot][...], wgmma_layout.reduce(0))
                v_scale = jnp.where(allowed, lax.broadcast_in_dim(v_scale, s.shape, [1]), 0.0)
                probs_v = probs * v_scale
            else:
                probs_v = probs
            v_smem[...] = jnp.where((v_key < length) & (v_key >= first_key), v, jnp.zeros_like(v))
            p_smem[...] = probs_v.astype(dtype)
            plgpu.commit_smem()

            def pv(acc_ref: Any) -> jax.Array:
                plgpu.wgmma(acc_ref, p_smem, v_smem)
                return acc_ref[...]

            update = pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + update
            return acc, m_next, l

        row_layout = wgmma_layout.reduce(1)
        init = (
            layout(jnp.zeros((ROWS, head_dim), jnp.float32), wgmma_layout),
            layout(jnp.full((ROWS,), planning.MASK_VALUE, jnp.float32), row_layout),
            layout(jnp.zeros((ROWS,), jnp.float32), row_layout),
        )
        acc, m, l = lax.fori_loop(tile_lo, tile_hi, step, init)
        nonempty = l > 0
        safe_l = jnp.where(nonempty, l, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
        lse_smem[...] = jnp.where(nonempty, m + jnp.log(safe_l), planning.MASK_VALUE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[b, h, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[b, h, split])
        plgpu.wait_smem_to_gmem(0)

    kv_tr = _smem_transforms(dtype, min(SWIZZLE_BYTES, head_dim * jnp.dtype(dtype).itemsize))
    kv_dtype = k_gmem.dtype
    ring_tr = _smem_transforms(kv_dtype, min(SWIZZLE_BYTES, head_dim * kv_dtype.itemsize))
    arrivals = pages + (1 if quantized else 0)  # a copy per page, and the tile's scales
    quant = []
    if quantized:
        quant = [
            plgpu.SMEM((tile, head_dim), dtype, transforms=kv_tr),
            plgpu.SMEM((tile, head_dim), dtype, transforms=kv_tr),
            plgpu.SMEM((STAGES, tile), jnp.float32),
            plgpu.SMEM((STAGES, tile), jnp.float32),
        ]
    pl.run_scoped(
        scoped,
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=kv_tr),
        plgpu.SMEM((STAGES, tile, head_dim), kv_dtype, transforms=ring_tr),
        plgpu.SMEM((STAGES, tile, head_dim), kv_dtype, transforms=ring_tr),
        plgpu.SMEM((ROWS, tile), dtype, transforms=kv_tr),
        plgpu.SMEM((ROWS, head_dim), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=STAGES),
        *quant,
    )


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "pages_per_compute_block", "num_splits", "interpret"),
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Decode attention; the contract of ``pallas_kernels.paged_attention``.

    q bf16/f16 with pages of its dtype, or int8 / float8_e4m3fn pages with per-token scales;
    head_dim 16-128 (32-128 for int8/fp8; 256 exceeds SMEM), page_size a power of two >= 8.  The KV tile
    (``pages_per_compute_block * page_size`` tokens) must be a multiple of 64 and at most
    256; the default is 128 tokens (or one page when pages are larger).  ``interpret``:
    True (GPU interpret mode on the CPU), False, or an ``InterpretGPUParams``.  Attention ``sinks`` join the
    split-K merge as one more split of zero output; no soft-cap here (the engine does not run this kernel).
    """
    batch, num_q_heads, head_dim = q.shape
    kv_heads, _, page_size = validate(
        q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, sliding_window
    )
    pages_per_seq = page_indices.shape[1]
    quantized = k_scales is not None
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, 128 // page_size)
    check_tile(pages_per_compute_block * page_size, head_dim, q.dtype, k_pages.dtype, quantized)
    plan = planning.plan_decode(
        num_q_heads, kv_heads, page_size, pages_per_seq,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits,
        kv_itemsize=k_pages.dtype.itemsize,
    )
    scale = planning.default_sm_scale(head_dim) if sm_scale is None else float(sm_scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, pages_per_seq * page_size)
    table = planning.sanitize_page_indices(page_indices, lengths, page_size, plan.table_width)

    group = plan.group_size
    q_tiles = q.reshape(batch, kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))

    splits = plan.num_splits
    params = _interpret_params() if interpret is True else (interpret or None)
    inputs = [lengths, table, q_tiles, k_pages, v_pages]
    if quantized:
        tiles = plan.table_width // plan.pages_per_block
        for scales in (k_scales, v_scales):  # [kv_heads, batch, tiles, tile], per row's page table
            gathered = scales.astype(jnp.float32)[:, table]
            inputs.append(gathered.reshape(kv_heads, batch, tiles, plan.pages_per_block * page_size))
    out_type = (jax.ShapeDtypeStruct((batch, kv_heads, splits, ROWS, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((batch, kv_heads, splits, ROWS), jnp.float32))
    keys = visible_keys(plan.table_width * page_size, sliding_window, 1, plan.pages_per_block * page_size)
    cost = attention_cost(query_rows=batch * kv_heads * ROWS, keys=keys, head_dim=head_dim,
                          kv_bytes_per_key=kv_bytes_per_key(head_dim, k_pages.dtype, quantized),
                          kv_reads=batch * kv_heads * keys, io_bytes=nbytes(q_tiles, table, *out_type))
    # pl.kernel with plgpu's mesh is what plgpu.kernel builds, and it takes a cost estimate
    kernel = pl.kernel(
        functools.partial(
            _decode_kernel, plan=plan, page_size=page_size, head_dim=head_dim, sm_scale=scale,
            sliding_window=sliding_window, interpret=params is not None, quantized=quantized,
        ),
        out_type=out_type,
        mesh=plgpu.Mesh(grid=(batch, kv_heads, splits), grid_names=("batch", "kv_head", "split")),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        cost_estimate=cost,
        interpret=params,
        name="jaxserve_mosaic_gpu_paged_decode",
    )
    partial_out, partial_lse = kernel(*inputs)
    sink_logits = None if sinks is None else planning.group_sinks(sinks, num_q_heads, kv_heads, group)
    out = planning.merge_split_results(partial_out[..., :group, :], partial_lse[..., :group], sink_logits)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def _interpret_params() -> Any:
    """GPU interpret mode with NaN-filled fresh memory, so unwritten output shows up."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not public in 0.10.2

    return InterpretGPUParams(uninitialized_memory="nan")

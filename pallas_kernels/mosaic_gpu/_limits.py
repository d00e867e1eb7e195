"""What the Mosaic GPU decode kernel supports: input checks (ValueError) and its SMEM budget."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _planning as planning

ROWS = 64  # wgmma's M: the query group is padded to one 64-row tile
STAGES = 2  # SMEM ring of K/V tiles: tile t + 1 is in flight while tile t computes
KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SWIZZLE_BYTES = 128
SMEM_BYTES = 227 * 1024  # the most SMEM a Hopper CTA can allocate


def smem_bytes(tile: int, head_dim: int, dtype: Any, kv_dtype: Any, quantized: bool) -> int:
    """SMEM the kernel allocates (the scoped buffers of ``_decode_kernel``), barriers aside."""
    item, kv_item = jnp.dtype(dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    total = ROWS * head_dim * item + 2 * STAGES * tile * head_dim * kv_item + ROWS * tile * item
    total += ROWS * head_dim * 4 + ROWS * 4  # the partial output and its log-sum-exp
    if quantized:
        total += 2 * tile * head_dim * item + 2 * STAGES * tile * 4
    return total


def validate(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array | None,
              v_scales: jax.Array | None, lengths: jax.Array, page_indices: jax.Array,
              sliding_window: int | None) -> tuple[int, int, int]:
    batch, num_q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size = planning.validate_paged_kv(
        num_q_heads, head_dim, k_pages, v_pages, k_scales, v_scales
    )
    if jnp.dtype(q.dtype) not in KV_DTYPES or (k_scales is None and k_pages.dtype != q.dtype):
        raise ValueError(
            f"the Mosaic GPU decode kernel takes bfloat16 or float16 q and k/v pages of q's dtype "
            f"(or int8 / float8_e4m3fn with scales); got q {q.dtype}, pages {k_pages.dtype}"
        )
    row_bytes = head_dim * q.dtype.itemsize
    if row_bytes < 32 or (row_bytes < SWIZZLE_BYTES and row_bytes not in (32, 64)) or row_bytes % 32:
        raise ValueError(
            f"head_dim must be >= 16 and a row of 32, 64 or a multiple of 128 bytes (the SMEM swizzle); "
            f"got {head_dim}"
        )
    if k_scales is not None and head_dim * k_pages.dtype.itemsize < 32:
        raise ValueError(f"int8 / fp8 pages need head_dim >= 32 (a 32-byte swizzled row); got {head_dim}")
    if page_size < 8:
        raise ValueError(f"page_size must be >= 8 (SMEM tiles of 8 rows); got {page_size}")
    if num_q_heads // kv_heads > ROWS:
        raise ValueError(f"at most {ROWS} query heads per KV head; got {num_q_heads // kv_heads}")
    planning.validate_decode_request(batch, lengths, page_indices, sliding_window)
    return kv_heads, num_pages, page_size


def check_tile(tile: int, head_dim: int, dtype: Any, kv_dtype: Any, quantized: bool) -> None:
    """A KV tile of ``tile`` tokens: wgmma- and layout-friendly, and within the SMEM budget."""
    if tile % 64 or tile > 256:
        raise ValueError(
            f"pages_per_compute_block * page_size must be a multiple of 64 and <= 256; got {tile}"
        )
    needed = smem_bytes(tile, head_dim, dtype, kv_dtype, quantized)
    if needed > SMEM_BYTES:
        raise ValueError(
            f"a {tile}-token KV tile at head_dim {head_dim} needs {needed} bytes of SMEM, over "
            f"Hopper's {SMEM_BYTES}; use a smaller pages_per_compute_block"
        )

"""The `pallas-tpu` and `pallas-tpu-interpret` attention backends' glue to the Mosaic TPU kernels.

`pallas_kernels.tpu` writes the step's new K/V with per-token DMAs and attends with one ragged paged attention
call over the whole step (decode rows and prefill chunks alike). The pool layout is the one all backends share,
`[kv_heads, num_pages, page_size, head_dim]`: one page of one head is a contiguous `[page_size, head_dim]` tile,
the kernel's unit of DMA, lane-dense at head_dim 128; tensor parallelism splits the leading heads axis; and
quantized pools keep their `[kv_heads, num_pages, page_size]` scales. `pallas-tpu-interpret` runs the same
kernels in Pallas' TPU interpreter (`pltpu.InterpretParams()`), which works on a CPU.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

from jaxserve.layers.attention import QuantizedPages, quantize_kv
from pallas_kernels.tpu import ragged_paged_attention, write_to_pages


def interpret_params(backend_name: str) -> pltpu.InterpretParams | None:
    """`InterpretParams` for the interpreted backend, None (compile with Mosaic) for `pallas-tpu`."""
    return pltpu.InterpretParams() if backend_name == "pallas-tpu-interpret" else None


def tpu_write_kv(k_pool, v_pool, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *, kv_cache_dtype: str,
                 interpret) -> tuple:
    """One device's write of `k, v: [B, T, kv_heads, head_dim]` into their slots (padding -> scratch page,
    skipped); quantizes each new token's heads first when the pools are `QuantizedPages`."""
    heads, head_dim = k.shape[2:]
    k_new = k.reshape(-1, heads, head_dim).swapaxes(0, 1)  # [kv_heads, tokens, head_dim]
    v_new = v.reshape(-1, heads, head_dim).swapaxes(0, 1)
    slots = slot_mapping.reshape(-1)
    if kv_cache_dtype == "auto":
        return write_to_pages((k_pool, v_pool), (k_new.astype(k_pool.dtype), v_new.astype(v_pool.dtype)), slots,
                              interpret=interpret)
    (k_values, k_scales), (v_values, v_scales) = quantize_kv(k_new, kv_cache_dtype), quantize_kv(v_new, kv_cache_dtype)
    pools = write_to_pages((k_pool.values, k_pool.scales, v_pool.values, v_pool.scales),
                           (k_values, k_scales, v_values, v_scales), slots, interpret=interpret)
    return QuantizedPages(*pools[:2]), QuantizedPages(*pools[2:])


def tpu_paged_attention(q: jax.Array, k_pool, v_pool, meta, *, sm_scale: float, sliding_window: int | None,
                        interpret) -> jax.Array:
    """One device's ragged paged attention of `q: [B, T, q_heads, head_dim]` (see `AttentionBackend.attend`)."""
    scales = {}
    if isinstance(k_pool, QuantizedPages):
        scales = dict(k_scales=k_pool.scales, v_scales=v_pool.scales)
        k_pool, v_pool = k_pool.values, v_pool.values
    # rows without keys (the engine's inactive rows: 1 query token, context 0) give zeros, as padding does
    return ragged_paged_attention(q, k_pool, v_pool, meta.context_lens, meta.query_lens, meta.page_tables,
                                  sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret, **scales)

"""The `pallas-tpu` and `pallas-tpu-interpret` attention backends: our Mosaic TPU kernels (`pallas_kernels.tpu`), the
default on TPU; `pallas-tpu-interpret` runs the same kernels in Pallas' TPU interpreter (`pltpu.InterpretParams()`),
which works on a CPU.

`write_kv` writes a step's new K/V with DMAs of whole row groups (`pallas_kernels/tpu/kv_write.py`); `attend` runs
one ragged paged attention call over the step's rows (the engine's prefill and decode steps are separate calls,
each through this one kernel), with sliding windows, attention-logit soft-caps and sinks, Gemma 3's images seen both
ways (`query_limits`), and Multi-head Latent Attention's latent pool (`attend_latent`). The kernels read the
pool layout all backends share: one page of one head is a contiguous `[page_size, head_dim]` tile, its unit of
DMA, lane-dense at head_dim 128 (the heads are stored padded to it); quantized pools keep their
`[kv_heads, num_pages, page_size]` scales.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from jaxserve.layers.attention_xla import xla_paged_attention
from jaxserve.layers.paged_kv import AttentionMetadata, KVPages, QuantizedPages, quantize_kv, split_quantized
from pallas_kernels.tpu import ragged_paged_attention, write_to_pages


@dataclasses.dataclass(frozen=True)
class MosaicTpuAttention:
    """Our Mosaic TPU kernels; `interpret` runs them in Pallas' TPU interpreter. One device's heads per call."""

    interpret: bool = False
    head_dim_multiple: ClassVar[int] = 128  # pools store heads padded to whole lanes (`PagedAttention.stored_head_dim`)

    @property
    def row_major_pools(self) -> bool:
        """Mosaic reads its operands row-major (`PagedAttention.cache_shardings`); the interpreter, on a CPU, needs
        no pinned layout."""
        return not self.interpret

    @property
    def name(self) -> str:
        return "pallas-tpu-interpret" if self.interpret else "pallas-tpu"

    def min_page_size(self, storage_dtype, quantized: bool) -> int:
        """The smallest page a TPU keeps in the row-major layout the kernels read: a whole sublane tile of the pages'
        dtype (8 rows of 32 bits, 16 of 16, 32 of 8), and 128 with per-token scales, which lie along the lanes.
        Below it XLA lays the pool out transposed, and every step copies it whole into the kernels' layout. The
        interpreter, on a CPU, takes any page."""
        if self.interpret:
            return 1
        return 128 if quantized else 8 * 4 // jnp.dtype(storage_dtype).itemsize

    def interpret_params(self) -> pltpu.InterpretParams | None:
        """`InterpretParams` for the interpreted backend, None (compile with Mosaic) otherwise."""
        return pltpu.InterpretParams() if self.interpret else None

    def write_kv(self, kv: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                 kv_cache_dtype: str) -> KVPages:
        """Writes `k, v: [B, T, kv_heads, head_dim]` into their slots (padding -> scratch page, skipped); quantizes
        each new token's heads first when the pools are `QuantizedPages`."""
        heads, head_dim = k.shape[2:]
        k_new = k.reshape(-1, heads, head_dim).swapaxes(0, 1)  # [kv_heads, tokens, head_dim]
        v_new = v.reshape(-1, heads, head_dim).swapaxes(0, 1)
        slots = slot_mapping.reshape(-1)
        interpret = self.interpret_params()
        if kv_cache_dtype == "auto":
            new = (k_new.astype(kv.k.dtype), v_new.astype(kv.v.dtype))
            return KVPages(*write_to_pages((kv.k, kv.v), new, slots, interpret=interpret))
        (k_values, k_scales), (v_values, v_scales) = quantize_kv(k_new, kv_cache_dtype), quantize_kv(v_new,
                                                                                                     kv_cache_dtype)
        pools = write_to_pages((kv.k.values, kv.k.scales, kv.v.values, kv.v.scales),
                               (k_values, k_scales, v_values, v_scales), slots, interpret=interpret)
        return KVPages(QuantizedPages(*pools[:2]), QuantizedPages(*pools[2:]))

    def attend(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
               sliding_window: int | None, soft_cap: float | None, sinks: jax.Array | None) -> jax.Array:
        k_pool, v_pool, scales = split_quantized(kv)
        # rows without keys (the engine's inactive rows: 1 query token, context 0) give zeros, as padding does
        return ragged_paged_attention(q, k_pool, v_pool, meta.context_lens, meta.query_lens, meta.page_tables,
                                      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                      sinks=sinks, query_limits=meta.query_limits,
                                      interpret=self.interpret_params(), **scales)

    def attend_latent(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
                      value_dim: int, rope_dim: int) -> jax.Array:
        """Multi-head Latent Attention (`PagedAttention.attend_latent`): the ragged kernel over the latent pool, each
        page copied once, its first `value_dim` lanes the values, when they are whole lanes (DeepSeek's 512);
        otherwise in XLA."""
        if value_dim % 128:
            return xla_paged_attention(q, kv, meta, sm_scale=sm_scale, sliding_window=None, value_dim=value_dim)
        return ragged_paged_attention(q, kv.k, None, meta.context_lens, meta.query_lens, meta.page_tables,
                                      sm_scale=sm_scale, value_dim=value_dim, interpret=self.interpret_params())

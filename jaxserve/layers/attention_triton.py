"""The `pallas` and `pallas-interpret` attention backends: our Triton Pallas kernels (`pallas_kernels`), the default
on GPU; `pallas-interpret` runs the same kernels in Pallas' interpreter, for tests on CPU.

New K/V go in by the XLA scatter (`paged_kv.scatter_kv`). A decode step (one query token per row) runs the decode
kernel; any other step runs all its rows through one ragged-kernel call, the rows packed back to back
(`to_ragged`, `from_ragged`), with the queries' limits when a chunk holds a Gemma 3 image (`query_limits`; a
one-token row's query is its row's last key, so the decode kernel needs none). Quantized pools go to the kernels as
stored, with their per-token scales; the soft-cap and attention sinks are the kernels' own. Multi-head Latent
Attention's decode has a kernel of its own (`attend_latent`); its prefill attends in XLA.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.layers.attention_xla import xla_paged_attention
from jaxserve.layers.paged_kv import AttentionMetadata, KVPages, scatter_kv, split_quantized


@dataclasses.dataclass(frozen=True)
class TritonAttention:
    """Our Triton Pallas kernels; `interpret` runs them in Pallas' interpreter. One device's heads per call."""

    interpret: bool = False

    @property
    def name(self) -> str:
        return "pallas-interpret" if self.interpret else "pallas"

    def write_kv(self, kv: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                 kv_cache_dtype: str) -> KVPages:
        return scatter_kv(kv, k, v, slot_mapping, kv_cache_dtype=kv_cache_dtype)

    def attend(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
               sliding_window: int | None, soft_cap: float | None, sinks: jax.Array | None) -> jax.Array:
        k_pool, v_pool, scales = split_quantized(kv)
        batch, num_tokens = q.shape[:2]
        if num_tokens == 1:
            out = pallas_kernels.paged_attention(q[:, 0], k_pool, v_pool, meta.context_lens, meta.page_tables,
                                                 sm_scale=sm_scale, sliding_window=sliding_window,
                                                 soft_cap=soft_cap, sinks=sinks, interpret=self.interpret,
                                                 **scales)
            return out[:, None]
        query_lens = jnp.clip(meta.query_lens, 0, num_tokens).astype(jnp.int32)
        cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
        limits = None if meta.query_limits is None else to_ragged(meta.query_limits, cu_q_lens)
        out = pallas_kernels.ragged_paged_attention(
            to_ragged(q, cu_q_lens), k_pool, v_pool, meta.context_lens, meta.page_tables, cu_q_lens,
            jnp.int32(batch), sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
            query_limits=limits, interpret=self.interpret, **scales)
        return from_ragged(out, cu_q_lens, query_lens, num_tokens)

    def attend_latent(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
                      value_dim: int, rope_dim: int) -> jax.Array:
        """Multi-head Latent Attention (`PagedAttention.attend_latent`): a decode step runs the MLA decode kernel
        where the latent and rope widths are powers of two of 16 or more (DeepSeek-V2/V3's 512 and 64); any other
        step, or width, attends in XLA."""
        if q.shape[1] != 1 or not all(d >= 16 and d & (d - 1) == 0 for d in (value_dim, rope_dim)):
            return xla_paged_attention(q, kv, meta, sm_scale=sm_scale, sliding_window=None, value_dim=value_dim)
        query = q[:, 0]
        out = pallas_kernels.mla_paged_attention(query[..., :value_dim], query[..., value_dim:value_dim + rope_dim],
                                                 kv.k, meta.context_lens, meta.page_tables, sm_scale=sm_scale,
                                                 interpret=self.interpret)
        return out[:, None]


def to_ragged(q: jax.Array, cu_q_lens: jax.Array) -> jax.Array:
    """`[B, T, ...]` -> `[B * T, ...]` with row b's real tokens at `cu_q_lens[b]:cu_q_lens[b + 1]`.

    Entries from `cu_q_lens[B]` on are the ragged kernel's padding: they hold copies of other tokens, and the
    kernel neither reads them for other rows nor writes anything but zeros for them.
    """
    batch, num_tokens = q.shape[:2]
    index = jnp.arange(batch * num_tokens, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu_q_lens[1:], index, side="right"), 0, batch - 1)
    column = jnp.clip(index - cu_q_lens[row], 0, num_tokens - 1)
    return q.reshape(batch * num_tokens, *q.shape[2:])[row * num_tokens + column]


def from_ragged(out: jax.Array, cu_q_lens: jax.Array, query_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Inverse of `to_ragged`: `[B * T, ...]` -> `[B, T, ...]`, zeros at padded query tokens."""
    column = jnp.arange(num_tokens, dtype=jnp.int32)
    index = jnp.minimum(cu_q_lens[:-1, None] + column, out.shape[0] - 1)  # [B, T]
    real = (column < query_lens[:, None]).reshape(*index.shape, *(1,) * (out.ndim - 1))
    return jnp.where(real, out[index], 0)

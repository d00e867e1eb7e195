"""Multi-head Latent Attention (DeepSeek-V2/V3, `ModelConfig.mla`): the Flax layer and its latent page cache.

Per token and layer the cache keeps one row of `cache_dim` values, the compressed latent `c_kv` (`kv_lora_rank`,
after its norm) and the rotated rope key `k_rope` (`qk_rope_head_dim`, shared by every head), in a `KVPages` with
no V pool: `[1, num_pages, page_size, cache_dim]` (zero-padded to the backend's stored head size, a TPU's 128
lanes), where a per-head cache of the same model would keep `2 x heads x head_dim` values.

Attention runs absorbed (DeepSeek's weight absorption): `kv_b_proj` holds each head's key up-projection W_UK
(`kv_lora_rank -> qk_nope_head_dim`) and value up-projection W_UV (`kv_lora_rank -> v_head_dim`). A head's no-rope
score `q_nope . (W_UK c)` is `(W_UK^T q_nope) . c`, so each query moves into latent space once and every head
attends over the cached rows as multi-query attention (query `[W_UK^T q_nope | q_rope]`, key `[c | k_rope]`),
with the latent as the value; the result times W_UV is the head's value. The same sums as transformers' layer in
another order, for prefill and decode alike; nothing is decompressed per head and per cached token.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import LayerSpec, MLAConfig, ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionMetadata, KVPages, PagedAttention
from jaxserve.layers import matmul_blocks
from jaxserve.layers.attention_xla import xla_paged_attention
from jaxserve.layers.norms import RMSNorm
from jaxserve.layers.paged_kv import scatter_pages
from jaxserve.layers.quant_dense import Linear
from jaxserve.layers.rotary import apply_rope, rope_attention_factor, rope_inverse_frequencies


# steps of this many query tokens a row or more decompress the latent rows (`decompressed_attention`), fewer absorb,
# by the platform the step is compiled for: measured on CPU (benchmarks/mla_attention.py); on GPU and TPU, not
# measured yet, where DeepSeek-V3's dims make decompressing the fewer operations (from about 170 tokens)
DECOMPRESS_MIN_TOKENS = {"cpu": 64, "gpu": 256, "tpu": 256}


def deinterleaved(x: jax.Array) -> jax.Array:
    """Rope dims stored as interleaved pairs `(x0, x1), (x2, x3), ...` in first-half / second-half order, the
    order `apply_rope` rotates (transformers' `apply_rotary_pos_emb_interleave` gives the same result)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def decompressed_attention(q_nope: jax.Array, q_rope: jax.Array, kv: KVPages, meta: AttentionMetadata,
                           w_uk: jax.Array, w_uv: jax.Array, mla: MLAConfig, dtype) -> jax.Array:
    """Attention with each block of cached latent rows decompressed into every head's keys `[k_nope | k_rope]`
    (`c W_UK`, the shared rope key) and values (`c W_UV`), as transformers computes it: `[B, T, heads, v_head_dim]`.
    Fewer operations than absorbing when many queries share each decompressed key (a long prefill chunk)."""
    heads = q_nope.shape[2]
    latent, rope = mla.kv_lora_rank, mla.qk_rope_head_dim

    def expand(rows: jax.Array) -> tuple[jax.Array, jax.Array]:  # rows [1, B, block, width]
        c, k_rope = rows[0, ..., :latent], rows[0, ..., latent:latent + rope]
        k_nope = jnp.einsum("bsl,lhn->hbsn", c, w_uk, preferred_element_type=jnp.float32).astype(dtype)
        values = jnp.einsum("bsl,lhv->hbsv", c, w_uv, preferred_element_type=jnp.float32).astype(dtype)
        return jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[None], (heads, *k_rope.shape))], axis=-1), values

    return xla_paged_attention(jnp.concatenate([q_nope, q_rope], axis=-1), kv, meta, sm_scale=mla.softmax_scale,
                               sliding_window=None, value_dim=mla.v_head_dim, expand=expand)


class Kernel(nn.Module):
    """A linear's kernel `[in, out]` read as a matrix (int8 ones dequantized by their per-column scales), for
    `kv_b_proj`, whose halves the layer multiplies with on their own."""

    shape: tuple[int, int]
    dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        if self.has_variable("params", "scale"):
            kernel, scale = self.get_variable("params", "kernel"), self.get_variable("params", "scale")
            return (kernel.astype(jnp.float32) * scale).astype(self.dtype)
        return self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.dtype)


class MLAttention(nn.Module):
    """`(x [B, T, hidden], cache, meta) -> (out [B, T, hidden], cache)` for one layer; the call `llama.Attention`
    has, so the decoder takes either. The cache is written and read by this layer itself (in XLA); `attention`'s
    backend kernels read per-head pools."""

    config: ModelConfig
    tp: TensorParallel
    attention: PagedAttention
    layer: LayerSpec
    dtype: Any

    @nn.compact
    def __call__(self, x, kv: KVPages, meta: AttentionMetadata):
        cfg, mla = self.config, self.config.mla
        batch, num_tokens, _ = x.shape
        heads, nope, rope = cfg.num_q_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            q = Linear(heads * (nope + rope), dtype=self.dtype, out_shards=self.tp.size, name="q_proj")(x)
        else:
            q = Linear(mla.q_lora_rank, use_bias=cfg.qkv_bias, dtype=self.dtype, name="q_a_proj")(x)
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_a_layernorm")(q)
            q = Linear(heads * (nope + rope), dtype=self.dtype, out_shards=self.tp.size, name="q_b_proj")(q)
        q_nope, q_rope = jnp.split(q.reshape(batch, num_tokens, heads, nope + rope), [nope], axis=-1)
        latent = Linear(mla.cache_dim, use_bias=cfg.qkv_bias, dtype=self.dtype, name="kv_a_proj_with_mqa")(x)
        c_kv, k_rope = jnp.split(latent[:, :, None, :], [mla.kv_lora_rank], axis=-1)
        c_kv = RMSNorm(cfg.rms_norm_eps, self.dtype, name="kv_a_layernorm")(c_kv)
        if mla.rope_interleave:
            q_rope, k_rope = deinterleaved(q_rope), deinterleaved(k_rope)
        scaling = self.layer.rope_scaling_dict
        inv_freq, rope_scale = rope_inverse_frequencies(rope, self.layer.rope_theta, scaling), \
            rope_attention_factor(scaling)
        q_rope = apply_rope(q_rope, meta.positions, inv_freq, rope_scale)
        k_rope = apply_rope(k_rope, meta.positions, inv_freq, rope_scale)
        # rows and queries zero-padded to the pool's stored width (a TPU's 128 lanes): zeros change no score. The
        # row is the two parts padded and added (exact): XLA:GPU failed to compile their concatenation ("'scf.if'
        # op along control flow edge") once the decode kernel read the pool, for decode batches over 1 (h200x8)
        width = mla.cache_dim
        row = (jnp.pad(c_kv, [(0, 0)] * 3 + [(0, width - mla.kv_lora_rank)])
               + jnp.pad(k_rope, [(0, 0)] * 3 + [(mla.kv_lora_rank, 0)]))
        kv = KVPages(scatter_pages(kv.k, self.attention.stored(row), meta.slot_mapping), None)

        kv_b = Kernel((mla.kv_lora_rank, heads * (nope + mla.v_head_dim)), self.dtype, name="kv_b_proj")()
        kv_b = kv_b.reshape(mla.kv_lora_rank, heads, nope + mla.v_head_dim)
        w_uk, w_uv = kv_b[..., :nope], kv_b[..., nope:]
        if num_tokens >= DECOMPRESS_MIN_TOKENS[matmul_blocks.lowering_platform()]:
            out = decompressed_attention(q_nope, q_rope, kv, meta, w_uk, w_uv, mla, self.dtype)
        else:
            # tokens padded to a multiple of 16: XLA's GPU compiler (jax 0.10.2, H200) found no tiles for this dot
            # at 12 tokens (a verify step of 4 rows x 3), "Couldn't find output tile sizes"
            rows = batch * num_tokens
            padded = jnp.pad(q_nope.reshape(rows, heads, nope), ((0, -rows % 16), (0, 0), (0, 0)))
            q_latent = jnp.einsum("mhn,lhn->mhl", padded, w_uk, preferred_element_type=jnp.float32)
            q_latent = q_latent[:rows].reshape(batch, num_tokens, heads, mla.kv_lora_rank)
            query = self.attention.stored(jnp.concatenate([q_latent.astype(self.dtype), q_rope], axis=-1))
            out = self.attention.attend_latent(query, kv, meta, sm_scale=mla.softmax_scale,
                                               value_dim=mla.kv_lora_rank, rope_dim=rope)
            out = jnp.einsum("bthl,lhv->bthv", out, w_uv, preferred_element_type=jnp.float32).astype(self.dtype)
        out = out.reshape(batch, num_tokens, heads * mla.v_head_dim)
        return Linear(cfg.hidden_size, use_bias=cfg.o_bias, dtype=self.dtype, in_shards=self.tp.size,
                      name="o_proj")(out), kv

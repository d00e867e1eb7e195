"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) in Flax linen, over a paged KV cache.

Two parameter layouts, kernels stored `[in_features, out_features]` in both:

* the checkpoint layout (what loaders produce, `checkpoint_shapes`): q/k/v and gate/up projections apart,
  as in Hugging Face checkpoints;
* the serving layout (what the model reads, `fuse_params`): q/k/v fused into one `qkv_proj` and gate/up
  into one `gate_up_proj`, each device's columns together (`[q_d | k_d | v_d]` for device d), so a
  tensor-parallel split on output features hands every device whole heads. Fusing halves the number of
  matmuls per layer, which matters at small batch where each launch is bandwidth-bound.
Layers are unrolled (one Python loop), each with its own pair of page pools: measured faster on
CPU than a `lax.scan` over a stacked pool, which copies the carried pool slice every layer.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.quant_dense import Embedding, Linear
from jaxserve.layers.rotary import apply_rope, rope_inverse_frequencies

KVCache = list  # one (k_pool, v_pool) pair per layer, layout chosen by the attention backend


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * normed.astype(self.dtype)


class Attention(nn.Module):
    config: ModelConfig
    tp: TensorParallel
    backend: AttentionBackend
    sliding_window: int | None
    dtype: Any

    @nn.compact
    def __call__(self, x, k_pool, v_pool, meta: AttentionMetadata):
        cfg, tp = self.config, self.tp
        batch, num_tokens, _ = x.shape
        q_width = tp.q_heads_per_device(cfg) * cfg.head_dim
        kv_width = tp.kv_heads_per_device(cfg) * cfg.head_dim
        qkv = Linear(tp.size * (q_width + 2 * kv_width), use_bias=cfg.qkv_bias, dtype=self.dtype,
                     name="qkv_proj")(x)
        qkv = qkv.reshape(batch, num_tokens, tp.size, q_width + 2 * kv_width)  # one row of columns per device
        q, k, v = jnp.split(qkv, [q_width, q_width + kv_width], axis=-1)
        q = q.reshape(batch, num_tokens, cfg.num_q_heads, cfg.head_dim)
        k = k.reshape(batch, num_tokens, tp.pool_heads(cfg), cfg.head_dim)
        v = v.reshape(batch, num_tokens, tp.pool_heads(cfg), cfg.head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k)
        inv_freq = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        q = apply_rope(q, meta.positions, inv_freq)
        k = apply_rope(k, meta.positions, inv_freq)
        k_pool, v_pool = self.backend.write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
        out = self.backend.attend(q, k_pool, v_pool, meta, sm_scale=cfg.head_dim ** -0.5,
                                  sliding_window=self.sliding_window)
        out = out.reshape(batch, num_tokens, cfg.q_size)
        out = Linear(cfg.hidden_size, dtype=self.dtype, in_shards=tp.size, name="o_proj")(out)
        return out, k_pool, v_pool


class MLP(nn.Module):
    config: ModelConfig
    tp: TensorParallel
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg, shards = self.config, self.tp.size
        gate_up = Linear(2 * cfg.intermediate_size, dtype=self.dtype, name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up.reshape(*x.shape[:-1], shards, -1), 2, axis=-1)  # [..., device, columns]
        hidden = (nn.silu(gate) * up).reshape(*x.shape[:-1], cfg.intermediate_size)
        return Linear(cfg.hidden_size, dtype=self.dtype, in_shards=shards, name="down_proj")(hidden)


class DecoderLayer(nn.Module):
    config: ModelConfig
    tp: TensorParallel
    backend: AttentionBackend
    sliding_window: int | None
    dtype: Any

    @nn.compact
    def __call__(self, x, k_pool, v_pool, meta):
        cfg = self.config
        attn_out, k_pool, v_pool = Attention(cfg, self.tp, self.backend, self.sliding_window, self.dtype, name="attn")(
            RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_norm")(x), k_pool, v_pool, meta)
        x = x + attn_out
        x = x + MLP(cfg, self.tp, self.dtype, name="mlp")(RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_norm")(x))
        return x, k_pool, v_pool


class LlamaForCausalLM(nn.Module):
    """`(token_ids [B, T], kv_cache, meta, logits_indices [B] | None) -> (float32 logits, new kv_cache)`.

    With `logits_indices`, only one token per row gets logits ([B, vocab]); without, every token ([B, T, vocab]).
    `with_hidden` also returns the last layer's output `[B, T, hidden]` (before the final norm): `(logits, hidden)`.
    Given `hidden` instead of tokens (no cache, no metadata), only the final norm and the LM head run: the logits of
    every position of an earlier forward (`head_logits`).
    """

    config: ModelConfig
    backend: AttentionBackend
    dtype: Any = jnp.float32
    tp: TensorParallel = TensorParallel()

    @nn.compact
    def __call__(self, token_ids, kv_cache: KVCache, meta: AttentionMetadata, logits_indices=None,
                 with_hidden: bool = False, hidden=None):
        cfg = self.config
        vocab_shards = self.tp.size if cfg.vocab_size % self.tp.size == 0 else 1  # as the sharding table splits it
        embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, vocab_shards=vocab_shards, name="embed")
        new_cache = []
        if hidden is None:
            x = embed(token_ids)
            for layer, (k_pool, v_pool) in enumerate(kv_cache):
                x, k_pool, v_pool = DecoderLayer(cfg, self.tp, self.backend, cfg.layer_sliding_windows[layer],
                                                 self.dtype, name=f"layers_{layer}")(x, k_pool, v_pool, meta)
                new_cache.append((k_pool, v_pool))
            hidden = x
        else:
            x = hidden
        if logits_indices is not None:
            x = jnp.take_along_axis(x, logits_indices[:, None, None], axis=1)[:, 0]
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="final_norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = Linear(cfg.vocab_size, dtype=self.dtype, name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        return ((logits, hidden) if with_hidden else logits), new_cache


def forward(params, config: ModelConfig, backend: AttentionBackend, token_ids, kv_cache: KVCache,
            meta: AttentionMetadata, logits_indices=None, dtype=jnp.float32, tp: TensorParallel = TensorParallel(),
            with_hidden: bool = False):
    """The pure forward function the engine jits: params (serving layout) and cache in, logits and new cache out
    (`with_hidden`: the logits are the pair (logits, the last layer's output))."""
    model = LlamaForCausalLM(config, backend, dtype, tp)
    return model.apply({"params": params}, token_ids, kv_cache, meta, logits_indices, with_hidden)


def head_logits(params, config: ModelConfig, hidden, dtype=jnp.float32, tp: TensorParallel = TensorParallel()):
    """The final norm and LM head over a forward's last-layer output `hidden [B, T, hidden]`: float32 logits of every
    position `[B, T, vocab]`, as the forward computes them for its own logits."""
    model = LlamaForCausalLM(config, AttentionBackend("xla"), dtype, tp)
    logits, _ = model.apply({"params": params}, None, None, None, hidden=hidden)
    return logits


def param_shapes(config: ModelConfig, dtype=jnp.float32, tp: TensorParallel = TensorParallel()) -> dict:
    """The serving-layout parameter tree (as ShapeDtypeStructs) the model reads for `config` split `tp` ways."""
    backend = AttentionBackend("xla")
    pool_shape = backend.pool_shape(2, 8, tp.pool_heads(config), config.head_dim)
    kv_cache = [(jax.ShapeDtypeStruct(pool_shape, dtype),) * 2 for _ in range(config.num_layers)]
    meta = AttentionMetadata(
        positions=jax.ShapeDtypeStruct((1, 1), jnp.int32), slot_mapping=jax.ShapeDtypeStruct((1, 1), jnp.int32),
        page_tables=jax.ShapeDtypeStruct((1, 1), jnp.int32), context_lens=jax.ShapeDtypeStruct((1,), jnp.int32),
        query_lens=jax.ShapeDtypeStruct((1,), jnp.int32))
    model = LlamaForCausalLM(config, backend, dtype, tp)
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1), jnp.int32), kv_cache, meta)
    return variables["params"]


def checkpoint_shapes(config: ModelConfig, dtype=jnp.float32) -> dict:
    """The checkpoint-layout parameter tree (as ShapeDtypeStructs) that loaders produce for `config`."""
    cfg = config

    def dense(fan_in: int, fan_out: int, bias: bool = False) -> dict:
        leaf = {"kernel": jax.ShapeDtypeStruct((fan_in, fan_out), dtype)}
        return leaf | ({"bias": jax.ShapeDtypeStruct((fan_out,), dtype)} if bias else {})

    def norm(width: int) -> dict:
        return {"scale": jax.ShapeDtypeStruct((width,), dtype)}

    def layer() -> dict:
        attn = {"q_proj": dense(cfg.hidden_size, cfg.q_size, cfg.qkv_bias),
                "k_proj": dense(cfg.hidden_size, cfg.kv_size, cfg.qkv_bias),
                "v_proj": dense(cfg.hidden_size, cfg.kv_size, cfg.qkv_bias),
                "o_proj": dense(cfg.q_size, cfg.hidden_size)}
        if cfg.qk_norm:
            attn |= {"q_norm": norm(cfg.head_dim), "k_norm": norm(cfg.head_dim)}
        mlp = {"gate_proj": dense(cfg.hidden_size, cfg.intermediate_size),
               "up_proj": dense(cfg.hidden_size, cfg.intermediate_size),
               "down_proj": dense(cfg.intermediate_size, cfg.hidden_size)}
        return {"input_norm": norm(cfg.hidden_size), "attn": attn, "post_attention_norm": norm(cfg.hidden_size),
                "mlp": mlp}

    params = {"embed": {"embedding": jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), dtype)}}
    params |= {f"layers_{i}": layer() for i in range(cfg.num_layers)}
    params["final_norm"] = norm(cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dense(cfg.hidden_size, cfg.vocab_size)
    return params


def fuse_layer(layer: dict, config: ModelConfig, tp: TensorParallel) -> dict:
    """One decoder layer's checkpoint-layout params -> serving layout: q/k/v into `qkv_proj` and gate/up into
    `gate_up_proj`, each device's columns together (all their leaves: an AWQ layer's zeros and scales too). Jit it with the serving shardings as `out_shardings` and every
    device builds its own columns from its own shards (k/v replicated when the KV heads are)."""
    cfg, n = config, tp.size
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    sources = jnp.asarray(tp.pool_head_sources(cfg))

    def per_device(array, heads: int, kv: bool):  # [..., heads * head_dim] -> [..., n, per-device columns]
        lead = array.shape[:-1]
        array = array.reshape(*lead, heads, cfg.head_dim)
        if kv:
            array = jnp.take(array, sources, axis=-2)  # the pool's heads: each KV head where its queries are
        return array.reshape(*lead, n, -1)

    def fused(leaf: str) -> jax.Array:
        q, k, v = (attn[f"{name}_proj"][leaf] for name in "qkv")
        parts = [per_device(q, cfg.num_q_heads, False), per_device(k, cfg.num_kv_heads, True),
                 per_device(v, cfg.num_kv_heads, True)]
        return jnp.concatenate(parts, axis=-1).reshape(*q.shape[:-1], -1)

    # every leaf along the output features: kernel, bias, and an AWQ layer's per-group zeros and scales
    qkv = {leaf: fused(leaf) for leaf in attn["q_proj"]}
    for name in "qkv":
        del attn[f"{name}_proj"]
    gate, up = (mlp.pop(name) for name in ("gate_proj", "up_proj"))
    gate_up = {leaf: jnp.concatenate([gate[leaf].reshape(*gate[leaf].shape[:-1], n, -1),
                                      up[leaf].reshape(*up[leaf].shape[:-1], n, -1)], axis=-1)
               .reshape(*gate[leaf].shape[:-1], -1) for leaf in gate}
    return {**layer, "attn": {"qkv_proj": qkv, **attn}, "mlp": {"gate_up_proj": gate_up, **mlp}}


def fuse_params(params: dict, config: ModelConfig, tp: TensorParallel = TensorParallel()) -> dict:
    """The whole checkpoint-layout tree -> serving layout (see `fuse_layer`), for tests and one-device use."""
    return {name: fuse_layer(group, config, tp) if name.startswith("layers_") else group
            for name, group in params.items()}

"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): its config parsing, Flax decoder over a paged KV cache,
LM head, and `SPEC` for the registry. Its checkpoint names, fusing and sharding rules are in `llama_weights`. The
mixture-of-experts families on this decoder (`qwen_moe`, `mixtral`) swap the MLP of their sparse layers for
`layers/moe.py`'s experts.

The decoder reads the serving layout: q/k/v fused into one `qkv_proj` and gate/up into one `gate_up_proj`, each
device's columns together (`[q_d | k_d | v_d]` for device d), so a tensor-parallel split on output features hands
every device whole heads. Layers are unrolled (one Python loop), each with its own page pools (`KVPages`): measured
faster on CPU than a `lax.scan` over a stacked pool, which copies the carried pool slice every layer.
"""

from __future__ import annotations

import itertools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import LayerSpec, ModelConfig, MoEConfig, token_ids
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionMetadata, KVPages, PagedAttention
from jaxserve.layers.gated_deltanet import GatedDeltaNet
from jaxserve.layers.mla import MLAttention
from jaxserve.layers.mlp import MLP
from jaxserve.layers.moe import MoE
from jaxserve.layers.norms import RMSNorm, rms_normalize
from jaxserve.layers.quant_dense import Embedding, Linear
from jaxserve.layers.rotary import (apply_rope, frequency_positions, rope_attention_factor, rope_inverse_frequencies,
                                    rope_length_threshold, token_inverse_frequencies)
from jaxserve.models import hf_config as hf
from jaxserve.models import llama_weights as weights
from jaxserve.models.spec import ModelSpec

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")


def parse_config(hf_config: Any) -> ModelConfig:
    """The `ModelConfig` of a transformers config of this family (v4 or v5 spelling of rope fields)."""
    model_type = hf_config.model_type
    attention_bias = bool(getattr(hf_config, "attention_bias", False))  # q, k, v and o (Qwen2: q, k, v always)
    return decoder_config(hf_config, qkv_bias=model_type == "qwen2" or attention_bias,
                          o_bias=model_type != "qwen2" and attention_bias, qk_norm=model_type == "qwen3")


def decoder_config(hf_config: Any, *, qkv_bias: bool, qk_norm: bool, o_bias: bool = False,
                   moe: MoEConfig | None = None, sparse_layers: tuple[bool, ...] = (),
                   activation: str | None = None) -> ModelConfig:
    """The `ModelConfig` of a Llama-shaped decoder (this module's, the mixture-of-experts families that swap its
    MLP for experts in the `sparse_layers`, Gemma's, gpt-oss's); ValueError naming a field this decoder cannot
    compute. `activation`: the family's (`config.ACTIVATIONS`), else `hidden_act`, which must be silu."""
    if activation is None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported for model_type "
                             f"{hf_config.model_type!r} (jaxserve computes its SwiGLU with silu)")
        activation = "silu"
    rope_theta, rope_scaling = hf.rope_parameters(hf_config, partial=True)
    rotary_dim = int(hf.head_dim(hf_config) * hf.rotary_fraction(hf_config))
    num_layers = hf_config.num_hidden_layers
    sparse_layers = sparse_layers or (False,) * num_layers
    layers = tuple(LayerSpec(sliding_window=window, rope_theta=rope_theta, rope_scaling=rope_scaling,
                             feed_forward="moe" if sparse else "dense",
                             rotary_dim=rotary_dim if rotary_dim < hf.head_dim(hf_config) else None)
                   for window, sparse in zip(hf.layer_windows(hf_config, num_layers), sparse_layers))
    return ModelConfig(
        model_type=hf_config.model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=num_layers,
        num_q_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=hf.head_dim(hf_config),
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        layers=layers,
        moe=moe if any(sparse_layers) else None,
        activation=activation,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=token_ids(getattr(hf_config, "eos_token_id", None)),
    )


def model_norm(config: ModelConfig, dtype, name: str | None = None) -> RMSNorm:
    """An RMS norm as the model computes its norms (Gemma's offset, Gemma 4's float32 scale)."""
    return RMSNorm(config.rms_norm_eps, dtype, config.norm_offset, config.norm_scale_float32, name=name)


class Attention(nn.Module):
    """One layer's attention, in its own shape (`ModelConfig.for_layer`). `qkv_proj` holds each device's `[q | k |
    v | gate]` columns: no v with `values_from_keys` (the values are the key projection's output, normed apart),
    q alone for a layer that reads another layer's KV (`kv_source`: its cache is that layer's, written already in
    this step, and is returned unchanged)."""

    config: ModelConfig
    tp: TensorParallel
    attention: PagedAttention
    layer: LayerSpec
    dtype: Any

    @nn.compact
    def __call__(self, x, kv: KVPages, meta: AttentionMetadata):
        cfg, tp, layer = self.config.for_layer(self.layer), self.tp, self.layer
        batch, num_tokens, _ = x.shape
        shared = layer.kv_source is not None
        q_width = tp.q_heads_per_device(cfg) * cfg.head_dim
        kv_width = 0 if shared else tp.kv_heads_per_device(cfg) * cfg.head_dim
        v_width = 0 if layer.values_from_keys else kv_width
        widths = [q_width, kv_width, v_width, q_width if cfg.attention_output_gate else 0]
        qkv = Linear(tp.size * sum(widths), use_bias=cfg.qkv_bias, dtype=self.dtype, out_shards=tp.size,
                     name="qkv_proj")(x)
        qkv = qkv.reshape(batch, num_tokens, tp.size, sum(widths))  # one row of columns per device
        q, k, v, gate = jnp.split(qkv, list(itertools.accumulate(widths[:-1])), axis=-1)
        q = q.reshape(batch, num_tokens, cfg.num_q_heads, cfg.head_dim)
        if not shared:
            k = k.reshape(batch, num_tokens, tp.pool_heads(cfg), cfg.head_dim)
            v = k if layer.values_from_keys else v.reshape(k.shape)
            if cfg.value_norm:
                v = rms_normalize(v, cfg.rms_norm_eps).astype(v.dtype)
        if cfg.qk_norm:
            q_norm, k_norm = (model_norm(cfg, self.dtype, name) for name in ("q_norm", "k_norm"))
            if cfg.qk_norm_all_heads:  # over the heads' dims together: under a split, XLA sums over the devices
                q = q_norm(q.reshape(batch, num_tokens, -1)).reshape(q.shape)
                k = k_norm(k.reshape(batch, num_tokens, -1)).reshape(k.shape)
            else:
                q = q_norm(q)
                k = k if shared else k_norm(k)
        scaling, rotary_dim = layer.rope_scaling_dict, layer.rotary_dim or cfg.head_dim
        if rope_length_threshold(scaling) is None:
            inv_freq = rope_inverse_frequencies(rotary_dim, layer.rope_theta, scaling)
        else:
            inv_freq = token_inverse_frequencies(rotary_dim, layer.rope_theta, scaling, meta.token_rope_lens())
        rope_scale = rope_attention_factor(scaling)
        positions = meta.positions
        if cfg.mrope_section is not None:
            positions = frequency_positions(meta.mrope_positions, cfg.mrope_section, cfg.mrope_interleaved)
        q = apply_rope(q, positions, inv_freq, rope_scale)
        if not shared:
            k = apply_rope(k, positions, inv_freq, rope_scale)
            kv = self.attention.write_kv(kv, k, v, meta.slot_mapping)
        sm_scale = cfg.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        sinks = self.param("sinks", nn.initializers.zeros_init(), (cfg.num_q_heads,), self.dtype) \
            if cfg.attention_sinks else None
        out = self.attention.attend(q, kv, meta, sm_scale=sm_scale,
                                    sliding_window=layer.sliding_window, soft_cap=cfg.attn_logit_softcap,
                                    sinks=sinks)
        out = out.reshape(batch, num_tokens, cfg.q_size)
        if cfg.attention_output_gate:
            gate = jax.nn.sigmoid(gate.reshape(out.shape).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate).astype(out.dtype)
        out = Linear(cfg.hidden_size, use_bias=cfg.o_bias, dtype=self.dtype, in_shards=tp.size, name="o_proj")(out)
        return out, kv


class DecoderLayer(nn.Module):
    config: ModelConfig
    tp: TensorParallel
    attention: PagedAttention
    layer: LayerSpec
    dtype: Any

    @nn.compact
    def __call__(self, x, kv: KVPages, meta: AttentionMetadata):
        cfg = self.config

        def norm(name: str):
            return model_norm(cfg, self.dtype, name)

        if self.layer.mixer == "gated_deltanet":
            attn_out, kv = GatedDeltaNet(cfg.linear_attention, cfg.hidden_size, cfg.rms_norm_eps, self.tp.size,
                                         self.dtype, name="linear_attn")(norm("input_norm")(x), kv, meta)
        else:
            attention = Attention if cfg.mla is None else MLAttention
            attn_out, kv = attention(cfg, self.tp, self.attention, self.layer, self.dtype, name="attn")(
                norm("input_norm")(x), kv, meta)
        if self.layer.feed_forward == "moe":
            feed_forward = MoE(cfg, self.tp, self.dtype, name="mlp")
        else:
            feed_forward = MLP(cfg.hidden_size, cfg.intermediate_size, self.tp, self.dtype, cfg.activation, name="mlp")
        if cfg.sandwich_norms:  # Gemma: each sublayer's output normed too, "post_attention_norm" on the attention's
            x = x + norm("post_attention_norm")(attn_out)
            return x + norm("post_feedforward_norm")(feed_forward(norm("pre_feedforward_norm")(x))), kv
        x = x + attn_out
        return x + feed_forward(norm("post_attention_norm")(x)), kv


def vocab_shards(config: ModelConfig, tp: TensorParallel) -> int:
    """The devices the vocabulary is split over, as the sharding rules split it."""
    return tp.size if config.vocab_size % tp.size == 0 else 1


class LlamaModel(nn.Module):
    """`(token_ids [B, T], kv_cache, meta) -> (last layer's output [B, T, hidden], new kv_cache)`; the final norm
    and LM head are `compute_logits`. Each layer's input is sown as `intermediates/layer_inputs` (what an EAGLE-3
    head reads: `models.forward`'s `aux_layers`). `mm_embeds [B, T, hidden]` with `mm_mask [B, T]`: the tokens
    where the mask is set take those embeddings instead of their ids' (an image's, from its encoder); with
    `deepstack_layers` n the embeddings are `[B, T, (1 + n) * hidden]` and feature i is added after layer i."""

    config: ModelConfig
    attention: PagedAttention
    dtype: Any = jnp.float32
    tp: TensorParallel = TensorParallel()

    @nn.compact
    def __call__(self, token_ids, kv_cache: list, meta: AttentionMetadata, mm_embeds=None, mm_mask=None):
        cfg = self.config
        x = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, vocab_shards=vocab_shards(cfg, self.tp),
                      name="embed")(token_ids)
        if cfg.embedding_scale is not None:  # rounded to the serving dtype first, as transformers rounds it
            x = x * jnp.asarray(cfg.embedding_scale, self.dtype)
        hidden = cfg.hidden_size
        if mm_embeds is not None:  # after the scale: transformers scales the text embeddings only
            x = jnp.where(mm_mask[..., None], mm_embeds[..., :hidden].astype(x.dtype), x)
        new_cache = []
        for index, kv in enumerate(kv_cache):
            self.sow("intermediates", "layer_inputs", x)
            x, kv = DecoderLayer(cfg, self.tp, self.attention, cfg.layers[index], self.dtype,
                                 name=f"layers_{index}")(x, kv, meta.for_layer(index))
            if mm_embeds is not None and index < cfg.deepstack_layers:  # Qwen3-VL's deepstack features
                features = mm_embeds[..., (index + 1) * hidden:(index + 2) * hidden].astype(x.dtype)
                x = x + jnp.where(mm_mask[..., None], features, jnp.zeros_like(features))
            new_cache.append(kv)
        return x, new_cache


def compute_logits(params: dict, config: ModelConfig, x: jax.Array, dtype=jnp.float32,
                   tp: TensorParallel = TensorParallel(), norm: bool = True) -> jax.Array:
    """Float32 logits `[..., vocab]` of last-layer outputs `x [..., hidden]`: the final norm (unless `norm` is
    False: x is normed already), then the LM head (the embedding table when tied), capped when the model caps
    them."""
    if norm:
        x = model_norm(config, dtype).apply({"params": params["final_norm"]}, x)
    if config.tie_word_embeddings:
        embed = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, vocab_shards=vocab_shards(config, tp))
        logits = embed.apply({"params": params["embed"]}, x, method=Embedding.attend)
    else:
        logits = Linear(config.vocab_size, dtype=dtype).apply({"params": params["lm_head"]}, x)
    logits = logits.astype(jnp.float32)
    if config.final_logit_softcap is not None:
        logits = config.final_logit_softcap * jnp.tanh(logits / config.final_logit_softcap)
    return logits


SPEC = ModelSpec(
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    module=LlamaModel,
    compute_logits=compute_logits,
    checkpoint_shapes=weights.checkpoint_shapes,
    checkpoint_source=weights.checkpoint_source,
    fuse_layer=weights.fuse_layer,
    sharding_rules=weights.SHARDING_RULES,
    quantizable_linears=weights.LINEARS,
    dummy_fan_in=weights.dummy_fan_in,
    lora_targets=tuple((name, (name,)) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj")),
)

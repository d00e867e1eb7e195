"""Gemma 4 (text; `gemma4_text`, and the image + text `gemma4` checkpoints served text-only): its config parsing and
Flax decoder over the paged KV cache. Its checkpoint names, shapes and sharding rules are in `gemma4_weights`.

On Gemma 3's decoder (sandwich norms, GeGLU, the embedding times sqrt(hidden), sliding and global layers by
`layer_types`, q/k norms) Gemma 4 changes:

* norms scale by `w` in float32 (no `1 + w`); values get a scale-free RMS norm; attention scores are not scaled;
* global layers have their own head size (`global_head_dim`) and KV heads, and a proportional rope over a quarter
  of each head (`LayerSpec.head_dim`, `num_kv_heads`: two shapes of pool, `kv_plan`'s uniform-type group 0);
  with `attention_k_eq_v` their values are the key projection's output (`LayerSpec.values_from_keys`);
* the last `num_kv_shared_layers` layers compute queries only and read the KV of the last earlier layer of their
  type (`LayerSpec.kv_source`: no pages of their own), with a doubled MLP under `use_double_wide_mlp`;
* per-layer inputs (`hidden_size_per_layer_input`): a second embedding table and a projection of the embeddings
  give each layer a small input, gated into the residual stream after its feed-forward;
* a mixture of experts beside the dense MLP (`enable_moe_block`): its own router (a scale-free norm, a learned
  scale, softmax, top-k renormalized, a learned scale per expert) and GeGLU experts, normed and added to the MLP's;
* every layer's output times a learned scalar (`layer_scalar`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import LayerSpec, ModelConfig, MoEConfig, token_ids
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionMetadata, KVPages, PagedAttention
from jaxserve.layers.mlp import MLP, gate_activation
from jaxserve.layers.moe import ExpertKernels, run_experts
from jaxserve.layers.norms import rms_normalize
from jaxserve.layers.quant_dense import Embedding, Linear
from jaxserve.models import gemma
from jaxserve.models import gemma4_weights as weights
from jaxserve.models import hf_config as hf
from jaxserve.models import llama
from jaxserve.models.llama import Attention, model_norm, vocab_shards
from jaxserve.models.spec import text_decoder_parser

MODEL_TYPES = ("gemma4_text",)
LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_shape(hf_config: Any, index: int) -> tuple[int, int]:
    """Layer `index`'s `(head_dim, num_key_value_heads)`: transformers' per-layer config (Gemma 4's global layers
    have their own), else the model's."""
    per_layer = getattr(hf_config, "per_layer_config", None)
    if per_layer is not None:
        own = per_layer[index]
        return own.head_dim, own.num_key_value_heads
    return hf_config.head_dim, hf_config.num_key_value_heads


def kv_sources(hf_config: Any) -> list[int | None]:
    """Each layer's KV source: the last layer before the shared ones of its own type, for the last
    `num_kv_shared_layers` layers (transformers' `kv_sharing_modes`); None for the others."""
    layers, shared = hf_config.num_hidden_layers, hf_config.num_kv_shared_layers or 0
    first = layers - shared
    sources: list[int | None] = [None] * layers
    for index in range(first, layers):
        kind = hf_config.layer_types[index]
        earlier = [j for j in range(first) if hf_config.layer_types[j] == kind]
        if not earlier:
            raise ValueError(f"num_kv_shared_layers={shared}: layer {index} ({kind}) has no earlier layer of its type "
                             "to read KV from")
        sources[index] = earlier[-1]
    return sources


def parse_config(hf_config: Any) -> ModelConfig:
    """The `ModelConfig` of a Gemma 4 text config; ValueError naming what this code cannot compute."""
    if getattr(hf_config, "use_bidirectional_attention", None) == "all":
        raise ValueError("use_bidirectional_attention='all' is not supported (jaxserve serves causal decoders)")
    unknown = sorted(set(hf_config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported for gemma4 (jaxserve computes {LAYER_TYPES})")
    activation = gemma.activation(hf_config)
    num_layers = hf_config.num_hidden_layers
    ropes = {kind: hf.parse_rope(params, None, hf_config.max_position_embeddings)
             for kind, params in hf_config.rope_parameters.items()}
    windows = hf.layer_windows(hf_config, num_layers)
    sources = kv_sources(hf_config)
    shapes = [layer_shape(hf_config, index) for index in range(num_layers)]
    moe = None
    if hf_config.enable_moe_block:
        moe = MoEConfig(num_experts=hf_config.num_experts, top_k=hf_config.top_k_experts,
                        intermediate_size=hf_config.moe_intermediate_size, normalize_top_k=True, activation=activation)
    double = 2 if hf_config.use_double_wide_mlp else 1
    layers = tuple(LayerSpec(
        sliding_window=windows[index], rope_theta=ropes[kind][0], rope_scaling=ropes[kind][1],
        feed_forward="dense_and_moe" if moe is not None else "dense", head_dim=shapes[index][0],
        num_kv_heads=shapes[index][1], kv_source=sources[index],
        intermediate_size=hf_config.intermediate_size * (double if sources[index] is not None else 1),
        values_from_keys=bool(hf_config.attention_k_eq_v) and kind == "full_attention" and sources[index] is None)
        for index, kind in enumerate(hf_config.layer_types))
    per_layer = hf_config.hidden_size_per_layer_input or 0
    return ModelConfig(
        model_type=hf_config.model_type, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_layers=num_layers,
        num_q_heads=hf_config.num_attention_heads, num_kv_heads=shapes[0][1], head_dim=shapes[0][0],
        rms_norm_eps=hf_config.rms_norm_eps, rope_theta=layers[0].rope_theta, rope_scaling=layers[0].rope_scaling,
        qkv_bias=bool(hf_config.attention_bias), o_bias=bool(hf_config.attention_bias), qk_norm=True,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)), layers=layers, moe=moe,
        attention_scale=1.0, activation=activation, embedding_scale=hf_config.hidden_size ** 0.5,
        sandwich_norms=True, final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        norm_scale_float32=True, value_norm=True, per_layer_input_size=per_layer,
        per_layer_vocab_size=hf_config.vocab_size_per_layer_input if per_layer else 0,
        max_position_embeddings=hf_config.max_position_embeddings,
        bos_token_id=getattr(hf_config, "bos_token_id", None), eos_token_ids=token_ids(hf_config.eos_token_id))


class Scale(nn.Module):
    """A learned vector (a `scale` leaf: ones in dummy weights, as transformers starts it)."""

    size: int
    dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("scale", nn.initializers.ones, (self.size,), self.dtype)


class Experts(nn.Module):
    """Gemma 4's experts `[T, H] -> [T, H]` (float32): the router reads the layer's input (a scale-free RMS norm,
    times a learned scale and hidden_size ** -0.5, a linear, softmax in float32, the top k renormalized, each times
    its expert's learned scale); the experts read `x`, the input after its own norm."""

    config: ModelConfig
    tp: TensorParallel
    dtype: Any

    @nn.compact
    def __call__(self, router_input: jax.Array, x: jax.Array) -> jax.Array:
        cfg, moe = self.config, self.config.moe
        normed = rms_normalize(router_input, cfg.rms_norm_eps).astype(self.dtype)
        normed = normed * Scale(cfg.hidden_size, self.dtype, name="router_input")() * cfg.hidden_size ** -0.5
        logits = Linear(moe.num_experts, dtype=self.dtype, name="router")(normed.astype(self.dtype))
        probabilities = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probabilities, moe.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * Scale(moe.num_experts, self.dtype, name="expert_scale")()[experts].astype(jnp.float32)
        kernels = ExpertKernels(cfg, self.dtype, name="experts")()
        return run_experts(x, weights, experts.astype(jnp.int32), kernels, cfg, self.tp, self.dtype)


class DecoderLayer(nn.Module):
    config: ModelConfig
    tp: TensorParallel
    attention: PagedAttention
    layer: LayerSpec
    dtype: Any

    @nn.compact
    def __call__(self, x, kv: KVPages, meta: AttentionMetadata, per_layer_input: jax.Array | None):
        cfg, own = self.config, self.config.for_layer(self.layer)

        def norm(name: str):
            return model_norm(cfg, self.dtype, name)

        attn_out, kv = Attention(cfg, self.tp, self.attention, self.layer, self.dtype, name="attn")(
            norm("input_norm")(x), kv, meta)
        x = x + norm("post_attention_norm")(attn_out)
        residual = x
        y = MLP(cfg.hidden_size, own.intermediate_size, self.tp, self.dtype, cfg.activation, name="mlp")(
            norm("pre_feedforward_norm")(x))
        if self.layer.has_experts:
            tokens = residual.reshape(-1, cfg.hidden_size)
            experts = Experts(cfg, self.tp, self.dtype, name="moe")(tokens, norm("pre_feedforward_norm_2")(tokens))
            y = norm("post_feedforward_norm_1")(y) + norm("post_feedforward_norm_2")(
                experts.astype(self.dtype).reshape(x.shape))
        x = residual + norm("post_feedforward_norm")(y)
        if per_layer_input is not None:
            gate = Linear(cfg.per_layer_input_size, dtype=self.dtype, name="per_layer_input_gate")(x)
            gated = gate_activation(cfg.activation)(gate) * per_layer_input
            x = x + norm("post_per_layer_input_norm")(
                Linear(cfg.hidden_size, dtype=self.dtype, name="per_layer_projection")(gated))
        return x * Scale(1, self.dtype, name="layer_scalar")(), kv


class PerLayerInputs(nn.Module):
    """Each layer's input `[B, T, layers, P]` from the token ids and their (scaled) embeddings: the ids' rows of a
    second table (times sqrt(P)) and a projection of the embeddings (times hidden ** -0.5, normed per layer),
    added and scaled by 2 ** -0.5."""

    config: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, token_ids: jax.Array, embeddings: jax.Array) -> jax.Array:
        cfg = self.config
        width, shape = cfg.num_layers * cfg.per_layer_input_size, (*token_ids.shape, cfg.num_layers, -1)
        table = Embedding(cfg.per_layer_vocab_size, width, dtype=self.dtype, name="per_layer_embed")(token_ids)
        table = table * jnp.asarray(cfg.per_layer_input_size ** 0.5, self.dtype)
        projected = Linear(width, dtype=self.dtype, name="per_layer_model_projection")(embeddings)
        projected = model_norm(cfg, self.dtype, "per_layer_projection_norm")(
            (projected * cfg.hidden_size ** -0.5).reshape(shape))
        return ((projected + table.reshape(shape)) * 2 ** -0.5).astype(self.dtype)


class Gemma4Model(nn.Module):
    """`(token_ids [B, T], kv_cache, meta) -> (last layer's output [B, T, hidden], new kv_cache)`: a layer with a
    `kv_source` reads that layer's cache (written earlier in this step) and keeps none (its entry stays None)."""

    config: ModelConfig
    attention: PagedAttention
    dtype: Any = jnp.float32
    tp: TensorParallel = TensorParallel()

    @nn.compact
    def __call__(self, token_ids, kv_cache: list, meta: AttentionMetadata):
        cfg = self.config
        x = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, vocab_shards=vocab_shards(cfg, self.tp),
                      name="embed")(token_ids)
        x = x * jnp.asarray(cfg.embedding_scale, self.dtype)
        per_layer = PerLayerInputs(cfg, self.dtype, name="per_layer_inputs")(token_ids, x) \
            if cfg.per_layer_input_size else None
        cache = list(kv_cache)
        for index, layer in enumerate(cfg.layers):
            source = index if layer.kv_source is None else layer.kv_source
            x, kv = DecoderLayer(cfg, self.tp, self.attention, layer, self.dtype, name=f"layers_{index}")(
                x, cache[source], meta.for_layer(index), None if per_layer is None else per_layer[:, :, index])
            if layer.kv_source is None:
                cache[index] = kv
        return x, cache


# the Llama family's logits, fusing, quantizable linears and dummy fan-ins; no LoRA adapters yet
SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config, module=Gemma4Model,
                           checkpoint_shapes=weights.checkpoint_shapes, checkpoint_source=weights.checkpoint_source,
                           sharding_rules=weights.SHARDING_RULES, lora_targets=())
# the image + text checkpoints (Gemma4ForConditionalGeneration): the text decoder only; the vision and audio
# towers are not read, and prompts are text
MULTIMODAL_SPEC = dataclasses.replace(SPEC, model_types=("gemma4",),
                                      parse_config=text_decoder_parser(parse_config),
                                      checkpoint_source=weights.multimodal_checkpoint_source)

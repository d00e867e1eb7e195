"""Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`; the image + text `qwen3_5` and
`qwen3_5_moe` checkpoints, whose vision tower is Qwen3-VL's, `multimodal/vision.py`): hybrid decoders whose
`layer_types` interleave Gated DeltaNet layers (`layers/gated_deltanet.py`, a per-sequence state, no KV pages) with
full-attention layers, 3:1 by default.

On the Llama decoder: RMS norms of `(1 + w)`; the attention's q/k norms, a per-head output gate from a doubled
`q_proj` (each head's query, then its gate), a quarter of each head rotated (by M-RoPE in the image + text
checkpoints, which for text equals ordinary positions); Qwen3-Next's experts and Qwen3.5-MoE's as Qwen2-MoE's (a
shared expert behind a sigmoid gate).

Checkpoint layout: transformers' names. A Gated DeltaNet layer's in-projections are Qwen3-Next's `in_proj_qkvz`
and `in_proj_ba` (laid out per key head: its q, k, then its value heads' v and z; its value heads' b, then a) or
Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (each all heads in order); `conv1d` `[channels, 1,
K]`. Serving layout: one `in_proj` with each device's q, k, v, z, b, a columns together, `conv1d` `[channels, K]`
in the same per-device channel order (`fuse_linear_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from numpy.typing import DTypeLike

from jaxserve.config import LinearAttentionConfig, ModelConfig, MoEConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.models import llama, qwen_moe
from jaxserve.models import llama_weights as weights
from jaxserve.models.spec import TensorSource, text_decoder_parser

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")
MULTIMODAL_PREFIX = "model.language_model."  # where an image + text checkpoint keeps its text decoder's layers
MIXERS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
SEPARATE_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5's
FUSED_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next's


def experts(hf_config: Any) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """The mixture of experts and its layers: Qwen3.5-MoE's in every layer, top-k renormalized; Qwen3-Next's as
    Qwen2-MoE's (`mlp_only_layers`, every `decoder_sparse_step`-th layer, `norm_topk_prob`)."""
    sparse = qwen_moe.sparse_layers(hf_config)  # Qwen3.5-MoE's config has neither field: every layer
    if not any(sparse):
        return None, sparse
    moe = MoEConfig(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                    intermediate_size=hf_config.moe_intermediate_size,
                    normalize_top_k=bool(getattr(hf_config, "norm_topk_prob", True)),
                    shared_expert_size=hf_config.shared_expert_intermediate_size)
    return moe, sparse


def parse_config(hf_config: Any) -> ModelConfig:
    """The `ModelConfig` of a Qwen3-Next or Qwen3.5 text config; ValueError naming what this code cannot compute."""
    unknown = sorted(set(hf_config.layer_types) - set(MIXERS))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported for {hf_config.model_type} (jaxserve computes "
                         f"{', '.join(MIXERS)})")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported for {hf_config.model_type} (the Gated "
                         "DeltaNet convolution and the MLP use silu)")
    moe, sparse = experts(hf_config)
    bias = bool(getattr(hf_config, "attention_bias", False))
    config = llama.decoder_config(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe, sparse_layers=sparse)
    linear = LinearAttentionConfig(key_heads=hf_config.linear_num_key_heads,
                                   value_heads=hf_config.linear_num_value_heads,
                                   key_dim=hf_config.linear_key_head_dim, value_dim=hf_config.linear_value_head_dim,
                                   conv_kernel=hf_config.linear_conv_kernel_dim)
    layers = tuple(dataclasses.replace(layer, mixer=MIXERS[kind])
                   for layer, kind in zip(config.layers, hf_config.layer_types))
    return dataclasses.replace(config, layers=layers, attention_output_gate=True, norm_offset=1.0,
                               linear_attention=linear if any(layer.mixer != "attention" for layer in layers)
                               else None)



def linear_attention_shapes(config: ModelConfig, dtype: DTypeLike) -> dict:
    """One Gated DeltaNet layer's checkpoint-layout tree, in Qwen3.5's names or Qwen3-Next's."""
    la, hidden = config.linear_attention, config.hidden_size
    key, value = la.key_heads * la.key_dim, la.value_heads * la.value_dim

    def dense(fan_in: int, fan_out: int) -> dict:
        return {"kernel": jax.ShapeDtypeStruct((fan_in, fan_out), dtype)}

    if config.model_type == "qwen3_next":
        projections = {"in_proj_qkvz": dense(hidden, 2 * key + 2 * value), "in_proj_ba": dense(hidden, 2 * la.value_heads)}
    else:
        projections = {"in_proj_qkv": dense(hidden, 2 * key + value), "in_proj_z": dense(hidden, value),
                       "in_proj_b": dense(hidden, la.value_heads), "in_proj_a": dense(hidden, la.value_heads)}
    vector = jax.ShapeDtypeStruct((la.value_heads,), dtype)
    return {**projections, "conv1d": jax.ShapeDtypeStruct((la.conv_channels, 1, la.conv_kernel), dtype),
            "dt_bias": vector, "A_log": vector, "norm": jax.ShapeDtypeStruct((la.value_dim,), dtype),
            "out_proj": dense(value, hidden)}


def checkpoint_shapes(config: ModelConfig, dtype: DTypeLike = jnp.float32) -> dict:
    params = weights.checkpoint_shapes(config, dtype)
    for index in config.state_layers:
        layer = dict(params[f"layers_{index}"])
        del layer["attn"]
        params[f"layers_{index}"] = {**layer, "linear_attn": linear_attention_shapes(config, dtype)}
    return params


def checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    group, module, *inner = path.split("/")
    if module != "linear_attn":
        return weights.checkpoint_source(path, config)
    index = group.removeprefix("layers_")
    leaf = inner[-1]
    if leaf == "kernel":  # a linear, stored [out, in]
        return TensorSource((f"model.layers.{index}.linear_attn.{inner[0]}.weight",), True)
    name = {"conv1d": "conv1d.weight", "norm": "norm.weight"}.get(leaf, leaf)
    return TensorSource((f"model.layers.{index}.linear_attn.{name}",))


def multimodal_checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    source = checkpoint_source(path, config)
    return dataclasses.replace(source, names=tuple(MULTIMODAL_PREFIX + name.removeprefix("model.")
                                                   if name.startswith("model.") else name for name in source.names))


def head_parts(linear: dict, config: ModelConfig) -> tuple[jax.Array, ...]:
    """A checkpoint layer's in-projection kernels as q, k, v, z, b, a `[hidden, heads * dim]`, heads in order."""
    la = config.linear_attention
    if "in_proj_qkvz" in linear:
        qkvz, ba = linear["in_proj_qkvz"]["kernel"], linear["in_proj_ba"]["kernel"]
        per_key = la.value_heads // la.key_heads
        qkvz = qkvz.reshape(qkvz.shape[0], la.key_heads, -1)
        q, k, v, z = jnp.split(qkvz, [la.key_dim, 2 * la.key_dim, 2 * la.key_dim + per_key * la.value_dim], axis=-1)
        b, a = jnp.split(ba.reshape(ba.shape[0], la.key_heads, 2 * per_key), 2, axis=-1)
        return tuple(part.reshape(part.shape[0], -1) for part in (q, k, v, z, b, a))
    qkv = linear["in_proj_qkv"]["kernel"]
    key = la.key_heads * la.key_dim
    q, k, v = jnp.split(qkv, [key, 2 * key], axis=-1)
    return q, k, v, *(linear[name]["kernel"] for name in ("in_proj_z", "in_proj_b", "in_proj_a"))


def fuse_linear_attention(linear: dict, config: ModelConfig, tp: TensorParallel) -> dict:
    """A Gated DeltaNet layer's checkpoint-layout params -> serving layout: `in_proj` `[q_d | k_d | v_d | z_d | b_d
    | a_d]` for each device d, and the convolution's channels (q, k, v) in the same per-device order."""
    n = tp.size
    parts = head_parts(linear, config)
    in_proj = jnp.concatenate([part.reshape(part.shape[0], n, -1) for part in parts], axis=-1)
    la = config.linear_attention
    key = la.key_heads * la.key_dim
    conv = linear["conv1d"][:, 0, :]
    channels = jnp.split(conv, [key, 2 * key], axis=0)  # q, k, v rows
    conv = jnp.concatenate([part.reshape(n, -1, conv.shape[-1]) for part in channels], axis=1)
    return {"in_proj": {"kernel": in_proj.reshape(in_proj.shape[0], -1)}, "conv1d": conv.reshape(-1, conv.shape[-1]),
            "dt_bias": linear["dt_bias"], "A_log": linear["A_log"], "norm": linear["norm"],
            "out_proj": linear["out_proj"]}


def fuse_layer(layer: dict, config: ModelConfig, tp: TensorParallel) -> dict:
    if "linear_attn" not in layer:
        return weights.fuse_layer(layer, config, tp)
    return {**layer, "linear_attn": fuse_linear_attention(layer["linear_attn"], config, tp),
            "mlp": weights.fuse_mlp(dict(layer["mlp"]), tp)}


def dummy_fan_in(path: str, shape: tuple[int, ...]) -> int:
    """The decoder's fan-ins; the convolution's is its kernel, a per-head vector's 1."""
    if path.endswith("conv1d"):
        return shape[-1]
    return 1 if len(shape) == 1 else weights.dummy_fan_in(path, shape)


# Tensor parallelism splits the key heads with their value heads: the in-projections on their output features,
# the convolution's channels and the per-head vectors with them, out_proj on its input features.
SHARDING_RULES: tuple[tuple[str, str], ...] = (
    (r"linear_attn/in_proj[a-z_]*/(kernel|zeros|scales)$", "columns"),
    (r"linear_attn/in_proj/scale$", "vector"),
    (r"linear_attn/out_proj/(kernel|zeros|scales)$", "rows"),
    (r"linear_attn/out_proj/scale$", "replicated"),
    (r"linear_attn/conv1d$", "rows"),
    (r"linear_attn/(dt_bias|A_log)$", "vector"),
    (r"linear_attn/norm$", "replicated"),
    *weights.SHARDING_RULES,
)

SPEC = dataclasses.replace(
    llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config, checkpoint_shapes=checkpoint_shapes,
    checkpoint_source=checkpoint_source, fuse_layer=fuse_layer, sharding_rules=SHARDING_RULES,
    quantizable_linears=(), dummy_fan_in=dummy_fan_in, lora_targets=())
def multimodal_parse_config(hf_config: Any) -> ModelConfig:
    """The decoder of an image + text Qwen3.5 config: its M-RoPE (interleaved over the rotated quarter of each
    head), which turns an image's tokens by their grid; text alone turns as without it."""
    config = text_decoder_parser(parse_config)(hf_config)
    rope = dict(getattr(hf_config.text_config, "rope_parameters", None) or {})
    section = rope.get("mrope_section")
    rotary = next(layer.rotary_dim or config.head_dim for layer in config.layers if layer.mixer == "attention")
    if section is None or 2 * sum(section) != rotary:
        raise ValueError(f"{hf_config.model_type}: rope mrope_section {section} must cover the {rotary // 2} "
                         "rotated frequencies of each head")
    return dataclasses.replace(config, mrope_section=tuple(section),
                               mrope_interleaved=bool(rope.get("mrope_interleaved", False)))


MULTIMODAL_SPEC = dataclasses.replace(SPEC, model_types=MULTIMODAL_TYPES,
                                      parse_config=multimodal_parse_config,
                                      checkpoint_source=multimodal_checkpoint_source)

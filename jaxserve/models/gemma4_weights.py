"""Gemma 4's parameters (`models/gemma4.py`): the checkpoint layout, the Hugging Face tensor each is read from, and
where each lives on the device mesh; the Llama family's (`llama_weights`) plus what Gemma 4 adds.

Per layer: the extra norms of the experts' path, the experts beside the MLP under `moe` (router, its input scale,
a scale per expert; transformers stores every expert's gate and up in one `[E, 2I, H]` tensor, read as two
row ranges), the per-layer input's gate, projection and norm, and `layer_scalar`. Model-wide: the per-layer
inputs' table, projection and norm (`per_layer_inputs`). A layer reading another layer's KV has no k/v
projections and no k norm; a global layer with `attention_k_eq_v` has no v projection. Fusing is the Llama
family's (`llama_weights.fuse_layer`, which fuses the projections a layer has).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.models import llama_weights as weights
from jaxserve.models.spec import TensorSource

GLOBAL_TENSORS = {"per_layer_inputs/per_layer_embed/embedding": "embed_tokens_per_layer.weight",
                  "per_layer_inputs/per_layer_model_projection/kernel": "per_layer_model_projection.weight",
                  "per_layer_inputs/per_layer_projection_norm/scale": "per_layer_projection_norm.weight"}
LAYER_TENSORS = {"pre_feedforward_norm_2/scale": "pre_feedforward_layernorm_2.weight",
                 "post_feedforward_norm_1/scale": "post_feedforward_layernorm_1.weight",
                 "post_feedforward_norm_2/scale": "post_feedforward_layernorm_2.weight",
                 "per_layer_input_gate/kernel": "per_layer_input_gate.weight",
                 "per_layer_projection/kernel": "per_layer_projection.weight",
                 "post_per_layer_input_norm/scale": "post_per_layer_input_norm.weight",
                 "layer_scalar/scale": "layer_scalar",
                 "moe/router/kernel": "router.proj.weight",
                 "moe/router_input/scale": "router.scale",
                 "moe/expert_scale/scale": "router.per_expert_scale"}
SHARDING_RULES: tuple[tuple[str, str], ...] = (
    # the per-layer inputs' table and projection split on their [layers * P] columns (the table's vocabulary
    # need not be the model's), the small per-layer linears and the router whole on every device
    (r"^per_layer_inputs/per_layer_(embed/embedding|model_projection/kernel)$", "columns"),
    (r"per_layer_(input_gate|projection)/kernel$", "replicated"),
    (r"moe/router/", "replicated"),
    (r"(layer_scalar|router_input|expert_scale|_norm_\d)/scale$", "replicated"),
    *weights.SHARDING_RULES,
)


def checkpoint_shapes(config: ModelConfig, dtype: DTypeLike = jnp.float32) -> dict:
    """The checkpoint-layout parameter tree (as ShapeDtypeStructs) that loaders produce for `config`."""
    cfg = config
    params = weights.checkpoint_shapes(config, dtype)

    def vector(width: int) -> dict:
        return {"scale": jax.ShapeDtypeStruct((width,), dtype)}

    def dense(fan_in: int, fan_out: int) -> dict:
        return {"kernel": jax.ShapeDtypeStruct((fan_in, fan_out), dtype)}

    for index, layer in enumerate(cfg.layers):
        group = params[f"layers_{index}"]
        group["layer_scalar"] = vector(1)
        if layer.has_experts:
            group |= {name: vector(cfg.hidden_size)
                      for name in ("pre_feedforward_norm_2", "post_feedforward_norm_1", "post_feedforward_norm_2")}
            group["moe"] |= {"router_input": vector(cfg.hidden_size), "expert_scale": vector(cfg.moe.num_experts)}
        if cfg.per_layer_input_size:
            group |= {"per_layer_input_gate": dense(cfg.hidden_size, cfg.per_layer_input_size),
                      "per_layer_projection": dense(cfg.per_layer_input_size, cfg.hidden_size),
                      "post_per_layer_input_norm": vector(cfg.hidden_size)}
    if cfg.per_layer_input_size:
        width = cfg.num_layers * cfg.per_layer_input_size
        params["per_layer_inputs"] = {
            "per_layer_embed": {"embedding": jax.ShapeDtypeStruct((cfg.per_layer_vocab_size, width), dtype)},
            "per_layer_model_projection": dense(cfg.hidden_size, width),
            "per_layer_projection_norm": vector(cfg.per_layer_input_size)}
    return params


def checkpoint_source(path: str, config: ModelConfig, prefix: str = "model.") -> TensorSource:
    """The HF tensor(s) of our checkpoint-layout parameter at `path` (`prefix`: where the decoder's tensors are,
    "model." in a `Gemma4ForCausalLM` checkpoint)."""
    if path in GLOBAL_TENSORS:
        return TensorSource((prefix + GLOBAL_TENSORS[path],), path.endswith("/kernel"))
    group, _, inner = path.partition("/")
    if group.startswith("layers_") and (inner in LAYER_TENSORS or inner.startswith("moe/experts/")):
        layer = f"{prefix}layers.{group.removeprefix('layers_')}."
        if inner in LAYER_TENSORS:
            return TensorSource((layer + LAYER_TENSORS[inner],), inner.endswith("/kernel"))
        linear = inner.split("/")[2]  # every expert in one tensor: gate and up are the halves of gate_up_proj
        width = config.moe.intermediate_size
        rows = {"gate_proj": (0, width), "up_proj": (width, 2 * width)}.get(linear)
        return TensorSource((layer + ("experts.down_proj" if linear == "down_proj" else "experts.gate_up_proj"),),
                            True, rows)
    source = weights.checkpoint_source(path, config)
    if path == "lm_head/kernel":
        return source
    return dataclasses.replace(source, names=tuple(prefix + name.removeprefix("model.") for name in source.names))


def multimodal_checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    """A `gemma4` (image + text) checkpoint keeps its text decoder under `model.language_model.`."""
    return checkpoint_source(path, config, "model.language_model.")


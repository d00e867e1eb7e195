"""gpt-oss: the Llama decoder (`llama`) with attention sinks, biases on every attention projection, sliding (128)
and full layers by `layer_types`, YaRN rope, and a mixture of experts in every layer.

The router (with a bias) takes each token's top-k logits and softmaxes them, which equals the renormalized top-k
of the softmax over all experts (`normalize_top_k`). Each expert is gpt-oss's clamped SwiGLU with biases
(`MoEConfig.swiglu_limit`). Checkpoints hold every expert of a linear in one tensor, `[E, in, out]` (not
transposed), with gate and up interleaved along the last axis of `gate_up_proj` (gate at even columns): each of
our gate and up kernels is its stride-2 columns (`TensorSource.columns`), so fusing per device, sharding and int8
are the other mixtures' of experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig, MoEConfig
from jaxserve.models import llama
from jaxserve.models import llama_weights as weights
from jaxserve.models.spec import TensorSource

MODEL_TYPES = ("gpt_oss",)
EXPERT_TENSORS = {"gate_proj": ("gate_up_proj", (0, 2)), "up_proj": ("gate_up_proj", (1, 2)),
                  "down_proj": ("down_proj", None)}  # ours -> (the checkpoint's tensor, its columns)


def parse_config(hf_config: Any) -> ModelConfig:
    moe = MoEConfig(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                    intermediate_size=hf_config.intermediate_size, normalize_top_k=True, router_bias=True,
                    expert_bias=True, swiglu_limit=float(hf_config.swiglu_limit),
                    swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)))
    bias = bool(getattr(hf_config, "attention_bias", True))
    base = llama.decoder_config(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=False, moe=moe,
                                sparse_layers=(True,) * hf_config.num_hidden_layers)
    return dataclasses.replace(base, attention_sinks=True)


def checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    """Llama's sources, but the router is `mlp.router` and the experts are gpt-oss's stacked tensors."""
    group, module, *inner = path.split("/")
    if group.startswith("layers_") and module == "mlp":
        *inner, leaf = inner
        prefix = f"model.layers.{group.removeprefix('layers_')}.mlp"
        if inner == ["router"]:
            return TensorSource((f"{prefix}.router.{'bias' if leaf == 'bias' else 'weight'}",), leaf == "kernel")
        if len(inner) == 2 and inner[0] == "experts" and inner[1] in EXPERT_TENSORS:
            tensor, columns = EXPERT_TENSORS[inner[1]]
            return TensorSource((f"{prefix}.experts.{tensor}{'_bias' if leaf == 'bias' else ''}",), columns=columns)
    return weights.checkpoint_source(path, config)


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config,
                           checkpoint_source=checkpoint_source)

"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoder (`llama`) with a mixture of experts in its sparse layers.

A layer is sparse unless `mlp_only_layers` lists it, every `decoder_sparse_step`-th layer (HF's rule); the others
keep a dense MLP of `intermediate_size`. The router's top-k probabilities are renormalized only with
`norm_topk_prob`. Qwen2-MoE adds a shared expert (`shared_expert_intermediate_size`) scaled by a sigmoid gate, and
q/k/v biases (`qkv_bias`); Qwen3-MoE has q/k norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig, MoEConfig
from jaxserve.models import llama

MODEL_TYPES = ("qwen2_moe", "qwen3_moe")


def sparse_layers(hf_config: Any) -> tuple[bool, ...]:
    """Which layers have the experts: every `decoder_sparse_step`-th not in `mlp_only_layers` (none without
    experts)."""
    num_experts = getattr(hf_config, "num_experts", 0) or 0
    step = getattr(hf_config, "decoder_sparse_step", 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    if num_experts > 0 and step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    return tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                 for i in range(hf_config.num_hidden_layers))


def parse_config(hf_config: Any) -> ModelConfig:
    qwen2 = hf_config.model_type == "qwen2_moe"
    num_experts = hf_config.num_experts
    sparse = sparse_layers(hf_config)
    moe = None
    if any(sparse):
        moe = MoEConfig(num_experts=num_experts, top_k=hf_config.num_experts_per_tok,
                        intermediate_size=hf_config.moe_intermediate_size,
                        normalize_top_k=bool(hf_config.norm_topk_prob),
                        shared_expert_size=getattr(hf_config, "shared_expert_intermediate_size", 0) if qwen2 else 0)
    qkv_bias = bool(getattr(hf_config, "qkv_bias", True) if qwen2 else getattr(hf_config, "attention_bias", False))
    return llama.decoder_config(hf_config, qkv_bias=qkv_bias, qk_norm=not qwen2, moe=moe, sparse_layers=sparse)


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config)

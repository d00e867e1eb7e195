"""Phi-3 (mini, small context variants): the Llama decoder (`llama`) read from Phi-3's fused checkpoints.

Phi-3 checkpoints hold q/k/v as one `qkv_proj` (`[q | k | v]` rows) and gate/up as one `gate_up_proj`
(`[gate | up]` rows); each of our checkpoint-layout projections is its slice of those rows (`TensorSource.rows`),
so loading, fusing per device, sharding and quantization are the Llama family's. The sliding window, when the
config has one, applies to every layer. The 128k variants' `longrope` rotates a sequence's every token by whether
the sequence is longer than the original context, recomputing one that outgrows it (`layers/rotary.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models import llama_weights as weights
from jaxserve.models.spec import TensorSource

MODEL_TYPES = ("phi3",)
FUSED = {"attn": ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "mlp": ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))}


def parse_config(hf_config: Any) -> ModelConfig:
    return llama.decoder_config(hf_config, qkv_bias=False, qk_norm=False)


def checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    """Llama's sources, but q/k/v and gate/up are row slices of the fused tensors."""
    group, module, *inner = path.split("/")
    if group.startswith("layers_") and module in FUSED and len(inner) == 2 and inner[0] in FUSED[module][2]:
        hf_module, fused, parts = FUSED[module]
        widths = ((config.q_size, config.kv_size, config.kv_size) if module == "attn"
                  else (config.intermediate_size,) * 2)
        index = parts.index(inner[0])
        start = sum(widths[:index])
        name = f"model.layers.{group.removeprefix('layers_')}.{hf_module}.{fused}.weight"
        return TensorSource((name,), inner[1] == "kernel", rows=(start, start + widths[index]))
    return weights.checkpoint_source(path, config)


# an adapter of Phi-3 targets its checkpoint's fused projections: their `x @ A @ B` splits by rows exactly
LORA_TARGETS = (*((fused, parts) for _, fused, parts in FUSED.values()), ("o_proj", ("o_proj",)),
                ("down_proj", ("down_proj",)))
SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config,
                           checkpoint_source=checkpoint_source, lora_targets=LORA_TARGETS)

"""GLM-4.5 / GLM-4.6 (`glm4_moe`): the Llama decoder with partial rotary (`partial_rotary_factor`, half of each
head by default), q/k/v biases (`attention_bias`; none on o_proj), optional q/k norms (`use_qk_norm`), and
DeepSeek-V3's mixture of experts (`deepseek.deepseek_moe`) after `first_k_dense_replace` dense layers, with its
checkpoint names (`shared_experts`, the router's `e_score_correction_bias`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import deepseek, llama

MODEL_TYPES = ("glm4_moe",)


def parse_config(hf_config: Any) -> ModelConfig:
    moe, sparse = deepseek.deepseek_moe(hf_config)
    return llama.decoder_config(hf_config, qkv_bias=bool(hf_config.attention_bias),
                                qk_norm=bool(getattr(hf_config, "use_qk_norm", False)), moe=moe, sparse_layers=sparse)


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config,
                           checkpoint_source=deepseek.checkpoint_source)

"""Qwen2.5-VL's language model (`qwen2_5_vl`): Qwen2's decoder (q/k/v biases) with M-RoPE, its checkpoint names
Qwen2's (`model.layers.*`, `lm_head`). Its vision tower is `qwen2_5_vit`, served beside it (`multimodal/vision.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import hf_config as hf
from jaxserve.models import llama

MODEL_TYPES = ("qwen2_5_vl",)


def parse_config(hf_config: Any) -> ModelConfig:
    """The decoder of an image + text config (its `text_config`); ValueError naming what this code cannot compute."""
    text = hf_config.text_config
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    section = rope.get("mrope_section")
    if section is None or sum(section) * 2 != hf.head_dim(text):
        raise ValueError(f"{hf_config.model_type}: rope mrope_section {section} must cover the head's "
                         f"{hf.head_dim(text) // 2} frequencies")
    config = llama.decoder_config(text, qkv_bias=True, qk_norm=False)
    return dataclasses.replace(config, model_type=hf_config.model_type, mrope_section=tuple(section),
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config)

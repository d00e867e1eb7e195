"""The Qwen-VL language models: Qwen2.5-VL's (`qwen2_5_vl`: Qwen2's decoder with q/k/v biases, M-RoPE in sections,
checkpoint names Qwen2's) and Qwen3-VL's (`qwen3_vl`: Qwen3's decoder with q/k norms, M-RoPE interleaved, the
vision tower's deepstack features added after the first decoder layers; names under `model.language_model.`).
Their vision towers are `qwen2_5_vit` and `qwen3_vit`, served beside them (`multimodal/vision.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig, token_ids
from jaxserve.models import hf_config as hf
from jaxserve.models import llama
from jaxserve.models.spec import TensorSource

QWEN3_PREFIX = "model.language_model."  # where a Qwen3-VL checkpoint keeps its decoder (lm_head stays at the top)


def parse_config(hf_config: Any) -> ModelConfig:
    """The decoder of an image + text config (its `text_config`); ValueError naming what this code cannot compute."""
    text = hf_config.text_config
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    section = rope.get("mrope_section")
    if section is None or sum(section) * 2 != hf.head_dim(text):
        raise ValueError(f"{hf_config.model_type}: rope mrope_section {section} must cover the head's "
                         f"{hf.head_dim(text) // 2} frequencies")
    qwen3 = hf_config.model_type == "qwen3_vl"
    config = llama.decoder_config(text, qkv_bias=not qwen3 or bool(getattr(text, "attention_bias", False)),
                                  o_bias=qwen3 and bool(getattr(text, "attention_bias", False)), qk_norm=qwen3)
    deepstack = len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or ())
    eos = config.eos_token_ids or token_ids(getattr(hf_config, "eos_token_id", None))  # Qwen3-VL's: top level
    return dataclasses.replace(config, model_type=hf_config.model_type, mrope_section=tuple(section), eos_token_ids=eos,
                               mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
                               deepstack_layers=deepstack,
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


def qwen3_checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    source = llama.SPEC.checkpoint_source(path, config)
    return dataclasses.replace(source, names=tuple(QWEN3_PREFIX + name.removeprefix("model.")
                                                   if name.startswith("model.") else name for name in source.names))


SPEC = dataclasses.replace(llama.SPEC, model_types=("qwen2_5_vl",), parse_config=parse_config)
QWEN3_SPEC = dataclasses.replace(llama.SPEC, model_types=("qwen3_vl",), parse_config=parse_config,
                                 checkpoint_source=qwen3_checkpoint_source)

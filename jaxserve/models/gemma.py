"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder (`llama`) with Gemma's choices set in its `ModelConfig`.

All three: RMSNorm scales of `1 + w` computed in float32, a GeGLU feed-forward (tanh-approximated gelu), the
embedding times sqrt(hidden_size), tied embeddings. Gemma 2 and 3 add norms after the attention and after the
feed-forward (`sandwich_norms`), scores scaled by `query_pre_attn_scalar ** -0.5`, and sliding layers by
`layer_types`. Gemma 2 caps attention logits and final logits (`attn_logit_softcapping`,
`final_logit_softcapping`); Gemma 3 has q/k norms and a rope per layer type (`rope_parameters` keyed by
"sliding_attention" / "full_attention": the local base and the global base with its scaling). The image + text
`gemma3` checkpoints (the published Gemma 3 4B-27B): their `text_config` and the decoder's tensors under
`language_model.` (`MULTIMODAL_SPEC`); their SigLIP tower and projector are `siglip_vit`, served beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import hf_config as hf
from jaxserve.models import llama
from jaxserve.models.spec import TensorSource, text_decoder_parser

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}  # Gemma 1 configs say "gelu", mean tanh


def activation(hf_config: Any) -> str:
    name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "gelu_pytorch_tanh")
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_activation {name!r} is not supported for model_type {hf_config.model_type!r} "
                         f"(jaxserve computes Gemma's GeGLU with {sorted(HF_ACTIVATIONS)})")
    return HF_ACTIVATIONS[name]


def layer_ropes(hf_config: Any) -> list[tuple[float, Any]]:
    """Each layer's `(rope_theta, rope_scaling)`: Gemma 3's by layer type, else the model's."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if hf_config.model_type != "gemma3_text" or "full_attention" not in params:
        return [hf.rope_parameters(hf_config)] * hf_config.num_hidden_layers
    ropes = {kind: hf.parse_rope(params[kind], None, hf_config.max_position_embeddings) for kind in params}
    return [ropes[kind] for kind in hf_config.layer_types]


def parse_config(hf_config: Any) -> ModelConfig:
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (jaxserve serves causal decoders)")
    base = llama.decoder_config(hf_config, qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                                qk_norm=hf_config.model_type == "gemma3_text", activation=activation(hf_config))
    later = hf_config.model_type != "gemma"
    layers = tuple(dataclasses.replace(layer, rope_theta=theta, rope_scaling=scaling)
                   for layer, (theta, scaling) in zip(base.layers, layer_ropes(hf_config)))
    return dataclasses.replace(
        base, layers=layers, norm_offset=1.0, embedding_scale=hf_config.hidden_size ** 0.5, sandwich_norms=later,
        attention_scale=hf_config.query_pre_attn_scalar ** -0.5 if later else None,
        attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)))


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config)

MULTIMODAL_PREFIX = "language_model."  # where a `gemma3` (image + text) checkpoint keeps its text decoder


def multimodal_checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    source = llama.SPEC.checkpoint_source(path, config)
    return dataclasses.replace(source, names=tuple(MULTIMODAL_PREFIX + name for name in source.names))


def multimodal_parse_config(hf_config: Any) -> ModelConfig:
    """The text decoder of an image + text `gemma3` config; an image's tokens attend to each other both ways."""
    return dataclasses.replace(text_decoder_parser(parse_config)(hf_config), bidirectional_images=True)


# Gemma 3's image + text checkpoints (Gemma3ForConditionalGeneration): the text decoder
MULTIMODAL_SPEC = dataclasses.replace(SPEC, model_types=("gemma3",),
                                      parse_config=multimodal_parse_config,
                                      checkpoint_source=multimodal_checkpoint_source)

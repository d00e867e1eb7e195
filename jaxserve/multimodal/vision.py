"""`VisionModel`: an image + text checkpoint's vision side as the engine holds it — the tower's config and weights
(replicated on the mesh), the pure encoder, and the family's prompt processor (read by `loading/vision.py`).
`VISION_FAMILIES` names the families served with images."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxserve.models import qwen2_5_vit, qwen3_vit, siglip_vit
from jaxserve.multimodal.gemma3 import Gemma3Processor
from jaxserve.multimodal.qwen_vl import QwenVLProcessor


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    parse_config: Callable[[Any], Any]  # the image + text checkpoint's transformers config -> the tower's config
    encode: Callable[..., Any]  # (config, dtype, params, inputs) -> (embeddings in the call's order, ())
    # (config, [(pixels, grid)], bucket) -> (one call's inputs, each image's output rows in raster order)
    encoder_inputs: Callable[..., tuple[Any, list[np.ndarray]]]
    checkpoint_tensors: Callable[[Any], dict]  # config -> tree of (tensor name under the prefix, transposed)
    checkpoint_shapes: Callable[[Any], dict]  # config -> tree of shapes
    activation_bytes: Callable[[Any, int], int]  # (config, patches) -> a bound on one encode call's temporaries
    prefixes: tuple[str, ...]  # where checkpoints keep the tower's tensors (the first present is read)
    processor: type


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_5_vl": VisionFamily(qwen2_5_vit.parse_vision_config, qwen2_5_vit.encode, qwen2_5_vit.encoder_inputs,
                               qwen2_5_vit.checkpoint_tensors, qwen2_5_vit.checkpoint_shapes,
                               qwen2_5_vit.activation_bytes, ("visual.", "model.visual."), QwenVLProcessor),
    "qwen3_vl": VisionFamily(qwen2_5_vit.parse_vision_config, qwen3_vit.encode, qwen3_vit.encoder_inputs,
                             qwen3_vit.checkpoint_tensors, qwen3_vit.checkpoint_shapes, qwen3_vit.activation_bytes,
                             ("model.visual.", "visual."), QwenVLProcessor),
    # Qwen3.5's tower is Qwen3-VL's without deepstack features
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), VisionFamily(
        qwen2_5_vit.parse_vision_config, qwen3_vit.encode, qwen3_vit.encoder_inputs, qwen3_vit.checkpoint_tensors,
        qwen3_vit.checkpoint_shapes, qwen3_vit.activation_bytes, ("model.visual.",), QwenVLProcessor)),
    "gemma3": VisionFamily(siglip_vit.parse_config, siglip_vit.encode, siglip_vit.encoder_inputs,
                           siglip_vit.checkpoint_tensors, siglip_vit.checkpoint_shapes, siglip_vit.activation_bytes,
                           ("vision_tower.vision_model.", "vision_tower."), Gemma3Processor),
}


@dataclasses.dataclass
class VisionModel:
    family: VisionFamily
    config: Any
    params: dict  # the tower's weights in the serving dtype, replicated on the mesh
    processor: Any  # the family's prompt processor (`QwenVLProcessor`)


def is_image_model(model_type: str) -> bool:
    return model_type in VISION_FAMILIES

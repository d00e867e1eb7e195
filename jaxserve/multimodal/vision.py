"""`VisionModel`: an image + text checkpoint's vision side as the engine holds it — the tower's config and weights
(replicated on the mesh), the pure encoder, and the family's prompt processor (read by `loading/vision.py`).
`VISION_FAMILIES` names the families served with images."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.distributed.shardings import path_name
from jaxserve.distributed.tensor_parallel import MODEL_AXIS

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
    sharding_rules: tuple[tuple[str, str], ...]  # parameter path regex -> "columns" | "rows" | "replicated"


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_5_vl": VisionFamily(qwen2_5_vit.parse_vision_config, qwen2_5_vit.encode, qwen2_5_vit.encoder_inputs,
                               qwen2_5_vit.checkpoint_tensors, qwen2_5_vit.checkpoint_shapes,
                               qwen2_5_vit.activation_bytes, ("visual.", "model.visual."), QwenVLProcessor,
                               qwen2_5_vit.SHARDING_RULES),
    "qwen3_vl": VisionFamily(qwen2_5_vit.parse_vision_config, qwen3_vit.encode, qwen3_vit.encoder_inputs,
                             qwen3_vit.checkpoint_tensors, qwen3_vit.checkpoint_shapes, qwen3_vit.activation_bytes,
                             ("model.visual.", "visual."), QwenVLProcessor, qwen3_vit.SHARDING_RULES),
    # Qwen3.5's tower is Qwen3-VL's without deepstack features
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), VisionFamily(
        qwen2_5_vit.parse_vision_config, qwen3_vit.encode, qwen3_vit.encoder_inputs, qwen3_vit.checkpoint_tensors,
        qwen3_vit.checkpoint_shapes, qwen3_vit.activation_bytes, ("model.visual.",), QwenVLProcessor,
        qwen3_vit.SHARDING_RULES)),
    "gemma3": VisionFamily(siglip_vit.parse_config, siglip_vit.encode, siglip_vit.encoder_inputs,
                           siglip_vit.checkpoint_tensors, siglip_vit.checkpoint_shapes, siglip_vit.activation_bytes,
                           ("vision_tower.vision_model.", "vision_tower."), Gemma3Processor,
                           siglip_vit.SHARDING_RULES),
}


@dataclasses.dataclass
class VisionModel:
    family: VisionFamily
    config: Any
    params: dict  # the tower's weights in the serving dtype, on the mesh (`tower_shardings`)
    processor: Any  # the family's prompt processor (`QwenVLProcessor`)


def tower_shardings(family: VisionFamily, config: Any, shapes: dict, mesh: Mesh) -> dict:
    """Each tower parameter's sharding over `mesh`: by the family's rules, "columns" split on the last axis and
    "rows" on the first over the model axis (Megatron's pairs: each block's attention heads and MLP features
    apart, the compiler summing the partial outputs), replicated where that axis does not divide, and the whole
    tower replicated when its heads do not split evenly."""
    devices = mesh.shape.get(MODEL_AXIS, 1)
    splits = devices > 1 and config.num_heads % devices == 0

    def sharding(path, shape: tuple[int, ...]) -> NamedSharding:
        kind = next(kind for pattern, kind in family.sharding_rules if re.search(pattern, path_name(path)))
        axis = {"columns": len(shape) - 1, "rows": 0}.get(kind)
        if not splits or axis is None or shape[axis] % devices:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*(MODEL_AXIS if i == axis else None for i in range(len(shape)))))
    return jax.tree_util.tree_map_with_path(sharding, shapes, is_leaf=is_shape)


def is_shape(leaf: Any) -> bool:
    return isinstance(leaf, tuple) and all(isinstance(n, int) for n in leaf)


def is_image_model(model_type: str) -> bool:
    return model_type in VISION_FAMILIES

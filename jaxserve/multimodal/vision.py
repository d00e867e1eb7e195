"""`VisionModel`: an image + text checkpoint's vision side as the engine holds it — the tower's config and weights
(replicated on the mesh), the pure encoder, and the family's prompt processor — and `load_vision`, which reads it
beside the language model (`loading.load_model`). `VISION_FAMILIES` names the families served with images."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.models import qwen2_5_vit
from jaxserve.multimodal.qwen_vl import QwenVLProcessor


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    parse_config: Callable[[Any], Any]  # a transformers vision_config -> the tower's frozen config
    encode: Callable[..., Any]  # (config, dtype, params, inputs) -> (embeddings in the call's order, ())
    encoder_inputs: Callable[..., tuple[Any, np.ndarray]]  # (config, pixels, grid, bucket) -> (inputs, raster order)
    checkpoint_tensors: Callable[[Any], dict]  # config -> tree of (tensor name under the prefix, transposed)
    checkpoint_shapes: Callable[[Any], dict]  # config -> tree of shapes
    prefixes: tuple[str, ...]  # where checkpoints keep the tower's tensors (the first present is read)
    processor: type


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_5_vl": VisionFamily(qwen2_5_vit.parse_vision_config, qwen2_5_vit.encode, qwen2_5_vit.encoder_inputs,
                               qwen2_5_vit.checkpoint_tensors, qwen2_5_vit.checkpoint_shapes,
                               ("visual.", "model.visual."), QwenVLProcessor),
}


@dataclasses.dataclass
class VisionModel:
    family: VisionFamily
    config: Any
    params: dict  # the tower's weights in the serving dtype, replicated on the mesh
    processor: Any  # the family's prompt processor (`QwenVLProcessor`)


def is_image_model(model_type: str) -> bool:
    return model_type in VISION_FAMILIES


def load_vision(directory: str, dtype, mesh: Mesh, load_format: str = "auto",
                mm_processor_kwargs: dict | None = None) -> VisionModel:
    """The vision side of the image + text checkpoint in `directory`; ValueError naming a missing tensor or a shape
    that does not match its config."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(directory)
    family = VISION_FAMILIES[hf_config.model_type]
    config = family.parse_config(hf_config.vision_config)
    shapes = family.checkpoint_shapes(config)
    if load_format == "dummy":
        rng = np.random.default_rng(0)
        host = jax.tree.map(lambda shape: (rng.standard_normal(shape) * 0.02).astype(np.float32), shapes,
                            is_leaf=lambda leaf: isinstance(leaf, tuple))
    else:
        host = read_tower(directory, family, config, shapes)
    sharding = NamedSharding(mesh, REPLICATED)
    params = jax.tree.map(lambda array: jax.device_put(array.astype(dtype), sharding), host)
    return VisionModel(family, config, params, family.processor(directory, hf_config, mm_processor_kwargs))


def read_tower(directory: str, family: VisionFamily, config: Any, shapes: dict) -> dict:
    from safetensors import safe_open

    from jaxserve.loading.hf_files import tensor_files

    files = tensor_files(directory)
    prefix = next((p for p in family.prefixes if any(name.startswith(p) for name in files)), None)
    if prefix is None:
        raise ValueError(f"{directory!r} has no vision tower tensors (looked under {', '.join(family.prefixes)})")

    def read(source: tuple[str, bool], shape: tuple[int, ...]) -> np.ndarray:
        name, transposed = prefix + source[0], source[1]
        if name not in files:
            raise ValueError(f"{os.path.basename(directory)}: vision tower tensor {name!r} is missing")
        with safe_open(files[name], framework="np") as reader:
            array = reader.get_tensor(name).astype(np.float32)
        if transposed:
            array = array.reshape(array.shape[0], -1).T
        if array.shape != tuple(shape):
            raise ValueError(f"vision tower tensor {name!r} has shape {array.shape}, its config says {shape}")
        return array
    return jax.tree.map(read, family.checkpoint_tensors(config), shapes,
                        is_leaf=lambda leaf: isinstance(leaf, tuple) and isinstance(leaf[0], str))

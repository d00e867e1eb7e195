"""`load_vision`: an image + text checkpoint's vision side (`multimodal.vision.VisionModel`), read beside its language
model (`loading.load_model`): the tower's tensors from the checkpoint's safetensors (or random ones for
`load_format="dummy"`), checked against its config, in the serving dtype and on the mesh (split under tensor parallelism:
`tower_shardings`), and the family's prompt processor."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.loading.hf_files import open_tensors, tensor_files
from jaxserve.multimodal.vision import VISION_FAMILIES, VisionFamily, VisionModel, is_shape, tower_shardings


def load_vision(directory: str, dtype, mesh: Mesh, load_format: str = "auto",
                mm_processor_kwargs: dict | None = None) -> VisionModel:
    """The vision side of the image + text checkpoint in `directory`; ValueError naming a missing tensor or a shape
    that does not match its config. `load_format` "dummy": random weights; "abstract": their shapes only
    (`ShapeDtypeStruct`s, for `jaxserve compile`)."""
    from jaxserve.loading.hf_files import read_hf_config

    hf_config = read_hf_config(directory)
    family = VISION_FAMILIES[hf_config.model_type]
    config = family.parse_config(hf_config)
    shapes = family.checkpoint_shapes(config)
    processor = family.processor(directory, hf_config, mm_processor_kwargs, defaults=load_format != "auto")
    shardings = tower_shardings(family, config, shapes, mesh)
    if load_format == "abstract":  # `jaxserve compile`: shapes on the target's devices, nothing read
        params = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), shapes,
                              shardings, is_leaf=is_shape)
        return VisionModel(family, config, params, processor)
    if load_format == "dummy":
        rng = np.random.default_rng(0)
        host = jax.tree.map(lambda shape: (rng.standard_normal(shape) * 0.02).astype(np.float32), shapes,
                            is_leaf=is_shape)
    else:
        host = read_tower(directory, family, config, shapes)
    params = jax.tree.map(lambda array, sharding: jax.device_put(array.astype(dtype), sharding), host, shardings)
    return VisionModel(family, config, params, processor)


def read_tower(directory: str, family: VisionFamily, config: Any, shapes: dict) -> dict:
    files = tensor_files(directory)
    prefix = next((p for p in family.prefixes if any(name.startswith(p) for name in files)), None)
    if prefix is None:
        raise ValueError(f"{directory!r} has no vision tower tensors (looked under {', '.join(family.prefixes)})")

    def read(source: tuple[str, bool], shape: tuple[int, ...]) -> np.ndarray:
        name, transposed = source[0][1:] if source[0].startswith("^") else prefix + source[0], source[1]
        if name not in files:
            raise ValueError(f"{os.path.basename(directory)}: vision tower tensor {name!r} is missing")
        with open_tensors(files[name]) as reader:
            array = reader.get_tensor(name).astype(np.float32)
        if transposed:
            array = array.reshape(array.shape[0], -1).T
        if len(shape) > array.ndim and array.size == np.prod(shape):  # a fused q/k/v split on its output axis
            array = array.reshape(shape)
        if array.shape != tuple(shape):
            raise ValueError(f"vision tower tensor {name!r} has shape {array.shape}, its config says {shape}")
        return array
    return jax.tree.map(read, family.checkpoint_tensors(config), shapes,
                        is_leaf=lambda leaf: isinstance(leaf, tuple) and isinstance(leaf[0], str))

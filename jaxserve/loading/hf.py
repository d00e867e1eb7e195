"""Hugging Face checkpoints: safetensors read lazily, slice by slice, straight onto the devices in the serving dtype.

One table (`hf_sources`) maps every parameter of our checkpoint-layout tree (`models.checkpoint_shapes`) to the
HF tensor it comes from and whether it is transposed (HF linear weights are `[out, in]`, our kernels `[in, out]`).
`load_hf_checkpoint` builds each parameter with `jax.make_array_from_callback` and its target sharding: every
device's callback reads only that device's slice of the tensor (`safe_open(...).get_slice`), casts it to the
serving dtype and hands it to the device. The file is opened (memory-mapped) for one tensor at a time, so the
host holds one tensor's slices in flight: no float32 copy of the model, no copy of the checkpoint, and with
tensor parallelism a split tensor is never read whole, only each device's part of it. `convert_hf_state_dict`
applies the same table to an in-memory state dict (the GGUF conversion's).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
GLOBAL_TENSORS = {"embed/embedding": "model.embed_tokens.weight", "final_norm/scale": "model.norm.weight",
                  "lm_head/kernel": "lm_head.weight"}
LAYER_MODULES = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "attn": "self_attn", "mlp": "mlp"}


def hf_source(path: str) -> tuple[str, bool]:
    """`(HF tensor name, transposed?)` of our parameter at `path` ("layers_0/attn/q_proj/kernel", ...).

    Kernels are transposed (HF `[out, in]`); the embedding, norms and biases are not.
    """
    if path in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[path], path.endswith("/kernel")
    group, module, *inner, leaf = path.split("/")
    if not group.startswith("layers_") or module not in LAYER_MODULES:
        raise KeyError(f"no Hugging Face tensor for parameter {path!r}")
    name = ".".join(["model.layers", group.removeprefix("layers_"), LAYER_MODULES[module], *inner,
                     "bias" if leaf == "bias" else "weight"])
    return name, leaf == "kernel"


def hf_sources(config: ModelConfig) -> dict:
    """The checkpoint-layout tree of `config` with `(HF tensor name, transposed?)` leaves (see `hf_source`)."""
    from jaxserve.distributed.shardings import path_name
    from jaxserve.models import checkpoint_shapes

    return jax.tree_util.tree_map_with_path(lambda path, _: hf_source(path_name(path)), checkpoint_shapes(config))


def is_source(leaf) -> bool:
    return isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[0], str)


def tensor_files(path: str) -> dict[str, str]:
    """Which `*.safetensors` file of directory `path` holds each tensor (from the index file, else the headers)."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    located = {}
    for file in files:
        with safe_open(file, framework="np") as reader:
            located.update(dict.fromkeys(reader.keys(), file))
    return located


def read_hf_slice(tensor, transposed: bool, index: tuple, dtype: np.dtype) -> np.ndarray:
    """Our `index` of the HF tensor `tensor` (a safetensors slice) in `dtype`: for a transposed kernel our
    `[i0, i1]` is their `[i1, i0]`, read and then transposed."""
    index = tuple(index) + (slice(None),) * (len(tensor.get_shape()) - len(index))
    if transposed:
        return np.ascontiguousarray(tensor[index[1], index[0]].T, dtype=dtype)
    return np.ascontiguousarray(tensor[index], dtype=dtype)


def load_hf_params(path: str, config: ModelConfig, shardings: dict, dtype: DTypeLike) -> dict:
    """The checkpoint-layout params of the HF checkpoint in `path`, each a jax array in `dtype` placed with its
    sharding from `shardings` (a tree like `checkpoint_shapes(config)`); each device's slice is read on its own."""
    from safetensors import safe_open

    from jaxserve.models import checkpoint_shapes

    dtype = np.dtype(dtype)
    files = tensor_files(path)

    def load(source: tuple[str, bool], sharding, expected: jax.ShapeDtypeStruct) -> jax.Array:
        name, transposed = source
        if name not in files:
            raise ValueError(f"checkpoint {path!r} is missing tensor {name!r}")
        with safe_open(files[name], framework="np") as reader:  # unmapped again once this tensor is placed
            tensor = reader.get_slice(name)
            shape = tuple(tensor.get_shape())
            check_shape(name, shape[::-1] if transposed else shape, expected.shape, path)
            return jax.make_array_from_callback(
                expected.shape, sharding, lambda index: read_hf_slice(tensor, transposed, index, dtype), dtype=dtype)

    return jax.tree.map(load, hf_sources(config), shardings, checkpoint_shapes(config, dtype), is_leaf=is_source)


def check_shape(name: str, ours: tuple, expected: tuple, where: str) -> None:
    """ValueError if HF tensor `name`, in our orientation `ours`, is not the shape the config implies."""
    if tuple(ours) != tuple(expected):
        raise ValueError(f"checkpoint {where!r}: tensor {name!r} has shape {tuple(ours)} in our layout, "
                         f"the model config implies {tuple(expected)}")


def convert_hf_state_dict(state: Mapping[str, np.ndarray], config: ModelConfig, dtype: DTypeLike = np.float32) -> dict:
    """Maps an in-memory HF state dict (`model.layers.0.self_attn.q_proj.weight`, ...) to our checkpoint-layout tree
    of numpy arrays in `dtype`, by the same table as `load_hf_params` (used by the GGUF conversion)."""
    from jaxserve.models import checkpoint_shapes

    dtype = np.dtype(dtype)

    def convert(source: tuple[str, bool], expected: jax.ShapeDtypeStruct) -> np.ndarray:
        name, transposed = source
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        tensor = state[name].T if transposed else state[name]
        check_shape(name, tensor.shape, expected.shape, "state dict")
        return np.ascontiguousarray(tensor, dtype=dtype)

    return jax.tree.map(convert, hf_sources(config), checkpoint_shapes(config), is_leaf=is_source)


def hf_model_config(path: str) -> ModelConfig:
    """The `ModelConfig` of the HF checkpoint directory `path` (its config.json; no weights read)."""
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


def load_hf_checkpoint(path: str, dtype: DTypeLike = np.float32, mesh: Mesh | None = None) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params)` from a HF checkpoint directory (config.json + safetensors): jax arrays in `dtype`
    placed on `mesh` (default: one device) by the sharding table. The head counts are checked before any read.
    An AutoAWQ checkpoint (config.json's quantization_config) loads with its linears 4-bit (`loading/awq.py`)."""
    from jaxserve.loading.awq import checkpoint_quantization_config, load_awq_checkpoint
    from jaxserve.loading.placement import checkpoint_shardings

    config = hf_model_config(path)
    quantization = checkpoint_quantization_config(path)
    if quantization is not None and str(quantization.get("quant_method", "")).lower() == "awq":
        return config, load_awq_checkpoint(path, config, quantization, dtype, mesh)
    return config, load_hf_params(path, config, checkpoint_shardings(config, dtype, mesh), dtype)

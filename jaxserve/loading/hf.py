"""Hugging Face checkpoints: safetensors read lazily, slice by slice, straight onto the devices in the serving dtype.

The model's spec names the checkpoint tensor(s) of every parameter of our checkpoint-layout tree
(`models.checkpoint_sources`: a `TensorSource`, transposed when HF stores it `[out, in]`, several tensors stacked
on a new leading axis). `load_hf_checkpoint` builds each parameter with `jax.make_array_from_callback` and its
target sharding: every device's callback reads only that device's slice of the tensor (`open_tensors(...).get_slice`),
casts it to the serving dtype and hands it to the device. The file is opened (memory-mapped) for one parameter at a
time, so the host holds one parameter's slices in flight: no float32 copy of the model, no copy of the checkpoint,
and with tensor parallelism a split tensor is never read whole, only each device's part of it.
`convert_hf_state_dict` applies the same sources to an in-memory state dict (the GGUF conversion's). An AutoAWQ
checkpoint loads through `loading/awq.py`. A tensor stored as MXFP4 (`{name}_blocks` and `{name}_scales`, gpt-oss's
experts), or as block-scaled FP8 (e4m3 with a `{name}_scale_inv` per block, DeepSeek-V3's and transformers'
fine-grained FP8), is dequantized to the serving dtype as each device reads its slice.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.layers.fp8 import FP8
from jaxserve.loading.awq import load_awq_checkpoint
from jaxserve.loading.fp8_checkpoint import fp8_checkpoint_shapes, read_fp8_slice, scale_source
from jaxserve.loading.hf_files import (check_fp8_scales, check_shape, checkpoint_quantization_config, fp8_view,
                                       hf_model_config, is_mxfp4, mxfp4_shape, open_tensors, read_fp8_block_slice,
                                       read_hf_slice, read_mxfp4_slice, rows_axis, source_shape, tensor_files)
from jaxserve.loading.placement import checkpoint_shardings
from jaxserve.models import TensorSource, checkpoint_shapes, checkpoint_sources, param_shardings


def is_source(leaf) -> bool:
    return isinstance(leaf, TensorSource)


def load_hf_params(path: str, config: ModelConfig, shardings: dict, dtype: DTypeLike,
                   fp8_block: tuple[int, int] | None = None, shapes: dict | None = None,
                   sources: dict | None = None) -> dict:
    """The checkpoint-layout params of the HF checkpoint in `path`, each a jax array in `dtype` placed with its
    sharding from `shardings` (a tree like `shapes`, default `checkpoint_shapes(config, dtype)`); each device's
    slice is read on its own. `fp8_block`: the checkpoint's fine-grained FP8 blocks; a tensor with a
    `{name}_scale_inv` is dequantized, unless `shapes` has it as float8 with a `block_scale` (`fp8_checkpoint`).
    `sources`: a tree like `shapes` of `TensorSource`s (default `checkpoint_sources(config)`: a model's own layers;
    a model's MTP layer is read from other names)."""
    dtype = np.dtype(dtype)
    files = tensor_files(path)
    shapes = checkpoint_shapes(config, dtype) if shapes is None else shapes
    sources = checkpoint_sources(config) if sources is None else sources

    def load_leaf(key_path, expected: jax.ShapeDtypeStruct, sharding) -> jax.Array:
        *module, leaf = [str(getattr(key, "key", key)) for key in key_path]
        source = functools.reduce(lambda tree, key: tree[key], module, sources)
        if leaf == "block_scale":  # an FP8 kernel's scales, read from the tensors beside its weights
            return load(scale_source(source["kernel"]), sharding, expected)
        return load(source[leaf], sharding, expected)

    def load(source: TensorSource, sharding, expected: jax.ShapeDtypeStruct) -> jax.Array:
        stacked = len(source.names) > 1
        if not stacked and is_mxfp4(source.names[0], files):
            return load_mxfp4(source, sharding, expected)
        with contextlib.ExitStack() as stack:  # unmapped again once this parameter is placed
            readers = []
            for name in source.names:
                if name not in files:
                    raise ValueError(f"checkpoint {path!r} is missing tensor {name!r}")
                if expected.dtype == FP8:  # kept FP8: the raw values of our slice
                    weight = fp8_view(files[name], name)
                    shape, reader = weight.shape, functools.partial(read_fp8_slice, weight)
                elif f"{name}_scale_inv" in files:
                    shape, reader = fp8_reader(name, source, stack)
                else:
                    tensor = stack.enter_context(open_tensors(files[name])).get_slice(name)
                    shape, reader = tensor.get_shape(), functools.partial(
                        read_hf_slice, tensor, source.transposed, dtype=expected.dtype, rows=source.rows,
                        columns=source.columns)
                readers.append(reader)
                check_shape(name, source_shape(shape, source.transposed, source.rows, source.columns),
                            expected.shape[1:] if stacked else expected.shape, path)

            def read(index: tuple) -> np.ndarray:
                if not stacked:
                    return readers[0](index=index)
                chosen = range(len(readers))[index[0] if index else slice(None)]
                return np.stack([readers[i](index=index[1:]) for i in chosen])

            return jax.make_array_from_callback(expected.shape, sharding, read, dtype=expected.dtype)

    def fp8_reader(name: str, source: TensorSource, stack: contextlib.ExitStack):
        if fp8_block is None:
            raise ValueError(f"checkpoint {path!r}: tensor {name!r} has a weight_scale_inv, but config.json's "
                             "quantization_config names no fp8 weight_block_size")
        if source.rows is not None or source.columns is not None:
            raise ValueError(f"checkpoint {path!r}: a fused FP8 tensor ({name!r}) is not supported")
        weight = fp8_view(files[name], name)
        scales = stack.enter_context(open_tensors(files[f"{name}_scale_inv"])).get_slice(
            f"{name}_scale_inv")
        check_fp8_scales(name, weight.shape, scales.get_shape(), fp8_block, path)
        return weight.shape, functools.partial(read_fp8_block_slice, weight, scales, fp8_block, source.transposed,
                                               dtype=dtype)

    def load_mxfp4(source: TensorSource, sharding, expected: jax.ShapeDtypeStruct) -> jax.Array:
        name = source.names[0]
        with contextlib.ExitStack() as stack:
            blocks, scales = (stack.enter_context(open_tensors(files[f"{name}_{part}"]))
                              .get_slice(f"{name}_{part}") for part in ("blocks", "scales"))
            if tuple(scales.get_shape()) != tuple(blocks.get_shape()[:-1]):
                raise ValueError(f"checkpoint {path!r}: MXFP4 tensor {name!r} has blocks {blocks.get_shape()} "
                                 f"and scales {scales.get_shape()}, which do not match")
            check_shape(f"{name}_blocks", source_shape(mxfp4_shape(blocks.get_shape()), False, None, source.columns),
                        expected.shape, path)
            return jax.make_array_from_callback(
                expected.shape, sharding, lambda index: read_mxfp4_slice(blocks, scales, index, dtype, source.columns),
                dtype=dtype)

    from tqdm import tqdm

    with tqdm(total=len(jax.tree.leaves(shapes)), desc=f"loading {Path(path).name}", unit="tensor",
              disable=None) as bar:  # shown on a terminal
        def counted(key_path, expected, sharding) -> jax.Array:
            array = load_leaf(key_path, expected, sharding)
            bar.update(1)
            return array

        return jax.tree_util.tree_map_with_path(counted, shapes, shardings)


def convert_hf_state_dict(state: Mapping[str, np.ndarray], config: ModelConfig, dtype: DTypeLike = np.float32) -> dict:
    """Maps an in-memory HF state dict (`model.layers.0.self_attn.q_proj.weight`, ...) to our checkpoint-layout tree
    of numpy arrays in `dtype`, by the same sources as `load_hf_params` (used by the GGUF conversion)."""
    dtype = np.dtype(dtype)

    def convert(source: TensorSource, expected: jax.ShapeDtypeStruct) -> np.ndarray:
        tensors = []
        for name in source.names:
            if name not in state:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            tensor = state[name]
            if source.rows is not None:
                tensor = np.moveaxis(np.moveaxis(tensor, rows_axis(tensor.ndim), 0)[slice(*source.rows)], 0,
                                     rows_axis(tensor.ndim))
            if source.columns is not None:
                tensor = tensor[..., source.columns[0]::source.columns[1]]
            tensors.append(np.swapaxes(tensor, -1, -2) if source.transposed else tensor)
        tensor = np.stack(tensors) if len(tensors) > 1 else tensors[0]
        check_shape(", ".join(source.names), tensor.shape, expected.shape, "state dict")
        return np.ascontiguousarray(tensor, dtype=dtype)

    return jax.tree.map(convert, checkpoint_sources(config), checkpoint_shapes(config), is_leaf=is_source)


def load_hf_checkpoint(path: str, dtype: DTypeLike = np.float32, mesh: Mesh | None = None,
                       expert_parallel: bool = False, quantization: str | None = None) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params)` from a HF checkpoint directory (config.json + safetensors): jax arrays in `dtype`
    placed on `mesh` (default: one device) by the sharding table. The head counts are checked before any read.
    An AutoAWQ checkpoint (config.json's quantization_config) loads with its linears 4-bit (`loading/awq.py`); a
    block-scaled FP8 one with its linears FP8 where they can be under `quantization="fp8"`
    (`loading/fp8_checkpoint.py`), else dequantized."""
    config = hf_model_config(path)
    checkpoint = checkpoint_quantization_config(path) or {}
    method = str(checkpoint.get("quant_method", "")).lower()
    if method == "awq":
        return config, load_awq_checkpoint(path, config, checkpoint, dtype, mesh)
    block = fp8_blocks(checkpoint) if method == "fp8" else None
    if block is None or quantization != "fp8":
        return config, load_hf_params(path, config, checkpoint_shardings(config, dtype, mesh, expert_parallel),
                                      dtype, block)
    mesh = make_mesh(1) if mesh is None else mesh
    tp = TensorParallel(mesh.size, expert_parallel)
    tp.check(config)
    files = tensor_files(path)
    shapes = fp8_checkpoint_shapes(config, dtype, tp, block,
                                   lambda source: all(f"{name}_scale_inv" in files for name in source.names))
    return config, load_hf_params(path, config, param_shardings(shapes, config, tp, mesh), dtype, block, shapes)


def fp8_blocks(quantization: dict) -> tuple[int, int]:
    """A fine-grained FP8 checkpoint's blocks (config.json's `weight_block_size`); ValueError for other FP8 kinds."""
    block = quantization.get("weight_block_size")
    fmt = quantization.get("fmt", "e4m3")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block) or fmt != "e4m3"):
        raise ValueError(f"quantization_config {quantization}: jaxserve reads FP8 checkpoints with e4m3 weights in "
                         "blocks (weight_block_size [rows, columns], as DeepSeek-V3's), dequantized on load")
    return tuple(block)

"""AutoAWQ checkpoints (4-bit, GEMM format), vLLM's `quantization="awq"`: detection, checks, loading, writing.

An AutoAWQ checkpoint is a Hugging Face directory whose config.json carries `"quantization_config":
{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true, "version": "gemm"}` and whose decoder
linears (q/k/v/o, gate/up/down) are stored as three tensors instead of `weight`:

* `qweight` int32 `[in, out / 8]`: eight 4-bit values per int32 along the output features, nibble i (bits 4i..4i+3)
  holding column `AWQ_ORDER[i]` of its eight (so column j sits in nibble `AWQ_REVERSE_ORDER[j]`);
* `qzeros` int32 `[in / G, out / 8]`, packed the same way, and `scales` float16 `[in / G, out]`;

with `w[i, o] = (q[i, o] - z[i // G, o]) * s[i // G, o]`. The embedding, norms, biases and LM head stay float.

Like vLLM, the checkpoint decides: `check_quantization` reads config.json before any weight, so an AWQ checkpoint
loads as AWQ when `quantization` is unset, and a mismatch (`"awq"` on a checkpoint that is not AWQ, or another
mode on one that is), an unsupported AWQ variant, a group size that does not divide a layer's input features, or a
tensor-parallel split that would cut a group is a `ValueError` naming the option and what was found.
`load_awq_params` unpacks each device's slice at load into uint4 arrays in the natural column order (XLA keeps
them packed two a byte), the leaves `layers/awq.py` multiplies by: `kernel` `[in, out]`, `zeros` and `scales`
`[in / G, out]`. `write_awq_checkpoint` writes the format (round-to-nearest int4, no activation-aware scaling),
for tests and benchmarks, which cannot download a real one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import path_name
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.loading.hf_files import (check_shape, checkpoint_quantization_config, hf_model_config, open_tensors,
                                       read_hf_slice, tensor_files)
from jaxserve.models import checkpoint_shapes, model_spec, param_shardings

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing: nibble i holds column AWQ_ORDER[i] of eight
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j is in nibble AWQ_REVERSE_ORDER[j]
AWQ_TENSORS = {"kernel": "qweight", "zeros": "qzeros", "scales": "scales"}  # our leaf -> the checkpoint's tensor


def pack_awq(values: np.ndarray) -> np.ndarray:
    """Ints in [0, 15] `[rows, cols]` (cols a multiple of 8) -> AutoAWQ's int32 `[rows, cols / 8]`."""
    nibbles = values.astype(np.uint32).reshape(values.shape[0], -1, 8)[:, :, AWQ_ORDER]
    packed = (nibbles << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return np.ascontiguousarray(packed).view(np.int32)


def unpack_awq(packed: np.ndarray) -> np.ndarray:
    """AutoAWQ's int32 `[rows, cols / 8]` -> uint8 `[rows, cols]` in [0, 15], in the natural column order."""
    nibbles = (packed.view(np.uint32)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    return nibbles[:, :, AWQ_REVERSE_ORDER].astype(np.uint8).reshape(packed.shape[0], -1)


def awq_group_size(quantization_config: dict, config: ModelConfig, tp_size: int) -> int:
    """The group size of a `quant_method: awq` config, after checking that this engine can serve it: 4 bits,
    zero points, GEMM packing, and groups that divide every decoder linear's input features, whole on each
    device where tensor parallelism splits the input features (o_proj, down_proj)."""
    qc = quantization_config
    found = f"the checkpoint's quantization_config is {qc}"
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or not qc.get("zero_point", True) or version != "gemm":
        raise ValueError(f"quantization='awq' supports 4-bit GEMM checkpoints with zero points; {found}")
    if not isinstance(group, int) or group <= 0:
        raise ValueError(f"quantization='awq' needs a positive group_size; {found}")
    if config.moe is not None:
        raise ValueError(f"quantization='awq' is not supported for mixture-of-experts models (model_type "
                         f"{config.model_type!r}); serve the float checkpoint, with quantization='int8' if you like")
    inputs = {"hidden_size (q/k/v, gate/up in_features)": config.hidden_size,
              "q_size (o_proj in_features)": config.q_size,
              "intermediate_size (down_proj in_features)": config.intermediate_size}
    for name, width in inputs.items():
        if width % group:
            raise ValueError(f"quantization='awq': group_size {group} does not divide {name} = {width}")
    for name, width in list(inputs.items())[1:]:  # row-parallel: each device's input features
        if tp_size > 1 and (width % tp_size or (width // tp_size) % group):
            raise ValueError(f"quantization='awq' with tensor_parallel_size={tp_size}: {name} = {width} split "
                             f"{tp_size} ways is not whole groups of {group}")
    for name, width in {"q_size": config.q_size, "kv_size": config.kv_size, "hidden_size": config.hidden_size,
                        "intermediate_size": config.intermediate_size}.items():
        if width % 8:
            raise ValueError(f"quantization='awq': {name} = {width} output features are not whole int32s of 8")
    return group


def check_quantization(model: str | os.PathLike | None, quantization: str | None, tp_size: int = 1) -> str | None:
    """The weight quantization `model` is served with: the checkpoint's ("awq") when it has one, else
    `quantization`. ValueError, before any weight is read, if the two disagree, or for an AWQ checkpoint this
    engine cannot serve split `tp_size` ways (`awq_group_size`)."""
    qc = checkpoint_quantization_config(model)
    method = str(qc.get("quant_method", "")).lower() if qc is not None else None
    if quantization == "awq" and method != "awq":
        if qc is not None:
            has = f"its config.json has quantization_config {qc}"
        elif model is None:
            has = "it is the default model (float weights from a GGUF file)"
        elif (Path(model) / "config.json").is_file():
            has = "its config.json has no quantization_config (float weights)"
        else:
            has = "it is not a Hugging Face checkpoint directory with config.json"
        raise ValueError(f"quantization='awq' needs an AutoAWQ checkpoint, but model {model!r} is not one: {has}")
    if method == "fp8":  # block-scaled FP8: served as FP8 (`loading/fp8_checkpoint.py`), or dequantized for int8
        if quantization not in (None, "fp8", "int8"):
            raise ValueError(f"quantization={quantization!r} does not match model {model!r}, a block-scaled FP8 "
                             "checkpoint (quant_method 'fp8'): use quantization='fp8' (or leave it unset) or 'int8'")
        return quantization or "fp8"
    if method == "mxfp4":  # gpt-oss's MXFP4 experts: dequantized on load (`loading/hf.py`)
        return quantization
    if method is not None and method != "awq":
        raise ValueError(f"model {model!r} is quantized with quant_method {method!r}, which jaxserve cannot load "
                         "(supported: 'awq', block-scaled 'fp8'; 'mxfp4' experts, dequantized on load)")
    if method == "awq":
        if quantization not in (None, "awq"):
            raise ValueError(f"quantization={quantization!r} does not match model {model!r}, an AutoAWQ "
                             "checkpoint (quant_method 'awq'): use quantization='awq' or leave it unset")
        awq_group_size(qc, hf_model_config(str(model)), tp_size)
        return "awq"
    return quantization


def is_awq_leaf(path: str, linears: tuple[str, ...]) -> bool:
    """Whether our checkpoint-layout `path` ("layers_0/attn/q_proj/kernel") is an AWQ-quantized leaf of one of the
    model's quantizable `linears`."""
    parts = path.split("/")
    return parts[0].startswith("layers_") and parts[-2] in linears and parts[-1] in AWQ_TENSORS


def awq_checkpoint_shapes(config: ModelConfig, dtype: DTypeLike, group: int) -> dict:
    """`models.checkpoint_shapes(config, dtype)` with every decoder linear's kernel as AWQ leaves: uint4 `kernel`
    `[in, out]`, uint4 `zeros` and `dtype` `scales` `[in / group, out]` (biases stay)."""
    linears = model_spec(config.model_type).quantizable_linears

    def linear(module: dict) -> dict:
        fan_in, fan_out = module["kernel"].shape
        per_group = (fan_in // group, fan_out)
        return {**module, "kernel": jax.ShapeDtypeStruct((fan_in, fan_out), np.dtype(ml_dtypes.uint4)),
                "zeros": jax.ShapeDtypeStruct(per_group, np.dtype(ml_dtypes.uint4)),
                "scales": jax.ShapeDtypeStruct(per_group, dtype)}

    def walk(tree: dict, group_name: str) -> dict:
        return {name: linear(value) if group_name.startswith("layers_") and name in linears
                else walk(value, group_name) if isinstance(value, dict) else value for name, value in tree.items()}

    return {name: walk(value, name) for name, value in checkpoint_shapes(config, dtype).items()}


def read_awq_slice(tensor, leaf: str, index: tuple, dtype: np.dtype) -> np.ndarray:
    """Our `index` (rows, columns) of leaf `leaf` from its checkpoint tensor (a safetensors slice): packed
    leaves read the int32 columns covering the wanted ones, unpacked to uint4; scales cast to `dtype`."""
    rows, cols = tuple(index) + (slice(None),) * (2 - len(index))
    if leaf == "scales":
        return np.ascontiguousarray(tensor[rows, cols], dtype=dtype)
    start, stop, _ = cols.indices(tensor.get_shape()[1] * 8)
    unpacked = unpack_awq(np.asarray(tensor[rows, start // 8:-(-stop // 8)], dtype=np.int32))
    return unpacked[:, start % 8:start % 8 + stop - start].astype(ml_dtypes.uint4)


def load_awq_params(path: str, config: ModelConfig, group: int, shardings: dict, dtype: DTypeLike) -> dict:
    """The checkpoint-layout params (`awq_checkpoint_shapes`) of the AutoAWQ checkpoint in `path`, each a jax
    array placed with its sharding from `shardings`; each device's slice is read and unpacked on its own."""
    dtype, files = np.dtype(dtype), tensor_files(path)
    spec = model_spec(config.model_type)

    def load(key_path, expected: jax.ShapeDtypeStruct, sharding) -> jax.Array:
        ours = path_name(key_path)
        awq = is_awq_leaf(ours, spec.quantizable_linears)
        if awq:
            module, leaf = ours.rsplit("/", 1)
            name = (spec.checkpoint_source(f"{module}/kernel", config).names[0].removesuffix(".weight") + "."
                    + AWQ_TENSORS[leaf])
            rows, cols = expected.shape
            stored = (rows, cols // 8) if leaf != "scales" else (rows, cols)
        else:
            source = spec.checkpoint_source(ours, config)
            (name,), transposed = source.names, source.transposed
        if name not in files:
            raise ValueError(f"checkpoint {path!r} is missing tensor {name!r}")
        with open_tensors(files[name]) as reader:
            tensor = reader.get_slice(name)
            shape = tuple(tensor.get_shape())
            if awq:
                check_shape(name, shape, stored, path)
                read = lambda index: read_awq_slice(tensor, leaf, index, dtype)  # noqa: E731
            else:
                check_shape(name, shape[::-1] if transposed else shape, expected.shape, path)
                read = lambda index: read_hf_slice(tensor, transposed, index, dtype)  # noqa: E731
            return jax.make_array_from_callback(expected.shape, sharding, read, dtype=expected.dtype)

    return jax.tree_util.tree_map_with_path(load, awq_checkpoint_shapes(config, dtype, group), shardings)


def load_awq_checkpoint(path: str, config: ModelConfig, quantization_config: dict, dtype: DTypeLike,
                        mesh: Mesh | None = None) -> dict:
    """The params of the AutoAWQ checkpoint `path` on `mesh`, after `awq_group_size`'s checks."""
    mesh = make_mesh(1) if mesh is None else mesh
    tp = TensorParallel(mesh.size)
    tp.check(config)
    group = awq_group_size(quantization_config, config, mesh.size)
    shardings = param_shardings(awq_checkpoint_shapes(config, dtype, group), config, tp, mesh)
    return load_awq_params(path, config, group, shardings, dtype)


def quantize_rtn_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest asymmetric int4 of `w [in, out]` per group of `group` input rows (no activation-aware
    scaling): `(q uint8 [in, out], z uint8 [in / group, out], s float16 [in / group, out])`, w ~ (q - z) * s."""
    wg = w.astype(np.float32).reshape(w.shape[0] // group, group, w.shape[1])
    lo, hi = wg.min(1), wg.max(1)  # AutoAWQ's pseudo_quantize_tensor, without its activation-aware search
    s = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
    z = np.clip(-np.round(lo / s.astype(np.float32)), 0, 15)
    q = np.clip(np.round(wg / s.astype(np.float32)[:, None]) + z[:, None], 0, 15)
    return q.reshape(w.shape).astype(np.uint8), z.astype(np.uint8), s


def write_awq_checkpoint(directory: str | os.PathLike, state: Mapping[str, np.ndarray], hf_config: dict,
                         group: int) -> dict[str, np.ndarray]:
    """Writes an AutoAWQ-format checkpoint (model.safetensors + config.json; no tokenizer) of the float HF state
    dict `state`: every decoder linear RTN-quantized (`quantize_rtn_int4`), the rest in float16. Returns the model
    the checkpoint holds as a float32 state dict (HF names and orientation; the linears dequantized)."""
    from safetensors.numpy import save_file

    linears = model_spec(hf_config["model_type"]).quantizable_linears
    tensors, dequantized = {}, {}
    for name, value in state.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "weight" and prefix.split(".")[-1] in linears:
            q, z, s = quantize_rtn_int4(np.asarray(value, np.float32).T, group)
            tensors |= {f"{prefix}.qweight": pack_awq(q), f"{prefix}.qzeros": pack_awq(z),
                        f"{prefix}.scales": np.ascontiguousarray(s)}
            w = (q.astype(np.float32) - np.repeat(z, group, 0)) * np.repeat(s.astype(np.float32), group, 0)
            dequantized[name] = np.ascontiguousarray(w.T)
        else:
            tensors[name] = np.ascontiguousarray(value, dtype=np.float16)
            dequantized[name] = tensors[name].astype(np.float32)
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config, "torch_dtype": "float16", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}}
    with open(Path(directory) / "config.json", "w") as handle:
        json.dump(config, handle, indent=2)
    return dequantized

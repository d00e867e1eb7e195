"""A Hugging Face checkpoint directory's files: its config.json (the `ModelConfig`, the quantization config), which
safetensors file holds each tensor, and reading one slice of a tensor in our orientation."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import config_from_hf, model_spec

INDEX_FILE = "model.safetensors.index.json"


def hf_model_config(path: str) -> ModelConfig:
    """The `ModelConfig` of the HF checkpoint directory `path` (its config.json; no weights read); ValueError
    listing the supported model types for any other, naming the repository's own code (`auto_map`, which jaxserve
    never runs) when that is what the model needs, and naming the field transformers' validation refused."""
    file = Path(path) / "config.json"
    try:
        with open(file) as handle:  # the model type first: transformers may not know it
            raw = json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {file}: {err}") from None
    try:
        model_spec(raw.get("model_type"))
    except ValueError as err:
        if raw.get("auto_map"):
            raise ValueError(f"{file}: the model's code lives in its repository (auto_map {raw['auto_map']}), "
                             f"which jaxserve does not run, --trust-remote-code or not; {err}") from None
        raise
    return config_from_hf(read_hf_config(path))


def read_hf_config(path: str | os.PathLike) -> Any:
    """transformers' config of directory `path`; ValueError naming the file and the field its validation refuses
    (transformers raises huggingface_hub's StrictDataclassError, which is no ValueError)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except StrictDataclassError as err:
        raise ValueError(f"{Path(path) / 'config.json'}: {err}") from None


def checkpoint_json(model: str | os.PathLike | None) -> dict:
    """config.json of the HF checkpoint directory `model`; {} if `model` is not such a directory (the default
    model, a GGUF file, a converted store)."""
    if model is None or not (Path(model) / "config.json").is_file():
        return {}
    with open(Path(model) / "config.json") as handle:
        return json.load(handle)


def checkpoint_dtype(model: str | os.PathLike | None) -> str | None:
    """config.json's `dtype` (or `torch_dtype`) of the HF checkpoint directory `model`; None if it names none or
    `model` is not such a directory."""
    raw = checkpoint_json(model)
    value = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    return value if isinstance(value, str) else None


def checkpoint_quantization_config(model: str | os.PathLike | None) -> dict | None:
    """config.json's `quantization_config` of the HF checkpoint directory `model`; None if it has none or
    `model` is not such a directory (the default model, a GGUF file, a converted store)."""
    return checkpoint_json(model).get("quantization_config")


def open_tensors(file: str) -> Any:
    """`safetensors.safe_open(file)` for numpy; ValueError naming the file when it is truncated or damaged."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="np")
    except SafetensorError as err:
        raise ValueError(f"{file}: {err} (a truncated or damaged file: an interrupted download? delete it and "
                         "fetch it again)") from None


def tensor_files(path: str) -> dict[str, str]:
    """Which `*.safetensors` file of directory `path` holds each tensor (from the index file, else the headers)."""
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
        with open_tensors(file) as reader:
            located.update(dict.fromkeys(reader.keys(), file))
    return located


def read_hf_slice(tensor, transposed: bool, index: tuple, dtype: np.dtype,
                  rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> np.ndarray:
    """Our `index` of the HF tensor `tensor` (a safetensors slice) in `dtype`: for a transposed kernel (its last
    two axes swapped: `[out, in]`, or every expert's `[E, out, in]`) our `[..., i0, i1]` is their `[..., i1, i0]`,
    read and then swapped; with `rows`, our parameter is their output axis' rows `[start, stop)` only (`rows_axis`);
    with `columns` `(offset, step)`, their last axis' every `step`-th entry from `offset` (the span of our slice is
    read, then strided)."""
    ndim = len(tensor.get_shape())
    index = tuple(index) + (slice(None),) * (ndim - len(index))
    if columns is not None:
        offset, step = columns
        ours = index[-1]
        start = (ours.start or 0) * step
        stop = tensor.get_shape()[-1] if ours.stop is None else ours.stop * step
        span = tensor[index[:-1] + (slice(start, stop),)]
        return np.ascontiguousarray(span[..., offset::step], dtype=dtype)
    if rows is not None:
        ours = rows_axis(ndim) if not transposed else ndim - 1  # the index entry that addresses their rows
        wanted = index[ours]
        start = rows[0] + (wanted.start or 0)
        stop = rows[0] + (wanted.stop if wanted.stop is not None else rows[1] - rows[0])
        index = index[:ours] + (slice(start, stop),) + index[ours + 1:]
    if transposed:
        return np.ascontiguousarray(np.swapaxes(tensor[index[:-2] + (index[-1], index[-2])], -1, -2), dtype=dtype)
    return np.ascontiguousarray(tensor[index], dtype=dtype)


def rows_axis(ndim: int) -> int:
    """The axis a `TensorSource`'s `rows` slice: a kernel's output features (the second-to-last), a vector's only."""
    return max(ndim - 2, 0)


MXFP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)  # an FP4 (e2m1) code's value
MXFP4_GROUP = 32  # values per shared power-of-two scale (OCP microscaling), 16 bytes of two codes each


def is_mxfp4(name: str, files: dict[str, str]) -> bool:
    """Whether tensor `name` is stored as MXFP4, `{name}_blocks` and `{name}_scales` (gpt-oss's experts)."""
    return name not in files and f"{name}_blocks" in files and f"{name}_scales" in files


def mxfp4_shape(blocks_shape: tuple) -> tuple:
    """Our `[E, in, out]` shape of an MXFP4 tensor from its blocks' `[E, out, in / 32, 16]`."""
    *lead, out, groups, _ = blocks_shape
    return (*lead, groups * MXFP4_GROUP, out)


def read_mxfp4_slice(blocks, scales, index: tuple, dtype: np.dtype,
                     columns: tuple[int, int] | None = None) -> np.ndarray:
    """Our `index` of `[E, in, out]` from an MXFP4 tensor (safetensors slices of `blocks` uint8 `[E, out, in / 32,
    16]`, two FP4 codes per byte, low nibble first, and `scales` uint8 `[E, out, in / 32]`, exponents biased by
    127), dequantized to `dtype`: only the whole groups that cover our input rows are read. `columns` as for
    `read_hf_slice`."""
    experts, rows, outputs = tuple(index) + (slice(None),) * (3 - len(index))
    if columns is not None:
        offset, step = columns
        outputs = slice((outputs.start or 0) * step + offset, None if outputs.stop is None else outputs.stop * step,
                        step)
    num_in = mxfp4_shape(blocks.get_shape())[1]
    first, stop = rows.start or 0, num_in if rows.stop is None else rows.stop
    group_lo, group_hi = first // MXFP4_GROUP, -(-stop // MXFP4_GROUP)
    span = slice(outputs.start, outputs.stop)  # safetensors reads contiguous spans; the step is taken after
    codes = np.asarray(blocks[experts, span, group_lo:group_hi, :], np.uint8)[:, ::outputs.step or 1]
    exponents = np.asarray(scales[experts, span, group_lo:group_hi], np.int32)[:, ::outputs.step or 1] - 127
    values = np.stack([MXFP4_VALUES[codes & 0x0F], MXFP4_VALUES[codes >> 4]], axis=-1)  # [e, out, groups, 16, 2]
    values = np.ldexp(values.reshape(*codes.shape[:3], MXFP4_GROUP), exponents[..., None])
    values = values.reshape(*codes.shape[:2], -1)[..., first - group_lo * MXFP4_GROUP:stop - group_lo * MXFP4_GROUP]
    return np.ascontiguousarray(values.transpose(0, 2, 1), dtype=dtype)


FP8_DTYPES = {"F8_E4M3": "float8_e4m3fn"}  # safetensors' name -> ml_dtypes' (numpy has no float8 of its own)


def fp8_view(file: str, name: str) -> np.ndarray:
    """Tensor `name` of safetensors file `file`, stored as float8 (e4m3), as a read-only memory map: safetensors'
    numpy reader has no float8 dtype, so the view is made from the file's header (its documented layout: an
    8-byte little-endian header size, a JSON header with each tensor's dtype, shape and data offsets, the data)."""
    import ml_dtypes

    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        entry = json.loads(handle.read(size)).get(name)
    if entry is None or entry.get("dtype") not in FP8_DTYPES:
        raise ValueError(f"checkpoint file {file!r}: tensor {name!r} has a weight_scale_inv but is not stored as "
                         f"{'/'.join(FP8_DTYPES)} ({entry and entry.get('dtype')})")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end - begin != int(np.prod(shape)):
        raise ValueError(f"checkpoint file {file!r}: tensor {name!r} of shape {shape} holds {end - begin} bytes")
    return np.memmap(file, dtype=getattr(ml_dtypes, FP8_DTYPES[entry["dtype"]]), mode="r", offset=8 + size + begin,
                     shape=shape)


def read_fp8_block_slice(weight: np.ndarray, scale_inv, block: tuple[int, int], transposed: bool, index: tuple,
                         dtype: np.dtype) -> np.ndarray:
    """Our `index` of a float8 weight `[out, in]` (`fp8_view`) with one float32 scale per `block` of it
    (`scale_inv [ceil(out / b0), ceil(in / b1)]`, a safetensors slice: DeepSeek-V3's and transformers'
    fine-grained FP8), dequantized to `dtype`: only the scale rows and columns our slice covers are read."""
    index = tuple(index) + (slice(None),) * (2 - len(index))
    rows, cols = (index[1], index[0]) if transposed else index
    rows, cols = (np.arange(*part.indices(length)) for part, length in zip((rows, cols), weight.shape))
    values = np.zeros((rows.size, cols.size), np.float32)
    if values.size:  # each value times its block's scale; the scale rows and columns the slice covers are read
        values = np.asarray(weight[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1], np.float32)
        row_blocks, col_blocks = rows // block[0], cols // block[1]
        scales = np.asarray(scale_inv[row_blocks[0]:row_blocks[-1] + 1, col_blocks[0]:col_blocks[-1] + 1],
                            np.float32)
        values = values * scales[(row_blocks - row_blocks[0])[:, None], (col_blocks - col_blocks[0])[None, :]]
    return np.ascontiguousarray(values.T if transposed else values, dtype=dtype)


def check_fp8_scales(name: str, weight_shape: tuple, scale_shape: tuple, block: tuple[int, int], where: str) -> None:
    """ValueError unless `{name}_scale_inv` has one scale per `block` of the weight."""
    expected = tuple(-(-size // b) for size, b in zip(weight_shape, block))
    if len(weight_shape) != 2 or tuple(scale_shape) != expected:
        raise ValueError(f"checkpoint {where!r}: {name}_scale_inv has shape {tuple(scale_shape)}; a weight of shape "
                         f"{tuple(weight_shape)} in blocks of {list(block)} needs {expected}")


def source_shape(shape: tuple, transposed: bool, rows: tuple[int, int] | None,
                 columns: tuple[int, int] | None = None) -> tuple:
    """A HF tensor's shape in our orientation, of our slice of it (`rows`, `columns`; a tensor too short for the
    slice shows a shorter shape, which `check_shape` reports)."""
    shape = list(shape)
    if rows is not None:
        axis = rows_axis(len(shape))
        shape[axis] = max(0, min(shape[axis], rows[1]) - rows[0])
    if columns is not None:
        shape[-1] = len(range(columns[0], shape[-1], columns[1]))
    if transposed:
        shape[-2:] = shape[-2:][::-1]
    return tuple(shape)


def check_shape(name: str, ours: tuple, expected: tuple, where: str) -> None:
    """ValueError if HF tensor `name`, in our orientation `ours`, is not the shape the config implies."""
    if tuple(ours) != tuple(expected):
        raise ValueError(f"checkpoint {where!r}: tensor {name!r} has shape {tuple(ours)} in our layout, "
                         f"the model config implies {tuple(expected)}")

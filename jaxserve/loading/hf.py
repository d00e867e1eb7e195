"""Hugging Face checkpoints: safetensors read tensor by tensor, mapped onto our fused parameter tree in the serving dtype.

Each tensor is memory-mapped from its file and copied once, straight into an array of the serving dtype (fused
qkv / gate_up kernels are filled part by part), so loading holds the params in that dtype and nothing more: no
float32 copy of the model, no second copy of the checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Mapping, NamedTuple

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig

SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class TensorLocation(NamedTuple):
    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


def read_safetensors_header(file: str) -> dict[str, TensorLocation]:
    """Where each tensor of one `.safetensors` file lies: an 8-byte header length, a JSON header, then the data."""
    with open(file, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
    locations = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}; jaxserve reads "
                             f"{', '.join(SAFETENSORS_DTYPES)} checkpoints")
        locations[name] = TensorLocation(file, 8 + header_len + info["data_offsets"][0],
                                         np.dtype(SAFETENSORS_DTYPES[info["dtype"]]), tuple(info["shape"]))
    return locations


class SafetensorsDir(Mapping[str, np.ndarray]):
    """The tensors of every `*.safetensors` file in a directory (sharded or not), each mapped only when looked up.

    A looked-up tensor is a read-only memory map of its bytes in the file, in the checkpoint's dtype.
    """

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        self._locations: dict[str, TensorLocation] = {}
        for file in files:
            self._locations.update(read_safetensors_header(file))

    def __getitem__(self, name: str) -> np.ndarray:
        file, offset, dtype, shape = self._locations[name]
        return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._locations)

    def __len__(self) -> int:
        return len(self._locations)


def read_safetensors_dir(path: str) -> SafetensorsDir:
    """Every tensor of every `*.safetensors` file in `path`, read lazily (see `SafetensorsDir`)."""
    return SafetensorsDir(path)


def convert_hf_state_dict(state: Mapping[str, np.ndarray], config: ModelConfig, dtype: DTypeLike = np.float32) -> dict:
    """Maps HF names (`model.layers.0.self_attn.q_proj.weight`, ...) to our tree in `dtype`, fusing qkv and gate/up.

    HF linear weights are `[out, in]`; our kernels are `[in, out]`. Each source tensor is converted to `dtype` as it
    is copied into its place, so the only arrays allocated are the params themselves.
    """
    dtype = np.dtype(dtype)

    def get(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return state[name]

    def vector(*names: str) -> np.ndarray:
        return np.concatenate([get(n) for n in names], dtype=dtype)

    def dense(*names: str) -> np.ndarray:
        weights = [get(n) for n in names]
        kernel = np.empty((weights[0].shape[1], sum(w.shape[0] for w in weights)), dtype)
        start = 0
        for weight in weights:
            kernel[:, start:start + weight.shape[0]] = weight.T
            start += weight.shape[0]
        return kernel

    params: dict = {"embed": {"embedding": np.array(get("model.embed_tokens.weight"), dtype=dtype)}}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn_prefix = prefix + "self_attn."
        qkv = {"kernel": dense(*(attn_prefix + f"{p}_proj.weight" for p in "qkv"))}
        if config.qkv_bias:
            qkv["bias"] = vector(*(attn_prefix + f"{p}_proj.bias" for p in "qkv"))
        attn = {"qkv_proj": qkv, "o_proj": {"kernel": dense(attn_prefix + "o_proj.weight")}}
        if config.qk_norm:
            attn["q_norm"] = {"scale": vector(attn_prefix + "q_norm.weight")}
            attn["k_norm"] = {"scale": vector(attn_prefix + "k_norm.weight")}
        params[f"layers_{layer}"] = {
            "input_norm": {"scale": vector(prefix + "input_layernorm.weight")},
            "attn": attn,
            "post_attention_norm": {"scale": vector(prefix + "post_attention_layernorm.weight")},
            "mlp": {
                "gate_up_proj": {"kernel": dense(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight")},
                "down_proj": {"kernel": dense(prefix + "mlp.down_proj.weight")},
            },
        }
    params["final_norm"] = {"scale": vector("model.norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": dense("lm_head.weight")}
    return params


def load_hf_checkpoint(path: str, dtype: DTypeLike = np.float32) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params in dtype)` from a HF checkpoint directory (config.json + safetensors)."""
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    return config, convert_hf_state_dict(read_safetensors_dir(path), config, dtype)

"""Hugging Face checkpoints: safetensors read tensor by tensor, mapped onto our fused parameter tree in the serving dtype.

Each tensor is read only when its parameter is built and copied straight into an array of the serving dtype (fused
qkv / gate_up kernels are filled part by part), so loading holds the params in that dtype plus one tensor in
flight: no float32 copy of the model, no second copy of the checkpoint.
"""

from __future__ import annotations

import glob
import os
from typing import Iterator, Mapping

import numpy as np
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig


class SafetensorsDir(Mapping[str, np.ndarray]):
    """The tensors of every `*.safetensors` file in a directory (sharded or not), each read only when looked up,
    as a numpy array in the checkpoint's dtype (bfloat16 included) by safetensors' own reader."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        self._readers = [safe_open(file, framework="np") for file in files]
        self._reader_of = {name: reader for reader in self._readers for name in reader.keys()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._reader_of[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._reader_of)

    def __len__(self) -> int:
        return len(self._reader_of)


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

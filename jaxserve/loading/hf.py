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
    """Maps HF names (`model.layers.0.self_attn.q_proj.weight`, ...) to our checkpoint-layout tree in `dtype`.

    HF linear weights are `[out, in]`; our kernels are `[in, out]`. Each source tensor is converted to `dtype` as it
    is copied into its place, so the only arrays allocated are the params themselves.
    """
    dtype = np.dtype(dtype)

    def get(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return state[name]

    def vector(name: str) -> np.ndarray:
        return np.asarray(get(name), dtype=dtype)

    def dense(name: str, bias: bool = False) -> dict:
        kernel = {"kernel": np.ascontiguousarray(get(name + ".weight").T, dtype=dtype)}
        return kernel | ({"bias": vector(name + ".bias")} if bias else {})

    params: dict = {"embed": {"embedding": np.array(get("model.embed_tokens.weight"), dtype=dtype)}}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn_prefix = prefix + "self_attn."
        attn = {f"{p}_proj": dense(attn_prefix + f"{p}_proj", config.qkv_bias) for p in "qkv"}
        attn["o_proj"] = dense(attn_prefix + "o_proj")
        if config.qk_norm:
            attn["q_norm"] = {"scale": vector(attn_prefix + "q_norm.weight")}
            attn["k_norm"] = {"scale": vector(attn_prefix + "k_norm.weight")}
        params[f"layers_{layer}"] = {
            "input_norm": {"scale": vector(prefix + "input_layernorm.weight")},
            "attn": attn,
            "post_attention_norm": {"scale": vector(prefix + "post_attention_layernorm.weight")},
            "mlp": {name: dense(prefix + f"mlp.{name}") for name in ("gate_proj", "up_proj", "down_proj")},
        }
    params["final_norm"] = {"scale": vector("model.norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = dense("lm_head")
    return params


def load_hf_checkpoint(path: str, dtype: DTypeLike = np.float32) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params in dtype)` from a HF checkpoint directory (config.json + safetensors)."""
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    return config, convert_hf_state_dict(read_safetensors_dir(path), config, dtype)

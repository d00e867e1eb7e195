"""Hugging Face checkpoints: a state dict with HF's parameter names -> our fused parameter tree; safetensors reading."""

from __future__ import annotations

import glob
import os
from typing import Mapping

import numpy as np

from jaxserve.config import ModelConfig


def read_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    """Every tensor of every `*.safetensors` file in `path` (sharded or not), as numpy arrays."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(file, framework="flax") as reader:  # "flax" handles bfloat16, which numpy lacks
            for name in reader.keys():
                tensors[name] = np.asarray(reader.get_tensor(name))
    return tensors


def convert_hf_state_dict(state: Mapping[str, np.ndarray], config: ModelConfig, dtype=np.float32) -> dict:
    """Maps HF names (`model.layers.0.self_attn.q_proj.weight`, ...) to our tree, fusing qkv and gate/up.

    HF linear weights are `[out, in]`; our kernels are `[in, out]`.
    """

    def get(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return np.asarray(state[name], dtype=np.float32)

    def dense(*names: str) -> np.ndarray:
        return np.concatenate([get(n).T for n in names], axis=1).astype(dtype)

    params: dict = {"embed": {"embedding": get("model.embed_tokens.weight").astype(dtype)}}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn_prefix = prefix + "self_attn."
        qkv = {"kernel": dense(*(attn_prefix + f"{p}_proj.weight" for p in "qkv"))}
        if config.qkv_bias:
            qkv["bias"] = np.concatenate([get(attn_prefix + f"{p}_proj.bias") for p in "qkv"]).astype(dtype)
        attn = {"qkv_proj": qkv, "o_proj": {"kernel": dense(attn_prefix + "o_proj.weight")}}
        if config.qk_norm:
            attn["q_norm"] = {"scale": get(attn_prefix + "q_norm.weight").astype(dtype)}
            attn["k_norm"] = {"scale": get(attn_prefix + "k_norm.weight").astype(dtype)}
        params[f"layers_{layer}"] = {
            "input_norm": {"scale": get(prefix + "input_layernorm.weight").astype(dtype)},
            "attn": attn,
            "post_attention_norm": {"scale": get(prefix + "post_attention_layernorm.weight").astype(dtype)},
            "mlp": {
                "gate_up_proj": {"kernel": dense(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight")},
                "down_proj": {"kernel": dense(prefix + "mlp.down_proj.weight")},
            },
        }
    params["final_norm"] = {"scale": get("model.norm.weight").astype(dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": dense("lm_head.weight")}
    return params


def load_hf_dir(path: str, dtype=np.float32):
    """`(ModelConfig, params, tokenizer)` from a HF checkpoint directory (config.json + safetensors + tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(path)
    config = ModelConfig.from_hf(hf_config)
    params = convert_hf_state_dict(read_safetensors_dir(path), config, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    return config, params, tokenizer


def _has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))

"""Mixtral: the Mistral decoder (`llama`, sliding window when the config has one) with a mixture of experts in
every layer: the top-k (2) of `num_local_experts` (8) by router probability, renormalized over the chosen ones.
Its checkpoints name the experts' linears `w1` (gate), `w3` (up) and `w2` (down) under `block_sparse_moe`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxserve.config import ModelConfig, MoEConfig
from jaxserve.models import llama
from jaxserve.models import llama_weights as weights

MODEL_TYPES = ("mixtral",)
MOE_NAMES = weights.MoENames(block="block_sparse_moe", router="gate",
                             linears=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")))


def parse_config(hf_config: Any) -> ModelConfig:
    moe = MoEConfig(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                    intermediate_size=hf_config.intermediate_size, normalize_top_k=True)
    return llama.decoder_config(hf_config, qkv_bias=bool(getattr(hf_config, "attention_bias", False)), qk_norm=False,
                                moe=moe, sparse_layers=(True,) * hf_config.num_hidden_layers)


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config,
                           checkpoint_source=functools.partial(weights.checkpoint_source, moe_names=MOE_NAMES))

"""MiniMax-M2 (`minimax_m2`): the Llama decoder with q and k norms over all heads' dims at once, partial rotary
(`rotary_dim`), and a mixture of experts in every layer routed as DeepSeek-V3 routes without groups (sigmoid
scores, a score-correction bias for choosing, the chosen weights renormalized). Its checkpoints name the experts
as Mixtral's (`block_sparse_moe`, `w1`/`w3`/`w2`) and keep the correction bias beside them."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxserve.config import ModelConfig, MoEConfig
from jaxserve.models import llama
from jaxserve.models import llama_weights as weights

MODEL_TYPES = ("minimax_m2",)
MOE_NAMES = weights.MoENames(block="block_sparse_moe", router="gate",
                             linears=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")),
                             correction_bias="e_score_correction_bias")


def parse_config(hf_config: Any) -> ModelConfig:
    moe = MoEConfig(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                    intermediate_size=hf_config.intermediate_size, normalize_top_k=True, scoring="sigmoid",
                    score_correction_bias=True)
    config = llama.decoder_config(hf_config, qkv_bias=False, qk_norm=True, moe=moe,
                                  sparse_layers=(True,) * hf_config.num_hidden_layers)
    return dataclasses.replace(config, qk_norm_all_heads=True)


SPEC = dataclasses.replace(llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config,
                           checkpoint_source=functools.partial(weights.checkpoint_source, moe_names=MOE_NAMES))

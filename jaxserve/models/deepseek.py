"""DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3/V3.1/R1, Kimi K2 and Mistral Large 3 use its config) and DeepSeek-V2
(`deepseek_v2`): the Llama decoder with Multi-head Latent Attention (`layers/mla.py`) over a latent KV cache, and
DeepSeek's mixture of experts after the first `first_k_dense_replace` dense layers, with `n_shared_experts` ungated
shared experts (`deepseek_moe`: V3's sigmoid scores, correction bias and expert groups; V2's softmax).

Checkpoint layout: transformers' names (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj` without query
compression, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; experts as the other MoE families');
serving layout: the MLP's gate and up fused as Llama's, the attention's linears as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from numpy.typing import DTypeLike

from jaxserve.config import MLAConfig, ModelConfig, MoEConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.rotary import yarn_softmax_scale
from jaxserve.models import llama
from jaxserve.models import llama_weights as weights
from jaxserve.models.spec import TensorSource

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
MOE_NAMES = weights.MoENames(shared_expert="shared_experts")


def deepseek_moe(hf_config: Any) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """DeepSeek's mixture of experts as its config (and GLM-4.5's, which copies V3's) spells it, and which layers
    have it: every layer from `first_k_dense_replace` on. V3: sigmoid scores with the correction bias, groups
    scored by their two best; V2: softmax scores never renormalized, `topk_method` "greedy" (no groups) or
    "group_limited_greedy" (groups scored by their best)."""
    experts = hf_config.n_routed_experts or 0
    frequency = getattr(hf_config, "moe_layer_freq", 1)
    if frequency != 1:  # DeepSeek's own code skips layers by it; transformers ignores it: no reference to match
        raise ValueError(f"moe_layer_freq {frequency!r} is not supported for {hf_config.model_type} (every published "
                         "checkpoint has 1: every layer from first_k_dense_replace on is a mixture of experts)")
    sparse = tuple(experts > 0 and index >= hf_config.first_k_dense_replace
                   for index in range(hf_config.num_hidden_layers))
    if not any(sparse):
        return None, sparse
    common = dict(num_experts=experts, top_k=hf_config.num_experts_per_tok,
                  intermediate_size=hf_config.moe_intermediate_size,
                  shared_expert_size=(hf_config.n_shared_experts or 0) * hf_config.moe_intermediate_size,
                  routed_scaling=float(hf_config.routed_scaling_factor), shared_expert_gate=False)
    if hf_config.model_type != "deepseek_v2":  # config.json's own names for V3's routing, where it states them
        for field, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if getattr(hf_config, field, value) != value:
                raise ValueError(f"{field} {getattr(hf_config, field)!r} is not supported for "
                                 f"{hf_config.model_type} (jaxserve routes as DeepSeek-V3: {field} {value!r})")
        return MoEConfig(**common, normalize_top_k=bool(hf_config.norm_topk_prob), scoring="sigmoid",
                         score_correction_bias=True, num_groups=hf_config.n_group or 1,
                         top_k_groups=hf_config.topk_group or 1), sparse
    method = getattr(hf_config, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method {method!r} is not supported for deepseek_v2 (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    return MoEConfig(**common, normalize_top_k=False, num_groups=hf_config.n_group if grouped else 1,
                     top_k_groups=hf_config.topk_group if grouped else 1, group_by_max=True), sparse


def parse_config(hf_config: Any) -> ModelConfig:
    """The `ModelConfig` of a `deepseek_v3` config; ValueError naming what jaxserve cannot compute."""
    moe, sparse = deepseek_moe(hf_config)
    config = llama.decoder_config(hf_config, qkv_bias=bool(hf_config.attention_bias),
                                  o_bias=bool(hf_config.attention_bias), qk_norm=False, moe=moe, sparse_layers=sparse)
    nope, rope = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
    mla = MLAConfig(kv_lora_rank=hf_config.kv_lora_rank, q_lora_rank=hf_config.q_lora_rank, qk_nope_head_dim=nope,
                    qk_rope_head_dim=rope, v_head_dim=hf_config.v_head_dim,
                    softmax_scale=(nope + rope) ** -0.5 * yarn_softmax_scale(config.rope_scaling),
                    rope_interleave=getattr(hf_config, "rope_interleave", None) is not False)  # V2: always
    # the pool's one "head" is the latent row; query heads attend over it as multi-query attention
    return dataclasses.replace(config, num_kv_heads=1, head_dim=mla.cache_dim, mla=mla)


def checkpoint_shapes(config: ModelConfig, dtype: DTypeLike = jnp.float32) -> dict:
    """Llama's checkpoint tree with each layer's attention the MLA's linears and norms."""
    params = weights.checkpoint_shapes(config, dtype)
    mla, heads, bias = config.mla, config.num_q_heads, config.qkv_bias

    def dense(fan_in: int, fan_out: int, has_bias: bool = False) -> dict:
        leaf = {"kernel": jax.ShapeDtypeStruct((fan_in, fan_out), dtype)}
        return leaf | ({"bias": jax.ShapeDtypeStruct((fan_out,), dtype)} if has_bias else {})

    qk = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    if mla.q_lora_rank is None:
        query = {"q_proj": dense(config.hidden_size, qk)}
    else:
        query = {"q_a_proj": dense(config.hidden_size, mla.q_lora_rank, bias),
                 "q_a_layernorm": {"scale": jax.ShapeDtypeStruct((mla.q_lora_rank,), dtype)},
                 "q_b_proj": dense(mla.q_lora_rank, qk)}
    attn = {**query, "kv_a_proj_with_mqa": dense(config.hidden_size, mla.cache_dim, bias),
            "kv_a_layernorm": {"scale": jax.ShapeDtypeStruct((mla.kv_lora_rank,), dtype)},
            "kv_b_proj": dense(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
            "o_proj": dense(heads * mla.v_head_dim, config.hidden_size, config.o_bias)}
    for index in range(config.num_layers):
        params[f"layers_{index}"]["attn"] = attn
    return params


def checkpoint_source(path: str, config: ModelConfig) -> TensorSource:
    return weights.checkpoint_source(path, config, MOE_NAMES)


def fuse_layer(layer: dict, config: ModelConfig, tp: TensorParallel) -> dict:
    """The MLP's gate and up fused (the dense MLP's, the experts', the shared experts'); the attention as it is."""
    return {**layer, "mlp": weights.fuse_mlp(dict(layer["mlp"]), tp)}


# Tensor parallelism splits the heads: the per-head projections on their output features (whole heads per
# device), o_proj on its input features; the latent and the query latent (`q_a_proj`) are computed whole on every
# device, and every device keeps the whole latent cache (it has no heads to split).
SHARDING_RULES: tuple[tuple[str, str], ...] = (
    (r"attn/(q_proj|q_b_proj|kv_b_proj)/kernel$", "columns"),
    (r"attn/(q_proj|q_b_proj|kv_b_proj)/scale$", "vector"),
    (r"attn/(q_a_proj|kv_a_proj_with_mqa)/", "replicated"),
    (r"attn/(q_a|kv_a)_layernorm/", "replicated"),
    *weights.SHARDING_RULES,
)

SPEC = dataclasses.replace(
    llama.SPEC, model_types=MODEL_TYPES, parse_config=parse_config, checkpoint_shapes=checkpoint_shapes,
    checkpoint_source=checkpoint_source, fuse_layer=fuse_layer, sharding_rules=SHARDING_RULES,
    quantizable_linears=(), lora_targets=())

"""The Llama family's parameters: their checkpoint layout, the Hugging Face tensor each is read from, how a layer
fuses into the serving layout, and where each lives on the device mesh.

Checkpoint layout (what loaders produce): q/k/v and gate/up projections apart, as in Hugging Face checkpoints; a
mixture-of-experts layer's `mlp` holds `router`, `experts` (each linear's kernels of every expert stacked,
`[E, in, out]`) and, when the model has one, `shared_expert` and `shared_expert_gate`.
Serving layout (what `llama.LlamaModel` reads): q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj` (the
experts' and the shared expert's too), each device's columns together. Fusing halves the number of matmuls per
layer, which matters at small batch where each launch is bandwidth-bound. The sharding rules are Megatron-style: q/k/v, gate and up split on their output
features, o and down on their input features (XLA inserts the all-reduce after them); the embedding and LM head on
the vocabulary; int8 scales and AWQ zeros/scales like their kernel's features; norms replicated. Experts split
inside each expert like the dense MLP (vLLM's default without expert parallelism); the router is replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers import moe
from jaxserve.models.spec import TensorSource

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the decoder's linears
GLOBAL_TENSORS = {"embed/embedding": "model.embed_tokens.weight", "final_norm/scale": "model.norm.weight",
                  "lm_head/kernel": "lm_head.weight"}
LAYER_MODULES = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "pre_feedforward_norm": "pre_feedforward_layernorm",
                 "post_feedforward_norm": "post_feedforward_layernorm", "attn": "self_attn", "mlp": "mlp"}
# (pattern on "group/module/leaf", `shardings.SPEC_KINDS` name); the first match wins. Both layouts: the checkpoint's
# q/k/v, gate/up and the serving layout's fused qkv_proj, gate_up_proj. int8 scales are per output channel (split
# with the kernel's output features, replicated where it splits on its input features); AWQ layers' per-group
# zeros and scales ([in / group, out]) split exactly like their kernel (whole groups per device, `loading/awq.py`).
# The LoRA stack (`lora/weights.py`, under "lora/"): `a` and `b` split as their base linear splits, so the
# column-parallel ones' low-rank activations are whole on every device and the row-parallel ones' are partial sums.
LORA_SHARDING_RULES: tuple[tuple[str, str], ...] = (
    (r"^lora/.*/(qkv_proj|gate_up_proj)/a$", "replicated"),
    (r"^lora/.*/(qkv_proj|gate_up_proj)/b$", "lora_columns"),
    (r"^lora/.*/(o_proj|down_proj)/a$", "lora_rows"),
    (r"^lora/.*/(o_proj|down_proj)/b$", "replicated"),
)
SHARDING_RULES: tuple[tuple[str, str], ...] = (
    *LORA_SHARDING_RULES,
    *moe.SHARDING_RULES,
    (r"embed/embedding", "vocab_rows"),
    (r"embed/scale", "vocab_vector"),
    (r"lm_head/kernel", "vocab_columns"),
    (r"lm_head/scale", "vocab_vector"),
    (r"attn/(qkv|q)_proj/(kernel|zeros|scales)$", "columns"),
    (r"attn/(qkv|q)_proj/(bias|scale)", "vector"),
    (r"attn/[kv]_proj/(kernel|zeros|scales)$", "kv_columns"),
    (r"attn/[kv]_proj/(bias|scale)", "kv_vector"),
    (r"attn/o_proj/(kernel|zeros|scales)$", "rows"),
    (r"attn/o_proj/(scale|bias)", "replicated"),
    (r"attn/sinks$", "vector"),  # one per query head, split like the heads
    (r"(mlp|shared_expert)/(gate_up|gate|up)_proj/(kernel|zeros|scales)$", "columns"),
    (r"(mlp|shared_expert)/(gate_up|gate|up)_proj/scale", "vector"),
    (r"(mlp|shared_expert)/down_proj/(kernel|zeros|scales)$", "rows"),
    (r"(mlp|shared_expert)/down_proj/scale", "replicated"),
    (r"(norm|_norm)/scale", "replicated"),
)


@dataclasses.dataclass(frozen=True)
class MoENames:
    """How a family's checkpoint names a mixture-of-experts layer's tensors:
    `model.layers.{i}.{block}.{router}.weight` and `model.layers.{i}.{block}.experts.{e}.{linear}.weight`."""

    block: str = "mlp"
    router: str = "gate"
    linears: tuple[tuple[str, str], ...] = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                                            ("down_proj", "down_proj"))  # ours -> the checkpoint's
    shared_expert: str = "shared_expert"
    correction_bias: str = "gate.e_score_correction_bias"  # `score_correction_bias`'s tensor, after the block


def checkpoint_source(path: str, config: ModelConfig, moe_names: MoENames = MoENames()) -> TensorSource:
    """The HF tensor(s) of our checkpoint-layout parameter at `path` ("layers_0/attn/q_proj/kernel", ...): an
    expert linear is the stack of every expert's tensor.

    Kernels are transposed (HF `[out, in]`); the embedding, norms and biases are not.
    """
    if path in GLOBAL_TENSORS:
        return TensorSource((GLOBAL_TENSORS[path],), path.endswith("/kernel"))
    group, module, *inner = path.split("/")
    if not group.startswith("layers_") or module not in LAYER_MODULES or not inner:
        raise KeyError(f"no Hugging Face tensor for parameter {path!r}")
    *inner, leaf = inner
    index = group.removeprefix("layers_")
    hf_module = LAYER_MODULES[module]
    if module == "mlp" and config.layers[int(index)].feed_forward == "moe":
        hf_module = moe_names.block
        if inner == ["router"]:
            inner = [moe_names.router]
        elif not inner and leaf == "score_correction_bias":
            return TensorSource((f"model.layers.{index}.{hf_module}.{moe_names.correction_bias}",))
        elif inner[:1] == ["shared_expert"]:
            inner = [moe_names.shared_expert, *inner[1:]]
        elif inner[:1] == ["experts"]:
            linear = dict(moe_names.linears)[inner[1]]
            return TensorSource(tuple(f"model.layers.{index}.{hf_module}.experts.{expert}.{linear}.weight"
                                      for expert in range(config.moe.num_experts)), True)
    name = ".".join(["model.layers", index, hf_module, *inner, leaf if leaf in ("bias", "sinks") else "weight"])
    return TensorSource((name,), leaf == "kernel")


def dummy_fan_in(path: str, shape: tuple[int, ...]) -> int:
    """A dummy weight's fan-in: the embedding's hidden size, a kernel's input features (`[in, out]`, or
    `[experts, in, out]`)."""
    return shape[1] if path.endswith("embedding") else shape[-2]


def checkpoint_shapes(config: ModelConfig, dtype: DTypeLike = jnp.float32) -> dict:
    """The checkpoint-layout parameter tree (as ShapeDtypeStructs) that loaders produce for `config`."""
    cfg = config

    def dense(fan_in: int, fan_out: int, bias: bool = False) -> dict:
        leaf = {"kernel": jax.ShapeDtypeStruct((fan_in, fan_out), dtype)}
        return leaf | ({"bias": jax.ShapeDtypeStruct((fan_out,), dtype)} if bias else {})

    def norm(width: int) -> dict:
        return {"scale": jax.ShapeDtypeStruct((width,), dtype)}

    def swiglu(width: int) -> dict:
        return {"gate_proj": dense(cfg.hidden_size, width), "up_proj": dense(cfg.hidden_size, width),
                "down_proj": dense(width, cfg.hidden_size)}

    def experts() -> dict:
        moe = cfg.moe

        def stacked(fan_in: int, fan_out: int) -> dict:
            leaf = {"kernel": jax.ShapeDtypeStruct((moe.num_experts, fan_in, fan_out), dtype)}
            return leaf | ({"bias": jax.ShapeDtypeStruct((moe.num_experts, fan_out), dtype)} if moe.expert_bias
                           else {})

        group = {"router": dense(cfg.hidden_size, moe.num_experts, moe.router_bias),
                 "experts": {"gate_proj": stacked(cfg.hidden_size, moe.intermediate_size),
                             "up_proj": stacked(cfg.hidden_size, moe.intermediate_size),
                             "down_proj": stacked(moe.intermediate_size, cfg.hidden_size)}}
        if moe.shared_expert_size:
            group["shared_expert"] = swiglu(moe.shared_expert_size)
        if moe.shared_expert_size and moe.shared_expert_gate:
            group["shared_expert_gate"] = dense(cfg.hidden_size, 1)
        if moe.score_correction_bias:
            group["score_correction_bias"] = jax.ShapeDtypeStruct((moe.num_experts,), jnp.float32)
        return group

    def layer(spec) -> dict:
        own = cfg.for_layer(spec)  # its head size, KV heads and MLP width
        q_width = own.q_size * (2 if cfg.attention_output_gate else 1)  # each head's query, then its gate
        attn = {"q_proj": dense(cfg.hidden_size, q_width, cfg.qkv_bias),
                "o_proj": dense(own.q_size, cfg.hidden_size, cfg.o_bias)}
        if spec.kv_source is None:  # a layer reading another's KV has no k/v projections (nor k norm)
            attn["k_proj"] = dense(cfg.hidden_size, own.kv_size, cfg.qkv_bias)
            if not spec.values_from_keys:
                attn["v_proj"] = dense(cfg.hidden_size, own.kv_size, cfg.qkv_bias)
        if cfg.attention_sinks:
            attn["sinks"] = jax.ShapeDtypeStruct((cfg.num_q_heads,), dtype)
        if cfg.qk_norm:
            attn |= ({"q_norm": norm(own.q_size), "k_norm": norm(own.kv_size)} if cfg.qk_norm_all_heads
                     else {"q_norm": norm(own.head_dim), "k_norm": norm(own.head_dim)})
            if spec.kv_source is not None:
                del attn["k_norm"]
        mlp = experts() if spec.feed_forward == "moe" else swiglu(own.intermediate_size)
        group = {"input_norm": norm(cfg.hidden_size), "attn": attn, "post_attention_norm": norm(cfg.hidden_size),
                 "mlp": mlp}
        if cfg.sandwich_norms:
            group |= {"pre_feedforward_norm": norm(cfg.hidden_size), "post_feedforward_norm": norm(cfg.hidden_size)}
        if spec.feed_forward == "dense_and_moe":  # the experts beside the dense MLP (Gemma 4's block)
            group["moe"] = experts()
        return group

    params = {"embed": {"embedding": jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), dtype)}}
    params |= {f"layers_{i}": layer(spec) for i, spec in enumerate(cfg.layers)}
    params["final_norm"] = norm(cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dense(cfg.hidden_size, cfg.vocab_size)
    return params


def fuse_layer(layer: dict, config: ModelConfig, tp: TensorParallel) -> dict:
    """One decoder layer's checkpoint-layout params -> serving layout: q/k/v (and an output gate: `[q_d | k_d |
    v_d | gate_d]`) into `qkv_proj` and gate/up into `gate_up_proj` (the dense MLP's, the experts' and the shared
    expert's), each device's columns together (all their leaves: an AWQ layer's zeros and scales too). A layer
    without v (values from keys) or without k and v (reading another layer's KV) fuses what it has. `config` is
    the layer's view (`ModelConfig.for_layer`: its head size and KV heads). Jit it with the serving shardings as
    `out_shardings` and every device builds its own columns from its own shards (k/v replicated when the KV heads
    are)."""
    cfg, n = config, tp.size
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    sources = jnp.asarray(tp.pool_head_sources(cfg))
    present = [name for name in ("q_proj", "k_proj", "v_proj") if name in attn]

    def per_device(array, heads: int, kv: bool):  # [..., heads * head_dim] -> [..., n, per-device columns]
        lead = array.shape[:-1]
        array = array.reshape(*lead, heads, cfg.head_dim)
        if kv:
            array = jnp.take(array, sources, axis=-2)  # the pool's heads: each KV head where its queries are
        return array.reshape(*lead, n, -1)

    def fused(leaf: str) -> jax.Array:
        q, *kv = (attn[name][leaf] for name in present)
        gate = None
        if cfg.attention_output_gate:  # q_proj's columns: each head's query, then its gate
            pairs = q.reshape(*q.shape[:-1], cfg.num_q_heads, 2, cfg.head_dim)
            q, gate = (pairs[..., i, :].reshape(*q.shape[:-1], cfg.q_size) for i in range(2))
        parts = [per_device(q, cfg.num_q_heads, False), *(per_device(x, cfg.num_kv_heads, True) for x in kv)]
        if gate is not None:
            parts.append(per_device(gate, cfg.num_q_heads, False))
        return jnp.concatenate(parts, axis=-1).reshape(*q.shape[:-1], -1)

    # every leaf along the output features: kernel, bias, and an AWQ layer's per-group zeros and scales
    qkv = {leaf: fused(leaf) for leaf in attn["q_proj"]}
    for name in present:
        del attn[name]
    fused_layer = {**layer, "attn": {"qkv_proj": qkv, **attn}, "mlp": fuse_mlp(mlp, tp)}
    if "moe" in layer:
        fused_layer["moe"] = fuse_mlp(dict(layer["moe"]), tp)
    return fused_layer


def fuse_mlp(mlp: dict, tp: TensorParallel) -> dict:
    """A layer's dense MLP, or its experts and shared expert, with gate and up fused (`fuse_gate_up`)."""
    if "experts" not in mlp:
        return fuse_gate_up(mlp, tp.size)
    mlp = {**mlp, "experts": fuse_gate_up(mlp["experts"], tp.expert_column_shards)}
    if "shared_expert" in mlp:
        mlp["shared_expert"] = fuse_gate_up(mlp["shared_expert"], tp.size)
    return mlp


def fuse_gate_up(mlp: dict, shards: int) -> dict:
    """A SwiGLU's (or every expert's) `gate_proj` and `up_proj` -> `gate_up_proj`, `[gate_d | up_d]` for each of
    `shards` devices along the output features (all leaves: kernel, an int8 or AWQ layer's zeros and scales)."""
    mlp = dict(mlp)
    gate, up = (mlp.pop(name) for name in ("gate_proj", "up_proj"))

    def fused(g: jax.Array, u: jax.Array) -> jax.Array:
        lead = g.shape[:-1]
        return jnp.concatenate([g.reshape(*lead, shards, -1), u.reshape(*lead, shards, -1)], axis=-1).reshape(*lead, -1)

    return {"gate_up_proj": {leaf: fused(gate[leaf], up[leaf]) for leaf in gate}, **mlp}

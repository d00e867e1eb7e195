"""Model configuration: the numbers a decoder's forward pass needs, model-wide (`ModelConfig`) and per layer
(`LayerSpec`). Each model family reads them from a Hugging Face config (`jaxserve.models.registry`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's activation of each SwiGLU / GeGLU feed-forward
# per layer: a dense MLP, the model's mixture of experts (`MoEConfig`), or both side by side (Gemma 4)
FEED_FORWARDS = ("dense", "moe", "dense_and_moe")
MIXERS = ("attention", "gated_deltanet")  # per layer: attention over the KV pages, or linear attention over a
# per-sequence state (`LinearAttentionConfig`)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """How one decoder layer attends and feeds forward. `head_dim`, `num_kv_heads` and `intermediate_size` set:
    this layer's own, in place of the model's (Gemma 4's global layers and doubled MLPs; `ModelConfig.for_layer`).
    `kv_source` set: the layer computes queries only and attends over that earlier layer's KV (vLLM's KV sharing),
    keeping no pages of its own. `values_from_keys`: the values are the key projection's output (one projection
    for both, Gemma 4's `attention_k_eq_v`)."""

    sliding_window: int | None = None  # None: global attention; else each query sees this many positions
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable copy of HF's rope parameters
    feed_forward: str = "dense"
    rotary_dim: int | None = None  # the rope turns each head's first rotary_dim dims (partial rotary); None: all
    mixer: str = "attention"
    head_dim: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    kv_source: int | None = None
    values_from_keys: bool = False

    def __post_init__(self) -> None:
        if self.feed_forward not in FEED_FORWARDS:
            raise ValueError(f"feed_forward must be one of {FEED_FORWARDS}, got {self.feed_forward!r}")
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}, got {self.mixer!r}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def has_experts(self) -> bool:
        return self.feed_forward in ("moe", "dense_and_moe")

    @property
    def has_dense(self) -> bool:
        return self.feed_forward in ("dense", "dense_and_moe")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A model's mixture-of-experts feed-forward (every layer whose `LayerSpec.feed_forward` is "moe"): each token
    goes to the `top_k` experts of highest router probability (softmax over all experts, in float32), their
    outputs summed with those probabilities as weights (renormalized over the chosen `top_k` when
    `normalize_top_k`). `shared_expert_size` > 0: a dense SwiGLU of that width every token also goes through,
    its output scaled by a sigmoid gate (Qwen2-MoE). gpt-oss: the router and every expert linear have biases
    (`router_bias`, `expert_bias`), and with `swiglu_limit` set each expert computes its clamped SwiGLU,
    `(clip(up, -limit, limit) + 1) * g * sigmoid(swiglu_alpha * g)` with `g = min(gate, limit)`.

    DeepSeek-V3's routing (GLM-4.5, MiniMax-M2 too): `scoring` "sigmoid" scores each expert on its own; with
    `score_correction_bias` a learned per-expert bias is added to the scores for choosing only (the weights are the
    scores); with `num_groups` > 1 the experts are in that many groups, each scored by its two best, and only the
    `top_k_groups` best groups are chosen from (DeepSeek-V2's groups, `group_by_max`: each by its best). The weights
    are multiplied by `routed_scaling`. DeepSeek's shared experts have no gate (`shared_expert_gate` False)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's SwiGLU width
    normalize_top_k: bool
    shared_expert_size: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    scoring: str = "softmax"  # or "sigmoid"
    score_correction_bias: bool = False
    num_groups: int = 1
    top_k_groups: int = 1
    routed_scaling: float = 1.0
    shared_expert_gate: bool = True
    group_by_max: bool = False
    activation: str = "silu"  # each expert's gate activation (`ACTIVATIONS`; Gemma 4: "gelu_tanh")

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and the number of experts ({self.num_experts}), "
                             f"got {self.top_k}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"the router's scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        groups = self.num_groups
        if groups < 1 or self.num_experts % groups or (groups > 1 and self.num_experts // groups < 2):
            raise ValueError(f"n_group ({groups}) must divide the {self.num_experts} experts into groups of 2 or more")
        if not 1 <= self.top_k_groups <= groups or self.top_k > self.top_k_groups * self.num_experts // groups:
            raise ValueError(f"topk_group ({self.top_k_groups}) must be between 1 and n_group ({groups}) and leave "
                             f"num_experts_per_tok ({self.top_k}) experts to choose from")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3): queries from `q_lora_rank` (None: one projection), keys and
    values from one compressed latent of `kv_lora_rank` per token, each head's query and key `qk_nope_head_dim`
    dims without rope and `qk_rope_head_dim` with it (one rope key per token, shared by the heads), values of
    `v_head_dim`. The cache keeps the latent and the rope key (`cache_dim` values per token and layer).
    `rope_interleave`: the rope dims come in interleaved pairs (DeepSeek-V3's checkpoints). `softmax_scale`:
    (qk_nope + qk_rope) ** -0.5 times YaRN's mscale(mscale_all_dim) squared."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool = True

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5; `layers/gated_deltanet.py`): `key_heads`
    query/key heads of `key_dim`, `value_heads` value heads of `value_dim` (a multiple of the key heads: each key
    head serves consecutive value heads), a causal depthwise convolution of `conv_kernel` over the q, k and v
    channels. Each sequence keeps the convolution's last `conv_kernel - 1` inputs and a float32 matrix
    `[value_heads, key_dim, value_dim]` per layer, whatever its length."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ValueError(f"linear_num_value_heads ({self.value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.key_heads})")

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model: `model_type` names its family in the registry; `layers` holds one
    `LayerSpec` per layer. `rope_theta` and `rope_scaling` are the config's model-wide rope (what a layer without
    its own uses)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable copy of HF's rope parameters
    qkv_bias: bool = False
    o_bias: bool = False  # the attention's output projection has a bias (HF's attention_bias in most families)
    qk_norm: bool = False
    qk_norm_all_heads: bool = False  # the q and k norms span every head's dims at once (MiniMax-M2), not each head
    tie_word_embeddings: bool = False
    layers: tuple[LayerSpec, ...] = ()
    attn_logit_softcap: float | None = None  # logits capped as cap * tanh(x / cap) (Gemma 2); None: uncapped
    attention_sinks: bool = False  # a learned logit per query head in each softmax, with no value (gpt-oss)
    moe: MoEConfig | None = None  # the experts of the layers whose feed_forward is "moe"
    mla: MLAConfig | None = None  # every layer's attention is MLA over a latent cache (num_kv_heads 1)
    linear_attention: LinearAttentionConfig | None = None  # the layers whose mixer is "gated_deltanet"
    attention_output_gate: bool = False  # q_proj also gives a per-head gate: out * sigmoid(gate) (Qwen3-Next)
    # Gemma's decoder: scores scaled by attention_scale (None: head_dim ** -0.5), RMSNorm scales of 1 + w
    # (norm_offset 1), the gate's activation, the embedding times embedding_scale, norms after attention and
    # after the feed-forward too (sandwich_norms), final logits capped as cap * tanh(x / cap)
    attention_scale: float | None = None
    norm_offset: float = 0.0
    activation: str = "silu"
    embedding_scale: float | None = None
    sandwich_norms: bool = False
    final_logit_softcap: float | None = None
    # Gemma 4: every norm's scale applied in float32 before the cast (without Gemma's offset); values normed by a
    # scale-free RMS norm (`value_norm`); each layer given its own small input (`per_layer_input_size` wide, from a
    # second embedding table of `per_layer_vocab_size` ids and a projection of the embeddings), gated into the
    # residual stream after the layer
    norm_scale_float32: bool = False
    value_norm: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # M-RoPE (the Qwen-VL models): each rope frequency turns by one of three position axes (temporal, height, width;
    # `layers/rotary.frequency_axes`), `mrope_section` frequencies per axis in order, or interleaved T, H, W, ...
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # Qwen3-VL's deepstack: an image's features from this many vision blocks, each added to the image tokens' hidden
    # states after the decoder layer of its index (they come beside the embeddings: `mm_embeds [..., (1 + n) * H]`)
    deepstack_layers: int = 0
    bidirectional_images: bool = False  # Gemma 3: an image's tokens attend to each other both ways

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"ModelConfig has {self.num_layers} layers but {len(self.layers)} LayerSpecs")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if (self.moe is None) != all(not layer.has_experts for layer in self.layers):
            raise ValueError("a ModelConfig has a MoEConfig exactly when some layer's feed_forward has experts")
        for index, layer in enumerate(self.layers):
            source = layer.kv_source
            if source is not None and not (0 <= source < index and self.layers[source].kv_source is None
                                           and self.layers[source].mixer == "attention"):
                raise ValueError(f"layer {index}'s kv_source must be an earlier attention layer with its own KV, got "
                                 f"{source}")
        if (self.linear_attention is None) != all(layer.mixer == "attention" for layer in self.layers):
            raise ValueError("a ModelConfig has a LinearAttentionConfig exactly when some layer's mixer is "
                             "'gated_deltanet'")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that keep a per-sequence state instead of KV pages."""
        return tuple(index for index, layer in enumerate(self.layers) if layer.mixer != "attention")

    @property
    def rope_length_rule(self) -> tuple[str, int] | None:
        """`(rule, threshold)` when some layer's rope (LongRoPE, dynamic NTK) rotates tokens by a length past
        `threshold` rather than by their positions alone (`layers/rotary.LENGTH_RULES`); None otherwise."""
        from jaxserve.layers.rotary import LENGTH_RULES, rope_length_threshold

        rules = {(LENGTH_RULES[layer.rope_scaling_dict["rope_type"]], rope_length_threshold(layer.rope_scaling_dict))
                 for layer in self.layers if rope_length_threshold(layer.rope_scaling_dict) is not None}
        if len(rules) > 1:
            raise ValueError(f"layers whose ropes change with the length differently are not supported: {rules}")
        return next(iter(rules), None)

    @property
    def has_dense_layers(self) -> bool:
        return any(layer.has_dense for layer in self.layers)

    @property
    def uniform_attention(self) -> bool:
        """Whether every attention layer has the model's head size and KV heads (else `for_layer` differs)."""
        return all(layer.head_dim in (None, self.head_dim) and layer.num_kv_heads in (None, self.num_kv_heads)
                   for layer in self.layers)

    def for_layer(self, layer: LayerSpec) -> "ModelConfig":
        """This config as `layer` sees it: its own head size, KV heads and MLP width where it has them."""
        own = {name: getattr(layer, name) for name in ("head_dim", "num_kv_heads", "intermediate_size")
               if getattr(layer, name) is not None and getattr(layer, name) != getattr(self, name)}
        return dataclasses.replace(self, **own) if own else self

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return tuple(layer.sliding_window for layer in self.layers)

    def with_eos_token_ids(self, extra: Iterable[int]) -> "ModelConfig":
        """This config with the `extra` EOS ids (e.g. generation_config.json's) added after its own, each id once."""
        return dataclasses.replace(self, eos_token_ids=tuple(dict.fromkeys((*self.eos_token_ids, *extra))))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        """The config `to_json` wrote; also a store's config from before per-layer specs (`layer_sliding_windows`)."""
        raw = json.loads(text)
        raw["rope_scaling"] = rope_tuple(raw.get("rope_scaling"))
        if "layer_sliding_windows" in raw:  # written before LayerSpec: every layer had the model's rope
            raw["layers"] = [dict(sliding_window=window, rope_theta=raw["rope_theta"], rope_scaling=raw["rope_scaling"])
                             for window in raw.pop("layer_sliding_windows")]
        raw["layers"] = tuple(LayerSpec(**{**layer, "rope_scaling": rope_tuple(layer.get("rope_scaling"))})
                              for layer in raw["layers"])
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        raw["moe"] = MoEConfig(**raw["moe"]) if raw.get("moe") else None
        raw["mla"] = MLAConfig(**raw["mla"]) if raw.get("mla") else None
        raw["linear_attention"] = LinearAttentionConfig(**raw["linear_attention"]) if raw.get("linear_attention") \
            else None
        return cls(**raw)


def rope_tuple(items) -> tuple[tuple[str, Any], ...] | None:
    """JSON's list of [key, value] pairs (or None) back to the hashable rope parameters (list values as tuples:
    longrope's factors)."""
    if not items:
        return None
    return tuple((key, tuple(value) if isinstance(value, list) else value) for key, value in items)


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A HF config's token-id field (`eos_token_id` is an int, a list of ints, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(i) for i in value) if isinstance(value, (list, tuple)) else (int(value),)

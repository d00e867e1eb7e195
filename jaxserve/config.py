"""Model configuration: the handful of numbers a Llama-family forward pass needs, read from a Hugging Face config."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM)."""

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
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def with_eos_token_ids(self, extra: Iterable[int]) -> "ModelConfig":
        """This config with the `extra` EOS ids (e.g. generation_config.json's) added after its own, each id once."""
        return dataclasses.replace(self, eos_token_ids=tuple(dict.fromkeys((*self.eos_token_ids, *extra))))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        raw = json.loads(text)
        raw["rope_scaling"] = tuple(tuple(item) for item in raw["rope_scaling"]) if raw.get("rope_scaling") else None
        raw["layer_sliding_windows"] = tuple(raw["layer_sliding_windows"])
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        return cls(**raw)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Builds the config from a transformers `PretrainedConfig` (v4 or v5 spelling of rope fields)."""
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; jaxserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_q_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_q_heads
        rope_params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = rope_params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; jaxserve supports {SUPPORTED_ROPE_TYPES}")
        rope_scaling = None
        if rope_type != "default":
            rope_params["rope_type"] = rope_type
            rope_params.pop("type", None)
            rope_scaling = tuple(sorted(rope_params.items()))

        num_layers = hf_config.num_hidden_layers
        windows: list[int | None] = [None] * num_layers
        window = getattr(hf_config, "sliding_window", None)
        if window:
            layer_types = getattr(hf_config, "layer_types", None)
            if model_type == "mistral":
                windows = [window] * num_layers
            elif layer_types and getattr(hf_config, "use_sliding_window", False):
                windows = [window if kind == "sliding_attention" else None for kind in layer_types]

        qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_q_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            layer_sliding_windows=tuple(windows),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=token_ids(hf_config.eos_token_id),
        )


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A HF config's token-id field (`eos_token_id` is an int, a list of ints, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(i) for i in value) if isinstance(value, (list, tuple)) else (int(value),)

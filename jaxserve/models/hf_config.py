"""Readers of the Hugging Face config fields that several model families spell alike: rope parameters, per-layer
sliding windows, head sizes."""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "proportional")
REQUIRED_ROPE_FIELDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                          "original_max_position_embeddings"),
                        "yarn": ("original_max_position_embeddings",),
                        "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
                        "dynamic": ("factor",), "proportional": ()}


def rope_parameters(hf_config: Any, partial: bool = False) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """`(rope_theta, rope_scaling)` from a transformers config, in the v4 (`rope_theta`, `rope_scaling`) or v5
    (`rope_parameters`) spelling; scaling None for the default rope, else its sorted items with `rope_type`.
    `partial`: the caller rotates part of each head (`rotary_fraction`), else a partial rotary factor is refused."""
    rope_params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if getattr(hf_config, "partial_rotary_factor", None) is not None:
        rope_params.setdefault("partial_rotary_factor", hf_config.partial_rotary_factor)
    if partial:
        rope_params.pop("partial_rotary_factor", None)
    longrope = rope_params.get("rope_type", rope_params.get("type")) == "longrope"
    if longrope and getattr(hf_config, "original_max_position_embeddings", None) is not None:  # Phi-3: top level
        rope_params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    return parse_rope(rope_params, getattr(hf_config, "rope_theta", None),
                      getattr(hf_config, "max_position_embeddings", 2048))


def parse_rope(rope_params: dict, default_theta: float | None,
               max_position_embeddings: int) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """`rope_parameters`' content (one dict: the model's, or one layer type's) as `(rope_theta, rope_scaling)`;
    ValueError naming a rope this code cannot compute."""
    rope_params = dict(rope_params)
    rope_theta = rope_params.pop("rope_theta", None) or default_theta or 10000.0
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; jaxserve supports {SUPPORTED_ROPE_TYPES}")
    if rope_type == "proportional":  # its partial factor is part of its frequencies (`rotary.py`), whole head turned
        rope_params.setdefault("partial_rotary_factor", 1.0)
        rope_params.setdefault("factor", 1.0)
    elif rope_params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope partial_rotary_factor {rope_params['partial_rotary_factor']} is not supported "
                         "(jaxserve rotates the whole head)")
    if rope_type != "proportional":
        rope_params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return float(rope_theta), None
    missing = [name for name in REQUIRED_ROPE_FIELDS[rope_type] if rope_params.get(name) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs rope parameter {missing[0]!r}")
    if rope_type in ("yarn", "longrope") and rope_params.get("factor") is None:  # transformers: the two lengths' ratio
        rope_params["factor"] = max_position_embeddings / rope_params["original_max_position_embeddings"]
    if rope_type == "dynamic":  # its frequencies change once a sequence outgrows the model's length
        rope_params["max_position_embeddings"] = max_position_embeddings
    rope_params = {name: tuple(value) if isinstance(value, list) else value for name, value in rope_params.items()}
    rope_params["rope_type"] = rope_type
    rope_params.pop("type", None)
    return float(rope_theta), tuple(sorted(rope_params.items()))


def rotary_fraction(hf_config: Any) -> float:
    """The fraction of each head's dims the rope turns (`partial_rotary_factor`, top level or in the rope
    parameters; 1: all)."""
    rope_params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    fraction = getattr(hf_config, "partial_rotary_factor", None) or rope_params.get("partial_rotary_factor") or 1.0
    if not 0 < float(fraction) <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {fraction}")
    return float(fraction)


def layer_windows(hf_config: Any, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: global attention).

    `sliding_window` applies to the layers `layer_types` marks "sliding_attention", or to every layer when the
    config has no `layer_types` (Mistral); `use_sliding_window: false` (Qwen2, Qwen3) turns it off, and a config
    without that flag (Gemma) is read by its `layer_types` alone."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

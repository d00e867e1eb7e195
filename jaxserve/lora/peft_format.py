"""PEFT's LoRA adapter format, read and checked before anything reaches the device: `adapter_config.json`
(`r`, `lora_alpha`, `use_rslora`, `target_modules`, `rank_pattern`, `alpha_pattern`) and
`adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight [r, in]`, `lora_B.weight [out, r]`).

`read_adapter` returns each adapted linear's `(A [in, r], B [r, out])` in float32 with B scaled by PEFT's factor
(`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA), so `x @ A @ B` is the adapter's whole contribution. Anything the
engine cannot serve exactly is a ValueError naming the adapter and the field: a rank above `max_lora_rank`, a
target other than the decoder's q/k/v/o/gate/up/down projections (embeddings, the LM head, `modules_to_save`),
DoRA, trained biases, a shape or layer that is not the base model's, a mixture-of-experts layer's MLP.

The target names are the base checkpoint's, as its family declares them (`ModelSpec.lora_targets`): Phi-3's fused
`qkv_proj` (`[q | k | v]` rows) and `gate_up_proj` (`[gate | up]`) instead of the separate projections. A fused
module's `x @ A @ B` is split exactly into one module per projection, each with the shared A and its rows of B.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import model_spec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# safetensors' dtype names -> numpy's (safetensors.numpy has no bfloat16): numpy only, so reading compiles nothing
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
# a decoder's layers: under `model.`, or an image + text model's `model.language_model.` (or `language_model.model.`)
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterWeights:
    """One adapter as read: `modules[(layer, target)] = (A [in, r], B [r, out] scaled)`, float32; `key`: sha256 of
    its files (what the device slots and the prefix cache know it by); `rank`: its largest module rank."""

    name: str
    path: str
    key: bytes
    rank: int
    modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def module_shapes(config: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of the base model's linear `target`."""
    kv = config.num_kv_heads * config.head_dim
    return {"q_proj": (config.hidden_size, config.q_size), "k_proj": (config.hidden_size, kv),
            "v_proj": (config.hidden_size, kv), "o_proj": (config.q_size, config.hidden_size),
            "gate_proj": (config.hidden_size, config.intermediate_size),
            "up_proj": (config.hidden_size, config.intermediate_size),
            "down_proj": (config.intermediate_size, config.hidden_size)}[target]


def checkpoint_targets(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The names an adapter of the base model `config` may target (its checkpoint's), each with the decoder
    projections its output rows hold in order (itself, or a fused target's parts)."""
    return dict(model_spec(config.model_type).lora_targets)


def target_shapes(config: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of the adapter target `target` (a fused one: its projections' outputs together)."""
    parts = checkpoint_targets(config)[target]
    return module_shapes(config, parts[0])[0], sum(module_shapes(config, part)[1] for part in parts)


def pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(name: str, path: str) -> tuple[dict, bytes]:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, "rb") as f:
            raw = f.read()
        config = json.loads(raw)
    except OSError as error:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file!r} ({error.strerror or error})") from None
    except ValueError as error:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    return config, raw


def _check_config(name: str, config: dict, max_rank: int, supported: dict[str, tuple[str, ...]]) -> None:
    def refuse(field: str, why: str):
        raise ValueError(f"LoRA adapter {name!r}: {field} {why}")
    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", f"must be 'LORA', got {config.get('peft_type')!r}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        refuse("r", f"must be an integer >= 1, got {rank!r}")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        refuse("r", f"{max(ranks)} exceeds max_lora_rank ({max_rank})")
    if not isinstance(config.get("lora_alpha", 8), (int, float)):
        refuse("lora_alpha", f"must be a number, got {config.get('lora_alpha')!r}")
    if config.get("use_dora"):
        refuse("use_dora", "is not supported (DoRA adapters)")
    if config.get("bias", "none") != "none":
        refuse("bias", f"must be 'none' (trained biases are not supported), got {config.get('bias')!r}")
    if config.get("modules_to_save"):
        refuse("modules_to_save", f"is not supported (fully trained modules {config['modules_to_save']!r})")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out", "is not supported (Conv1D base layers)")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(supported))
        if unknown:
            refuse("target_modules", f"{unknown} are not supported (supported: {', '.join(supported)})")
    elif targets is not None and not isinstance(targets, str):
        refuse("target_modules", f"must be a list of names or a regex string, got {targets!r}")


def _read_tensors(name: str, path: str) -> tuple[dict[str, np.ndarray], bytes]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        other = " (adapter_model.bin is not read: save with safe_serialization)" if os.path.exists(
            os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path!r}{other}")
    from safetensors import deserialize

    with open(file, "rb") as f:
        raw = f.read()
    try:
        views = deserialize(raw)
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read ({error})") from None
    tensors = {}
    for key, view in views:
        if view["dtype"] not in FLOAT_DTYPES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is {view['dtype']} (supported: "
                             f"{', '.join(FLOAT_DTYPES)})")
        tensor = np.frombuffer(view["data"], FLOAT_DTYPES[view["dtype"]]).reshape(view["shape"])
        tensors[key] = tensor.astype(np.float32)
    return tensors, raw


def read_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> AdapterWeights:
    """The adapter in directory `path`, checked against the base model `config` (ValueError naming the problem)."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    adapter_config, config_bytes = _read_config(name, path)
    supported = checkpoint_targets(config)
    if not supported:
        raise ValueError(f"LoRA adapter {name!r}: the base model's family ({config.model_type}) serves no adapters")
    _check_config(name, adapter_config, max_rank, supported)
    tensors, tensor_bytes = _read_tensors(name, path)
    rank_default, alpha_default = adapter_config["r"], adapter_config.get("lora_alpha", 8)
    ranks, alphas = adapter_config.get("rank_pattern") or {}, adapter_config.get("alpha_pattern") or {}
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder projection "
                             f"(supported: {', '.join(supported)})")
        layer, group, target, half = int(match[1]), match[2], match[3], match[4]
        if target not in supported or (group == "mlp") != (supported[target][0] in MLP_PROJECTIONS):
            raise ValueError(f"LoRA adapter {name!r}: target module {group}.{target} ({key!r}) is not supported "
                             f"(supported: {', '.join(supported)})")
        if layer >= config.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} adapts layer {layer}, but the base model has "
                             f"{config.num_layers} layers (an adapter of another base model?)")
        if group == "mlp" and config.layers[layer].feed_forward == "moe":
            raise ValueError(f"LoRA adapter {name!r}: {key!r} adapts a mixture-of-experts layer's MLP, which is not "
                             "supported (attention projections are)")
        halves.setdefault((layer, target), {})[half] = tensor
    if not halves:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    modules, use_rslora = {}, bool(adapter_config.get("use_rslora"))
    for (layer, target), pair in sorted(halves.items()):
        where = f"layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        parts = supported[target]
        fan_in, fan_out = target_shapes(config, target)
        module = f"model.layers.{layer}.{'mlp' if parts[0] in MLP_PROJECTIONS else 'self_attn'}.{target}"
        rank = pattern_value(ranks, module, rank_default)
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_A {a.shape} and lora_B {b.shape}, but rank "
                             f"{rank} on the base model needs {(rank, fan_in)} and {(fan_out, rank)} (an adapter of "
                             "another base model?)")
        alpha = pattern_value(alphas, module, alpha_default)
        scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        a_t, b_t = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T) * np.float32(scaling)
        starts = np.cumsum([0, *(module_shapes(config, part)[1] for part in parts)])
        for part, start, stop in zip(parts, starts, starts[1:]):
            modules[(layer, part)] = (a_t, np.ascontiguousarray(b_t[:, start:stop]))
    key = hashlib.sha256(config_bytes + hashlib.sha256(tensor_bytes).digest()).digest()
    return AdapterWeights(name, path, key, max(a.shape[1] for a, _ in modules.values()), modules)

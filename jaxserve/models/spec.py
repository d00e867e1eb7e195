"""`ModelSpec`, what one model family tells the registry (`models/registry.py`), and `TensorSource`, where one
checkpoint-layout parameter is read from."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """The checkpoint tensor(s) one checkpoint-layout parameter is read from: one name, or several stacked on a
    new leading axis (e.g. one tensor per expert); `transposed` when its last two axes are stored swapped (HF
    linears' `[out, in]`, every expert's `[E, out, in]`); `rows` `(start, stop)` when it is that slice of the
    tensor's output features (its first axis for a matrix or vector, the second for experts: a projection fused in
    the checkpoint, Phi-3's `qkv_proj`, Gemma 4's experts' `gate_up_proj`); `columns` `(offset, step)` when it
    is the tensor's last-axis entries `offset, offset + step, ...` (projections interleaved in the checkpoint,
    gpt-oss's `gate_up_proj`; not transposed)."""

    names: tuple[str, ...]
    transposed: bool = False
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.columns is not None and self.transposed:
            raise ValueError("TensorSource: columns of a transposed tensor are not supported")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family: everything between its Hugging Face checkpoint and the engine."""

    model_types: tuple[str, ...]  # the config.json `model_type`s it serves
    parse_config: Callable[[Any], ModelConfig]  # a transformers PretrainedConfig -> ModelConfig
    # (config, attention, dtype, tp) -> a module `(token_ids, kv_cache, meta) -> (last hidden [B, T, H], cache)`
    module: type[nn.Module]
    # (params, config, x [..., H], dtype, tp) -> float32 logits: the final norm and LM head, a plain function
    compute_logits: Callable[..., jax.Array]
    checkpoint_shapes: Callable[[ModelConfig, DTypeLike], dict]  # the checkpoint-layout tree of ShapeDtypeStructs
    checkpoint_source: Callable[[str, ModelConfig], TensorSource]  # a checkpoint-layout path -> its tensors
    # one layer, checkpoint -> serving layout; its config is the layer's view (`ModelConfig.for_layer`)
    fuse_layer: Callable[[dict, ModelConfig, TensorParallel], dict]
    sharding_rules: tuple[tuple[str, str], ...]  # (regex on the path, `shardings.SPEC_KINDS` name); first wins
    quantizable_linears: tuple[str, ...]  # checkpoint-layout linears a 4-bit (AWQ) checkpoint stores quantized
    dummy_fan_in: Callable[[str, tuple[int, ...]], int]  # (path, shape) -> fan-in of a random dummy weight
    # the projections a LoRA adapter may target, as PEFT names them in this family's checkpoints, each with the
    # decoder projections (q/k/v/o_proj, gate/up/down_proj) its output rows hold in order; empty: no adapters
    lora_targets: tuple[tuple[str, tuple[str, ...]], ...] = ()


def text_decoder_parser(parse_config: Callable[[Any], ModelConfig]) -> Callable[[Any], ModelConfig]:
    """The config parser of a family's image + text checkpoints, served text-only: its `text_config` by the
    family's `parse_config`, under the checkpoint's own `model_type`."""
    def parse(hf_config: Any) -> ModelConfig:
        return dataclasses.replace(parse_config(hf_config.text_config), model_type=hf_config.model_type)
    return parse

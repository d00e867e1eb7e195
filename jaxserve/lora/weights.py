"""Adapters in the serving layout, and the device stack that holds `max_loras` of them.

Each adapted linear of the serving layout has `lanes` of `max_lora_rank` columns: `qkv_proj` one each for q, k and
v, `gate_up_proj` for gate and up, `o_proj` and `down_proj` one. An adapter's `A [in, r]` fills the first r columns
of its lane of `a [in, lanes * R]` and its scaled `B [r, out]` the same rows of `b [lanes * R, out]`, in the output
columns of its projection in the fused layout (built by the family's own `fuse_layer`, so every device's columns
are together and replicated KV heads replicated, as for the base kernel). Unused lanes, ranks below R and
projections an adapter leaves alone are zeros, so they add exactly nothing.

The device stack is, per adapted linear, `a [in, max_loras, W]` and `b [max_loras, W, out]` in the serving dtype,
sharded like its base linear (`llama_weights.LORA_SHARDING_RULES`); `load_slot_step` writes one adapter into one
slot; `layers/lora.lora_variables` gives the forward the stack with every row's slot as a mask.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.lora.peft_format import AdapterWeights, module_shapes
from jaxserve.models import fuse_layer

# serving linear -> (its group in a layer, the checkpoint projections in its lanes)
LANES = {"qkv_proj": ("attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("attn", ("o_proj",)),
         "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def adapted_linears(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The serving linears of `layer` an adapter may change (a mixture-of-experts layer: its attention's)."""
    dense = config.layers[layer].feed_forward == "dense"
    return tuple(name for name, (group, _) in LANES.items() if group == "attn" or dense)


def linear_shapes(config: ModelConfig, tp: TensorParallel, name: str) -> tuple[int, int]:
    """(in, out) features of serving linear `name` (the fused qkv's columns include replicated KV heads)."""
    if name == "qkv_proj":
        per_device = tp.q_heads_per_device(config) + 2 * tp.kv_heads_per_device(config)
        return config.hidden_size, tp.size * per_device * config.head_dim
    if name == "gate_up_proj":
        return config.hidden_size, 2 * config.intermediate_size
    return module_shapes(config, name)


def stack_shapes(config: ModelConfig, tp: TensorParallel, max_loras: int, max_rank: int, dtype) -> dict:
    """The device stack's tree of ShapeDtypeStructs: `layers_i/{attn,mlp}/<linear>/{a,b}`."""
    tree: dict = {}
    for layer in range(config.num_layers):
        for name in adapted_linears(config, layer):
            group, lanes = LANES[name]
            fan_in, fan_out = linear_shapes(config, tp, name)
            width = len(lanes) * max_rank
            tree.setdefault(f"layers_{layer}", {}).setdefault(group, {})[name] = {
                "a": jax.ShapeDtypeStruct((fan_in, max_loras, width), dtype),
                "b": jax.ShapeDtypeStruct((max_loras, width, fan_out), dtype)}
    return tree


def fused_columns(config: ModelConfig, tp: TensorParallel) -> dict[str, np.ndarray]:
    """For `qkv_proj` and `gate_up_proj`, the column of the checkpoint projections' concatenation (`[q | k | v]`,
    `[gate | up]`) each serving column reads: the family's `fuse_layer` run once over column numbers, so adapters
    are laid out with numpy alone when they are read (no device work, nothing to compile, on a request)."""
    def numbered(targets: tuple[str, ...]) -> dict:
        widths = [module_shapes(config, target)[1] for target in targets]
        starts = np.cumsum([0, *widths])
        return {target: {"kernel": np.arange(start, start + width, dtype=np.int32)[None]}
                for target, start, width in zip(targets, starts, widths)}
    fused = fuse_layer({"attn": numbered(LANES["qkv_proj"][1]), "mlp": numbered(LANES["gate_up_proj"][1])}, config,
                       tp)
    return {"qkv_proj": np.asarray(fused["attn"]["qkv_proj"]["kernel"][0]),
            "gate_up_proj": np.asarray(fused["mlp"]["gate_up_proj"]["kernel"][0])}


def serving_adapter(adapter: AdapterWeights, config: ModelConfig, max_rank: int,
                    columns: dict[str, np.ndarray]) -> dict:
    """`adapter` in the serving layout (`columns`: `fused_columns`): numpy float32
    `layers_i/{attn,mlp}/<linear>/{a [in, W], b [W, out]}` for every linear of the stack (zeros where the adapter
    leaves it alone)."""
    tree: dict = {}
    for layer in range(config.num_layers):
        for name in adapted_linears(config, layer):
            group, lanes = LANES[name]
            fan_in = module_shapes(config, lanes[0])[0]
            widths = [module_shapes(config, target)[1] for target in lanes]
            a = np.zeros((fan_in, len(lanes) * max_rank), np.float32)
            b = np.zeros((len(lanes) * max_rank, sum(widths)), np.float32)  # the projections' columns side by side
            for lane, (target, start) in enumerate(zip(lanes, np.cumsum([0, *widths]))):
                if (layer, target) in adapter.modules:
                    a_t, b_t = adapter.modules[(layer, target)]
                    rows = slice(lane * max_rank, lane * max_rank + a_t.shape[1])
                    a[:, rows] = a_t
                    b[rows, start:start + b_t.shape[1]] = b_t
            tree.setdefault(f"layers_{layer}", {}).setdefault(group, {})[name] = {
                "a": a, "b": b[:, columns[name]] if name in columns else b}
    return tree


@flax.struct.dataclass
class SlotWeights:
    """One adapter's serving-layout weights (`serving_adapter`) for device slot `slot`."""

    slot: jax.Array  # int32 scalar
    weights: dict


def empty_stack(shapes: dict, shardings: dict, full: Callable[..., Any]) -> dict:
    """The device stack of `stack_shapes`, zeros (no adapter in any slot), placed by `shardings`; `full(shape,
    dtype, sharding)` makes each array (the runner's allocator's)."""
    return jax.tree.map(lambda shape, sharding: full(shape.shape, shape.dtype, sharding), shapes, shardings)


def empty_adapter(stack: dict) -> dict:
    """An adapter of zeros in the serving layout of `stack`'s slots (`a [in, W]`, `b [W, out]`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: np.zeros((leaf.shape[0], leaf.shape[2]) if path[-1].key == "a" else leaf.shape[1:],
                                    np.float32), stack)


def load_slot_step(stack: dict, inputs: SlotWeights) -> tuple[None, tuple[dict]]:
    """The stack with slot `inputs.slot` holding `inputs.weights` (the stack donated: written in place)."""
    def write(leaf_name: str, stacked: jax.Array, weight: jax.Array) -> jax.Array:
        if leaf_name == "a":
            return stacked.at[:, inputs.slot].set(weight.astype(stacked.dtype))
        return stacked.at[inputs.slot].set(weight.astype(stacked.dtype))
    new = jax.tree_util.tree_map_with_path(lambda path, s, w: write(path[-1].key, s, w), stack, inputs.weights)
    return None, (new,)

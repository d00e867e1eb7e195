"""Mixture-of-experts feed-forward: the router's top-k, the grouped matmul over tokens sorted by expert, and the
Flax `MoE` block a decoder layer calls instead of its dense MLP.

Each token's `top_k` (token, expert) pairs become rows; the rows are sorted by expert, so each expert's rows are
one contiguous group, and every expert linear is one grouped matmul over the groups (`grouped_matmul`). The work
grows with the number of rows (tokens x top_k), never with the number of experts: no token is dropped and no
expert computes a row that is not routed to it. On TPU the grouped matmul is `jax.lax.ragged_dot` (a native
instruction). XLA lowers `ragged_dot` densely on CPU and on NVIDIA GPUs (every row times every expert: FLOPs and
temporaries grow with the expert count), so on GPU it is our Triton kernel (`pallas_kernels.ops.grouped_matmul`)
and on CPU a loop over tiles of `tile_rows` rows; both take their tiles, each inside one expert's group, from
`tile_schedule`, as Megablox schedules its grouped matmul.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax.sharding import AbstractMesh

from jaxserve.config import ModelConfig, MoEConfig
from jaxserve.distributed.shardings import path_name, spec_from_rules
from jaxserve.distributed.tensor_parallel import MODEL_AXIS, REPLICATED, TensorParallel
from jaxserve.layers import matmul_blocks
from jaxserve.layers.fp8 import dequantize
from jaxserve.layers.mlp import MLP, gate_activation
from jaxserve.layers.quant_dense import Linear
from pallas_kernels import ops
from pallas_kernels.triton.grouped_matmul import tile_rows, tile_schedule

EXPERT_BLOCK_BYTES = 1 << 20  # float bytes of one expert-kernel block in the CPU loop (benchmarks/RESULTS.md)
# where the experts' parameters live (`shardings.SPEC_KINDS`; part of each MoE family's table, read here too for
# the shard_map): split inside each expert like the dense MLP, or by expert under expert parallelism
SHARDING_RULES: tuple[tuple[str, str], ...] = (
    (r"experts/(gate_up|gate|up)_proj/kernel$", "expert_columns"),
    (r"experts/(gate_up|gate|up)_proj/(scale|bias)$", "expert_vector"),
    (r"experts/down_proj/kernel$", "expert_rows"),
    (r"experts/down_proj/scale$", "expert_replicated"),
    (r"experts/down_proj/bias$", "replicated"),  # added once, after the devices' partial sums (`MoE`)
    (r"mlp/(router|shared_expert_gate)/", "replicated"),
    (r"mlp/score_correction_bias$", "replicated"),
)


def route(router_logits: jax.Array, moe: MoEConfig, correction_bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """`(weights [T, top_k] float32, experts [T, top_k] int32)`: each token's experts and their weights, by
    `moe`'s routing (`MoEConfig`): the `top_k` best scores (softmax over all experts, or each expert's sigmoid),
    chosen by score plus `correction_bias` [E] when given, among the best `top_k_groups` groups when the experts
    are grouped (each scored by its two best, or its best); the weights are the scores, renormalized when `normalize_top_k`, times `routed_scaling`."""
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if moe.num_groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], moe.num_groups, -1)
        group_scores = jnp.max(grouped, axis=-1) if moe.group_by_max else jnp.sum(jax.lax.top_k(grouped, 2)[0], -1)
        _, best = jax.lax.top_k(group_scores, moe.top_k_groups)
        chosen = jnp.any(best[..., None] == jnp.arange(moe.num_groups), axis=-2)
        choice = jnp.where(chosen[..., None], grouped, -jnp.inf).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, moe.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_top_k:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if moe.scoring == "sigmoid" else 0))
    return weights * moe.routed_scaling, experts.astype(jnp.int32)


def tiled_grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array,
                         block_scale: jax.Array | None = None) -> jax.Array:
    """`grouped_matmul` as a loop over `tile_schedule`'s tiles: each tile is `rows` rows of `x` times one expert's
    kernel, written to the rows of its group only. The kernel is read in cache-sized blocks of its input rows
    (`matmul_blocks`; whole FP8 blocks), each sliced (and converted to `x.dtype` when int8 or FP8) on its own:
    XLA:CPU copies a dynamic slice before a dot reads it, so slicing the whole expert would write and read it once
    more."""
    num_rows, fan_in = x.shape
    num_groups, _, fan_out = kernel.shape
    rows = tile_rows(num_rows, num_groups)
    padded = -(-num_rows // rows) * rows
    unit = 1 if block_scale is None else fan_in // block_scale.shape[1]  # a loop block holds whole FP8 blocks
    blocks = matmul_blocks.num_blocks(fan_in // unit, unit * fan_out, jnp.dtype(x.dtype).itemsize, rows,
                                      EXPERT_BLOCK_BYTES)
    block = fan_in // blocks
    xp = jnp.pad(x, ((0, padded - num_rows), (0, 0))).reshape(padded, blocks, block)
    kb = kernel.reshape(num_groups, blocks, block, fan_out)
    sb = None if block_scale is None else block_scale.reshape(num_groups, blocks, -1, block_scale.shape[-1])
    num_tiles, tile_group, tile_block = tile_schedule(group_sizes, num_rows, rows)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def tile(t, out):
        group, first = tile_group[t], tile_block[t] * rows
        x_tile = jax.lax.dynamic_slice_in_dim(xp, first, rows)  # [rows, blocks, block]

        def part(j, acc):
            w = jax.lax.dynamic_slice(kb, (group, j, 0, 0), (1, 1, block, fan_out))[0, 0]
            if sb is None:
                w = w.astype(x.dtype)
            else:
                w = dequantize(w, jax.lax.dynamic_slice(sb, (group, j, 0, 0), (1, 1, *sb.shape[2:]))[0, 0], x.dtype)
            xj = jax.lax.dynamic_index_in_dim(x_tile, j, 1, keepdims=False)
            return acc + jnp.dot(xj, w, preferred_element_type=jnp.float32)

        y = jax.lax.fori_loop(0, blocks, part, jnp.zeros((rows, fan_out), jnp.float32))
        row = first + jnp.arange(rows)
        mine = (row >= starts[group]) & (row < ends[group])
        kept = jax.lax.dynamic_slice_in_dim(out, first, rows)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y, kept), first, 0)

    out = jax.lax.fori_loop(0, num_tiles, tile, jnp.zeros((padded, fan_out), jnp.float32))
    return out[:num_rows]


def grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, block_scale: jax.Array | None = None
                   ) -> jax.Array:
    """Float32 `[R, out]`: row r of `x [R, in]` (rows sorted by group) times `kernel[g] [in, out]` of its group g;
    `group_sizes [G]` counts each group's rows (rows past their sum are 0). `kernel` float, int8 (its scale is
    the caller's) or FP8 with its `block_scale [G, in / bi, out / bo]` (applied here, block by block)."""
    if matmul_blocks.blocked_matmuls():
        return tiled_grouped_matmul(x, kernel, group_sizes, block_scale)
    if matmul_blocks.lowering_platform() == "gpu":
        return ops.grouped_matmul(x, kernel, group_sizes, block_scale=block_scale)
    weights = kernel.astype(x.dtype) if block_scale is None else dequantize(kernel, block_scale, x.dtype)
    return jax.lax.ragged_dot(x, weights, group_sizes, preferred_element_type=jnp.float32)


class ExpertKernels(nn.Module):
    """Every expert's linears: `{name: {"kernel": [E, in, out], "scale": [E, out] (int8 kernels only) or
    "block_scale": [E, in / bi, out / bo] (FP8 kernels only, `layers/fp8.py`), "bias":
    [E, out] (gpt-oss)}}` for `gate_up_proj [E, H, 2I]` (each device's gate and up columns together, as the dense
    MLP's; whole under expert parallelism) and `down_proj [E, I, H]`."""

    config: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self) -> dict:
        cfg, moe = self.config, self.config.moe
        shapes = {"gate_up_proj": (moe.num_experts, cfg.hidden_size, 2 * moe.intermediate_size),
                  "down_proj": (moe.num_experts, moe.intermediate_size, cfg.hidden_size)}
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        return {name: ExpertLinear(shape, init, self.dtype, moe.expert_bias, name=name)()
                for name, shape in shapes.items()}


class ExpertLinear(nn.Module):
    shape: tuple[int, int, int]
    initializer: Any
    dtype: Any
    use_bias: bool = False

    @nn.compact
    def __call__(self) -> dict:
        quantized = [name for name in ("scale", "block_scale") if self.has_variable("params", name)]
        if quantized:
            linear = {name: self.get_variable("params", name) for name in ("kernel", *quantized)}
        else:
            linear = {"kernel": self.param("kernel", self.initializer, self.shape, self.dtype)}
        if self.use_bias:
            experts, _, fan_out = self.shape
            linear["bias"] = self.param("bias", nn.initializers.zeros_init(), (experts, fan_out), self.dtype)
        return linear


def gated(gate: jax.Array, up: jax.Array, moe: MoEConfig) -> jax.Array:
    """An expert's activation: `act(gate) * up` (SwiGLU, or GeGLU with `moe.activation` "gelu_tanh"), or gpt-oss's
    clamped SwiGLU when `moe.swiglu_limit`."""
    if moe.swiglu_limit is None:
        return gate_activation(moe.activation)(gate) * up
    limit = moe.swiglu_limit
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * moe.swiglu_alpha))


def expert_outputs(tokens: jax.Array, weights: jax.Array, experts: jax.Array, kernels: dict, first_expert,
                   moe: MoEConfig, dtype) -> jax.Array:
    """Float32 `[T, H]`: each token's outputs of the experts `kernels` holds (`first_expert` onwards; the rest
    of its experts are other devices'), weighted by its routing weights and summed. Under tensor parallelism the
    kernels are this device's columns of every expert and the sum is partial over them; either way the devices'
    results add up to the whole. `MoE` keeps `down_proj`'s bias out of `kernels`: it adds it once, not per device."""
    num_local = kernels["down_proj"]["kernel"].shape[0]
    top_k = experts.shape[-1]
    flat = experts.reshape(-1) - first_expert
    local = (flat >= 0) & (flat < num_local)
    key = jnp.where(local, flat, num_local)  # other devices' rows sort last, past every group
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    token_of_row, expert_of_row = order // top_k, jnp.minimum(key[order], num_local - 1)

    def linear(x, name):
        params = kernels[name]
        y = grouped_matmul(x, params["kernel"], group_sizes, params.get("block_scale"))
        y = (y * params["scale"][expert_of_row] if "scale" in params else y).astype(dtype)
        return y + params["bias"][expert_of_row].astype(dtype) if "bias" in params else y

    gate, up = jnp.split(linear(tokens[token_of_row], "gate_up_proj"), 2, axis=-1)
    out = linear(gated(gate, up, moe), "down_proj").astype(jnp.float32)
    row_weights = jnp.where(local[order], weights.reshape(-1)[order], 0.0)
    return jnp.zeros(tokens.shape, jnp.float32).at[token_of_row].add(out * row_weights[:, None])


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of `config.moe`, `[..., H] -> [..., H]`: the router (float32) picks
    each token's experts, the experts run on the token's rows, their outputs summed by the routing weights; plus
    the shared expert, gated by a sigmoid, when the model has one. Over several devices as `run_experts` says."""

    config: ModelConfig
    tp: TensorParallel
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, moe, tp = self.config, self.config.moe, self.tp
        tokens = x.reshape(-1, cfg.hidden_size)
        logits = Linear(moe.num_experts, use_bias=moe.router_bias, dtype=jnp.float32, name="router")(
            tokens.astype(jnp.float32))
        correction = self.param("score_correction_bias", nn.initializers.zeros_init(), (moe.num_experts,),
                                jnp.float32) if moe.score_correction_bias else None
        weights, experts = route(logits, moe, correction)
        y = run_experts(tokens, weights, experts, ExpertKernels(cfg, self.dtype, name="experts")(), cfg, tp,
                        self.dtype)
        if moe.shared_expert_size:
            shared = MLP(cfg.hidden_size, moe.shared_expert_size, tp, self.dtype, name="shared_expert")(tokens)
            if moe.shared_expert_gate:
                gate = Linear(1, dtype=self.dtype, name="shared_expert_gate")(tokens)
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)) * shared.astype(jnp.float32)
            y = y + shared.astype(jnp.float32)
        return y.astype(self.dtype).reshape(x.shape)


def run_experts(tokens: jax.Array, weights: jax.Array, experts: jax.Array, kernels: dict, config: ModelConfig,
                tp: TensorParallel, dtype) -> jax.Array:
    """Float32 `[T, H]`: `tokens [T, H]` through their routed `experts [T, top_k]` (`ExpertKernels`' `kernels`),
    summed by their routing `weights [T, top_k]`. On several devices each runs its own kernels under `shard_map`
    (its columns of every expert, or under expert parallelism its whole experts, computing only the rows routed
    to them) and one all-reduce of the `[T, H]` partial sums adds them up: the activations are already on every
    device, so no token has to be sent anywhere first. `down_proj`'s bias is added once, not per device."""
    moe = config.moe
    kernels = {name: dict(linear) for name, linear in kernels.items()}
    down_bias = kernels["down_proj"].pop("bias", None)
    if tp.size == 1:
        y = expert_outputs(tokens, weights, experts, kernels, 0, moe, dtype)
    else:
        per_device = moe.num_experts // tp.size if tp.expert_parallel else 0

        def on_device(tokens, weights, experts, kernels):
            first = jax.lax.axis_index(MODEL_AXIS) * per_device
            return jax.lax.psum(expert_outputs(tokens, weights, experts, kernels, first, moe, dtype), MODEL_AXIS)

        specs = jax.tree_util.tree_map_with_path(
            lambda path, _: spec_from_rules("experts/" + path_name(path), SHARDING_RULES, config, tp), kernels)
        mesh = AbstractMesh((tp.size,), (MODEL_AXIS,))  # the engine's mesh: one axis of tp.size devices
        # check_vma off: the CPU tile loop's zero carry would have to be cast to device-varying by hand
        y = jax.shard_map(on_device, mesh=mesh, in_specs=(REPLICATED, REPLICATED, REPLICATED, specs),
                          out_specs=REPLICATED, check_vma=False)(tokens, weights, experts, kernels)
    if down_bias is not None:  # each chosen expert's output bias, by its routing weight
        y = y + jnp.einsum("tk,tkh->th", weights, down_bias[experts].astype(dtype).astype(jnp.float32))
    return y

"""Mixture-of-experts feed-forward: the router's top-k, the grouped matmul over tokens sorted by expert, and the
Flax `MoE` block a decoder layer calls instead of its dense MLP.

Each token's `top_k` (token, expert) pairs become rows; the rows are sorted by expert, so each expert's rows are
one contiguous group, and every expert linear is one grouped matmul over the groups (`grouped_matmul`). The work
grows with the number of rows (tokens x top_k), never with the number of experts: no token is dropped and no
expert computes a row that is not routed to it. On TPU and GPU the grouped matmul is `jax.lax.ragged_dot` (a
native instruction on TPU; cuDNN's grouped GEMM through XLA on NVIDIA GPUs). On CPU jax lowers `ragged_dot` to a
dense dot of every row with every expert (its FLOPs grow with the expert count), so there it is a loop over tiles
of `tile_rows` rows, each tile inside one expert's group (`tile_schedule`), as Megablox schedules its grouped
matmul.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.mlp import MLP
from jaxserve.layers.quant_dense import Linear

MAX_TILE_ROWS = 128


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """`(weights [T, top_k] float32, experts [T, top_k] int32)`: the `top_k` experts of highest softmax probability
    over all experts, and their probabilities (renormalized to sum to 1 when `normalize`)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def tile_rows(num_rows: int, num_groups: int) -> int:
    """The rows of one tile of the CPU grouped matmul: about a group's mean size (a power of two, 8 to 128), so a
    decode step's few rows per expert are few tiles and a prefill's many rows are big ones."""
    mean = max(1, num_rows // num_groups)
    return min(MAX_TILE_ROWS, max(8, 1 << (mean - 1).bit_length()))


def tile_schedule(group_sizes: jax.Array, num_rows: int, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(num_tiles, tile_group [max_tiles], tile_block [max_tiles])`: the tiles of `rows` rows that cover each group
    of sorted rows (group g is rows `[start_g, end_g)`), one tile per block of `rows` rows a group overlaps. A block
    shared by two groups is two tiles, each keeping its own group's rows. `num_tiles` <= ceil(num_rows / rows) +
    (non-empty groups) - 1; tiles past `num_tiles` are padding."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first, last = starts // rows, (ends - 1) // rows
    tiles = jnp.where(group_sizes > 0, last - first + 1, 0)
    tile_ends = jnp.cumsum(tiles)
    max_tiles = -(-num_rows // rows) + min(group_sizes.shape[0], num_rows) - 1
    index = jnp.arange(max_tiles)
    group = jnp.minimum(jnp.searchsorted(tile_ends, index, side="right"), group_sizes.shape[0] - 1)
    block = first[group] + index - (tile_ends[group] - tiles[group])
    return tile_ends[-1], group.astype(jnp.int32), block.astype(jnp.int32)


def tiled_grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` as a loop over `tile_schedule`'s tiles: each tile is `rows` rows of `x` times one expert's
    kernel (converted to `x.dtype` tile by tile when int8), written to the rows of its group only."""
    num_rows, fan_in = x.shape
    num_groups, _, fan_out = kernel.shape
    rows = tile_rows(num_rows, num_groups)
    padded = -(-num_rows // rows) * rows
    xp = jnp.pad(x, ((0, padded - num_rows), (0, 0)))
    num_tiles, tile_group, tile_block = tile_schedule(group_sizes, num_rows, rows)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def tile(t, out):
        group, first = tile_group[t], tile_block[t] * rows
        w = jax.lax.dynamic_index_in_dim(kernel, group, 0, keepdims=False).astype(x.dtype)
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(xp, first, rows), w, preferred_element_type=jnp.float32)
        row = first + jnp.arange(rows)
        mine = (row >= starts[group]) & (row < ends[group])
        kept = jax.lax.dynamic_slice_in_dim(out, first, rows)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y, kept), first, 0)

    out = jax.lax.fori_loop(0, num_tiles, tile, jnp.zeros((padded, fan_out), jnp.float32))
    return out[:num_rows]


def grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Float32 `[R, out]`: row r of `x [R, in]` (rows sorted by group) times `kernel[g] [in, out]` of its group g;
    `group_sizes [G]` counts each group's rows (rows past their sum are 0). `kernel` float or int8 (its scale is
    the caller's)."""
    if jax.default_backend() == "cpu":
        return tiled_grouped_matmul(x, kernel, group_sizes)
    return jax.lax.ragged_dot(x, kernel.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)


class ExpertKernel(nn.Module):
    """One linear of every expert: `kernel [E, in, out]` (float, or int8 with `scale [E, out]`); returns both."""

    shape: tuple[int, int, int]
    dtype: Any

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        if self.has_variable("params", "scale"):
            return self.get_variable("params", "kernel"), self.get_variable("params", "scale")
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        return self.param("kernel", init, self.shape, self.dtype), None


class Experts(nn.Module):
    """Every expert's SwiGLU over rows sorted by expert: `gate_up_proj [E, H, 2I]` (each device's gate and up
    columns together, as the dense MLP's) and `down_proj [E, I, H]`."""

    config: ModelConfig
    tp: TensorParallel
    dtype: Any

    @nn.compact
    def __call__(self, rows: jax.Array, row_experts: jax.Array, group_sizes: jax.Array) -> jax.Array:
        cfg, moe, shards = self.config, self.config.moe, self.tp.size

        def linear(x, shape, name):
            kernel, scale = ExpertKernel(shape, self.dtype, name=name)()
            y = grouped_matmul(x, kernel, group_sizes)
            return (y if scale is None else y * scale[row_experts]).astype(self.dtype)

        gate_up = linear(rows, (moe.num_experts, cfg.hidden_size, 2 * moe.intermediate_size), "gate_up_proj")
        gate, up = jnp.split(gate_up.reshape(rows.shape[0], shards, -1), 2, axis=-1)
        hidden = (nn.silu(gate) * up).reshape(rows.shape[0], moe.intermediate_size)
        return linear(hidden, (moe.num_experts, moe.intermediate_size, cfg.hidden_size), "down_proj")


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of `config.moe`, `[..., H] -> [..., H]`: the router (float32) picks
    each token's experts, the experts run on the token's rows, their outputs summed by the routing weights; plus
    the shared expert, gated by a sigmoid, when the model has one."""

    config: ModelConfig
    tp: TensorParallel
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, moe = self.config, self.config.moe
        tokens = x.reshape(-1, cfg.hidden_size)
        logits = Linear(moe.num_experts, dtype=jnp.float32, name="router")(tokens.astype(jnp.float32))
        weights, experts = route(logits, moe.top_k, moe.normalize_top_k)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token_of_row = order // moe.top_k
        group_sizes = jnp.bincount(flat, length=moe.num_experts).astype(jnp.int32)
        out = Experts(cfg, self.tp, self.dtype, name="experts")(tokens[token_of_row], flat[order], group_sizes)
        weighted = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        y = jnp.zeros(tokens.shape, jnp.float32).at[token_of_row].add(weighted)
        if moe.shared_expert_size:
            shared = MLP(cfg.hidden_size, moe.shared_expert_size, self.tp, self.dtype, name="shared_expert")(tokens)
            gate = Linear(1, dtype=self.dtype, name="shared_expert_gate")(tokens)
            y = y + jax.nn.sigmoid(gate.astype(jnp.float32)) * shared.astype(jnp.float32)
        return y.astype(self.dtype).reshape(x.shape)

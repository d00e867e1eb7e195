"""Grouped matmul (the mixture-of-experts' expert linears), Triton backend, and the tile schedule it shares with
the CPU's loop (`jaxserve.layers.moe.tiled_grouped_matmul`).

Rows of ``x`` come sorted by group; group g is rows ``[start_g, end_g)`` and is multiplied by ``kernel[g]``. The
rows are cut into blocks of ``block_rows``; a tile is one block inside one group, so a block two groups share is
two tiles (``tile_schedule``). Grid: (max_tiles, N // block_n). A program reads its tile's group and block from the
schedule arrays (Triton has no scalar prefetch), loops over K in ``block_k`` steps with float32 accumulation (int8
or other float kernels converted to x's dtype tile by tile), and stores only its group's rows. The rows past the
groups' sum are written as zeros by the last group's tiles (the rest of their block) and by the programs past
``num_tiles`` (one whole block past the sum each: there are always enough of them), so nothing else zeroes the
output. No work grows with the number of groups: XLA's dense GPU ``ragged_dot`` multiplies every row by every group.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._cost import nbytes
from pallas_kernels.triton import _common as common

MAX_TILE_ROWS = 128
MIN_TRITON_DIM = 16  # Triton's dot needs at least 16 in each dimension
MAX_BLOCK_N = 128
MAX_BLOCK_K = 64


def tile_rows(num_rows: int, num_groups: int, smallest: int = 8) -> int:
    """The rows of one tile: about a group's mean size (a power of two, `smallest` to 128), so a decode step's few
    rows per expert are few tiles and a prefill's many rows are big ones."""
    mean = max(1, num_rows // num_groups)
    return min(MAX_TILE_ROWS, max(smallest, 1 << (mean - 1).bit_length()))


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


def block_size(length: int, largest: int) -> int:
    """The largest power of two from 16 to `largest` dividing `length` (no padding of the weights), else the
    smallest power of two >= `length` up to `largest` (`length` padded to its multiple)."""
    for block in (largest >> i for i in range(largest.bit_length())):
        if block >= MIN_TRITON_DIM and length % block == 0:
            return block
    return min(largest, max(MIN_TRITON_DIM, 1 << (length - 1).bit_length()))


def _grouped_matmul_kernel(num_tiles_ref: Any, tile_group_ref: Any, tile_block_ref: Any, ends_ref: Any,
                           x_ref: Any, w_ref: Any, *refs: Any, block_rows: int, block_n: int, block_k: int,
                           scale_block: tuple[int, int] | None) -> None:
    """x_ref [R, K], w_ref [G, K, N], out_ref [R, N] float32 (whole arrays; R, K, N multiples of the blocks);
    num_tiles_ref int32[1]; tile_group_ref, tile_block_ref int32[max_tiles]; ends_ref int32[G] (cumsum of sizes).
    With `scale_block` (bk, bn), `refs` starts with scale_ref [G, K / bk, N / bn]: each (block_k, block_n) tile
    lies inside one scale block (bk, bn multiples of block_k, block_n), so its product is scaled as a whole."""
    scale_ref, out_ref = refs if scale_block is not None else (None, *refs)
    tile, col = pl.program_id(0), pl.program_id(1)
    num_tiles, total = num_tiles_ref[0], ends_ref[ends_ref.shape[0] - 1]
    columns = common.ds(col * block_n, block_n)
    row = lax.broadcasted_iota(jnp.int32, (block_rows, block_n), 0)

    @pl.when(tile < num_tiles)
    def _():
        group = tile_group_ref[tile]
        first = tile_block_ref[tile] * block_rows
        end = ends_ref[group]
        start = jnp.where(group > 0, ends_ref[jnp.maximum(group - 1, 0)], 0)

        def step(k: jax.Array, acc: jax.Array) -> jax.Array:
            depth = common.ds(k * block_k, block_k)
            x = x_ref[common.ds(first, block_rows), depth]
            w = w_ref[group, depth, columns].astype(x.dtype)
            if scale_ref is None:
                return acc + common.matmul(x, w, transpose_b=False)
            scale = scale_ref[group, (k * block_k) // scale_block[0], (col * block_n) // scale_block[1]]
            return acc + common.matmul(x, w, transpose_b=False) * scale

        y = lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((block_rows, block_n), jnp.float32))
        row_index = first + row
        mine = (row_index >= start) & ((row_index < end) | (end == total))  # the last group zeroes its block's rest
        common.masked_store(out_ref.at[common.ds(first, block_rows), columns], jnp.where(row_index < end, y, 0.0),
                            mine)

    spare_block = (total + block_rows - 1) // block_rows + tile - num_tiles  # a whole block past the sum

    @pl.when((tile >= num_tiles) & (spare_block < out_ref.shape[0] // block_rows))
    def _():
        out_ref[common.ds(spare_block * block_rows, block_rows), columns] = jnp.zeros((block_rows, block_n),
                                                                                      jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_rows", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, *, block_scale: jax.Array | None = None,
                   block_rows: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """Float32 `[R, N]`: row r of `x [R, K]` (rows sorted by group) times `kernel[g] [K, N]` of its group g;
    `group_sizes int32[G]` counts each group's rows, summing to at most R (rows past the sum are 0).

    `kernel` is float (converted to x's dtype) or int8 (converted exactly; its scales are the caller's), or float8
    with `block_scale [G, K / bk, N / bn]` (blocks that tile it; the tiles are cut inside them, each tile's product
    scaled in the kernel).
    Defaults: `block_rows` from the mean group size (16 to 128, `tile_rows`), `block_n` up to 128 and `block_k` up
    to 64, the largest powers of two dividing N and K (else N or K padded: a copy of the kernel), 8 warps for
    128 x 128 tiles, else 4. `interpret=True` runs the kernel in Pallas' interpreter (on CPU).
    """
    common.require_backend(interpret)
    num_rows, fan_in = x.shape
    num_groups, kernel_in, fan_out = kernel.shape
    if kernel_in != fan_in or group_sizes.shape != (num_groups,):
        raise ValueError(f"x {x.shape}, kernel {kernel.shape} and group_sizes {group_sizes.shape} do not match")
    block_rows = block_rows or tile_rows(num_rows, num_groups, MIN_TRITON_DIM)
    block_n = block_n or block_size(fan_out, MAX_BLOCK_N)
    block_k = block_k or block_size(fan_in, MAX_BLOCK_K)
    scale_block = None
    if block_scale is not None:
        scale_block = (fan_in // block_scale.shape[1], fan_out // block_scale.shape[2])
        if block_scale.shape[0] != num_groups or any(
                size % b for size, b in zip((fan_in, fan_out), scale_block)):
            raise ValueError(f"block_scale {block_scale.shape} does not tile kernel {kernel.shape} in whole blocks")
        block_k = min(block_k or MAX_BLOCK_K, block_size(scale_block[0], MAX_BLOCK_K))
        block_n = min(block_n or MAX_BLOCK_N, block_size(scale_block[1], MAX_BLOCK_N))
        if scale_block[0] % block_k or scale_block[1] % block_n:
            raise ValueError(f"FP8 blocks {scale_block} are not whole tiles of {block_k} x {block_n}")
    num_warps = num_warps or (8 if block_rows * block_n >= 128 * 128 else 4)

    rows, cols, depth = (-(-size // block) * block for size, block in
                         ((num_rows, block_rows), (fan_out, block_n), (fan_in, block_k)))
    x = jnp.pad(x, ((0, rows - num_rows), (0, depth - fan_in)))
    if (depth, cols) != (fan_in, fan_out):
        kernel = jnp.pad(kernel, ((0, 0), (0, depth - fan_in), (0, cols - fan_out)))
    group_sizes = group_sizes.astype(jnp.int32)
    num_tiles, tile_group, tile_block = tile_schedule(group_sizes, num_rows, block_rows)
    schedule = (num_tiles.reshape(1), tile_group, tile_block, jnp.cumsum(group_sizes))

    max_tiles = tile_group.shape[0]
    scales = () if block_scale is None else (block_scale.astype(jnp.float32),)
    out_shape = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    # every tile counted busy; each expert's weights read once, x once per column block
    cost = pl.CostEstimate(flops=2 * max_tiles * block_rows * depth * cols, transcendentals=0,
                           bytes_accessed=nbytes(kernel) * min(num_groups, num_rows) // num_groups
                           + nbytes(x) * (cols // block_n) + nbytes(out_shape, *schedule, *scales))
    kernel_fn = functools.partial(_grouped_matmul_kernel, block_rows=block_rows, block_n=block_n, block_k=block_k,
                                  scale_block=scale_block)
    out = pl.pallas_call(
        kernel_fn,
        grid=(max_tiles, cols // block_n),
        out_shape=out_shape,
        compiler_params=common.compiler_params(num_warps, num_stages),
        cost_estimate=cost,
        interpret=interpret,
        name=f"jaxserve_grouped_matmul_r{block_rows}_n{block_n}_k{block_k}",
    )(*schedule, x, kernel, *scales)
    return out[:num_rows, :fan_out]

"""Mosaic TPU kernel that writes a step's new K/V tokens into their page-pool slots, in place.

The pools keep the layout every backend shares, `[kv_heads, num_pages, page_size, head_dim]` (scales of quantized
pools `[kv_heads, num_pages, page_size]`), and are aliased to the outputs: with the pools donated to the jitted
step only the written rows move. Tokens whose slot lies in page 0, the scratch page where the engine sends padding
(see jaxserve/engine/page_manager.py), are skipped: several share a slot, and concurrent DMAs to it would race.

Mosaic copies HBM -> HBM only at row offsets aligned to the memory's packing (found by compiling for v5e, v6e,
v5p and v4): a 32-bit word holds 1 float32, 2 bfloat16 or 4 int8 / fp8 rows of a page, so a DMA along the
page_size dimension must start and end at multiples of that many rows (`pl.multiple_of` lets Mosaic prove it);
and along lanes (the scales' tokens) only whole rows or 512-byte pieces move. So the unit of a DMA is a row
group: `rows_per_group` rows of a page (1 for float32, 2 for bfloat16, 4 for 8-bit values), a whole page row of
`page_size` lanes for the scales. Around the `pallas_call`, in XLA, the tokens are sorted by slot; the first token
of each group (its leader) gets the group's image: the group's current rows gathered from the pool, overwritten
by every new token of the group, so rows no new token writes keep what they held. The kernel then DMAs each
leader's image over its group; leaders' groups are disjoint, so the copies never race. float32 values need no
image: each token is its own group, copied straight from `new` without sorting.

Extra work per token and head beyond its own bytes: for 2- and 1-byte values the gather and the image of its
group (2 or 4 rows; the image also feeds the DMA), for scales a page row of `4 * page_size` bytes. A decode step
pays that per row; a prefill chunk pays it per token, because the image arrays are sized by the token count (the
number of groups is only known at run time). The alternative, read-modify-write of each group in VMEM inside the
kernel, would need the new tokens at dynamic lane offsets, which Mosaic does not load or store.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._cost import nbytes
from pallas_kernels._planning import cdiv

TOKENS_PER_CELL = 128


def rows_per_group(pool_shape: tuple[int, ...], dtype: jnp.dtype) -> int:
    """Rows of a page one DMA writes: what a 32-bit word packs (values), or the whole page row (scales, whose
    tokens lie along lanes)."""
    page_size = pool_shape[2]
    if len(pool_shape) == 3:
        return page_size
    return math.gcd(max(1, 4 // jnp.dtype(dtype).itemsize), page_size)


def _kernel(dest_ref, *refs, kinds, lane_rows, num_tokens, page_size, tokens_per_cell):
    num_arrays = len(kinds)
    distinct = sorted(set(kinds))  # dest_ref holds one [num_tokens] row per distinct group size, in this order
    images = refs[:num_arrays]
    pools = refs[2 * num_arrays:3 * num_arrays]  # the outputs, aliased to the input pools
    sems = refs[3 * num_arrays]
    first = pl.program_id(0) * tokens_per_cell

    def copy(i, position, dest):
        rows = kinds[i]
        page = dest // page_size
        if lane_rows[i]:  # a scales page row: `rows` lanes, one sublane
            return pltpu.make_async_copy(images[i].at[:, pl.ds(position, 1)], pools[i].at[:, pl.ds(page, 1)],
                                         sems.at[i])
        offset = pl.multiple_of(dest % page_size, rows)
        source = pl.ds(pl.multiple_of(position * rows, rows), rows)
        return pltpu.make_async_copy(images[i].at[:, source], pools[i].at[:, page, pl.ds(offset, rows)],
                                     sems.at[i])

    def each_group(action):
        def body(j, carry):
            position = jnp.minimum(first + j, num_tokens - 1)
            for k, kind in enumerate(distinct):
                dest = dest_ref[k * num_tokens + position]

                @pl.when((first + j < num_tokens) & (dest >= 0))
                def _():
                    for i in range(num_arrays):
                        if kinds[i] == kind:
                            action(copy(i, position, dest))
            return carry
        jax.lax.fori_loop(0, tokens_per_cell, body, 0)

    each_group(lambda c: c.start())
    each_group(lambda c: c.wait())


def _leaders(slots: jax.Array, valid: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Tokens sorted by slot: (order, the group's first flat slot at each leader and -1 elsewhere, the leader's
    position for each token (`len(slots)` for skipped ones), each token's row within its group)."""
    num_tokens = slots.shape[0]
    order = jnp.argsort(jnp.where(valid, slots, jnp.iinfo(jnp.int32).max))
    slots, valid = slots[order], valid[order]
    group = slots // rows
    first = valid & jnp.concatenate([jnp.ones((1,), bool), group[1:] != group[:-1]])
    position = jnp.arange(num_tokens, dtype=jnp.int32)
    leader = jax.lax.cummax(jnp.where(first, position, 0))
    return order, jnp.where(first, group * rows, -1), jnp.where(valid, leader, num_tokens), slots % rows


def _image(pool: jax.Array, new: jax.Array, rows: int, order, dest, leader, row) -> jax.Array:
    """Each leader's group as it must end up: its rows gathered from `pool`, overwritten by the group's new tokens;
    `[kv_heads, tokens * rows, *rest]` for values, `[kv_heads, tokens, page_size]` for scales."""
    page_size = pool.shape[2]
    base = jnp.maximum(dest, 0)  # only leaders' images are copied; the other positions gather page 0
    page, offset = base // page_size, base % page_size
    old = pool[:, page[:, None], offset[:, None] + jnp.arange(rows)]  # [kv_heads, tokens, rows, *rest]
    image = old.at[:, leader, row].set(new[:, order], mode="drop")
    if pool.ndim == 3:
        return image
    return image.reshape(pool.shape[0], -1, *pool.shape[3:])


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_to_pages(pools: tuple[jax.Array, ...], new: tuple[jax.Array, ...], slots: jax.Array, *,
                   interpret: pltpu.InterpretParams | None = None) -> tuple[jax.Array, ...]:
    """`pools[i][:, slot // page_size, slot % page_size] = new[i][:, t]` for every token `t` with `slot =
    slots[t]` outside page 0; returns the pools (updated in place when donated).

    Args:
      pools: arrays `[kv_heads, num_pages, page_size, *rest]` (K and V values, and their scales when quantized).
      new: arrays `[kv_heads, tokens, *rest]`, each in its pool's dtype.
      slots: int32 [tokens], flat slot `page * page_size + offset` of each token; slots in page 0 are skipped,
        and no two slots outside it may be equal.
      interpret: `pltpu.InterpretParams()` to run in Pallas' TPU interpreter, None on a TPU.
    """
    if len(pools) != len(new):
        raise ValueError(f"{len(pools)} pools but {len(new)} new arrays")
    num_tokens = slots.shape[0]
    kv_heads, num_pages, page_size = pools[0].shape[:3]
    for pool, tokens in zip(pools, new):
        expected = (kv_heads, num_tokens, *pool.shape[3:])
        if pool.shape[:3] != (kv_heads, num_pages, page_size) or tokens.shape != expected:
            raise ValueError(f"pool {pool.shape} needs new tokens of shape {expected}, got {tokens.shape}")
        if tokens.dtype != pool.dtype:
            raise ValueError(f"new tokens are {tokens.dtype}, their pool {pool.dtype}")
    slots = jnp.clip(slots.astype(jnp.int32), 0, num_pages * page_size - 1)
    valid = slots >= page_size
    kinds = tuple(rows_per_group(pool.shape, pool.dtype) for pool in pools)
    lane_rows = tuple(pool.ndim == 3 for pool in pools)
    dests, images, plans = [], [], {}
    for kind in sorted(set(kinds)):
        if kind == 1:  # each token its own group, in its own order
            dests.append(jnp.where(valid, slots, -1))
        else:
            plans[kind] = _leaders(slots, valid, kind)
            dests.append(plans[kind][1])
    for pool, tokens, kind in zip(pools, new, kinds):
        images.append(tokens if kind == 1 else _image(pool, tokens, kind, *plans[kind]))
    num_arrays = len(pools)
    tokens_per_cell = min(TOKENS_PER_CELL, num_tokens)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, kinds=kinds, lane_rows=lane_rows, num_tokens=num_tokens, page_size=page_size,
                          tokens_per_cell=tokens_per_cell),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(cdiv(num_tokens, tokens_per_cell),), in_specs=[hbm] * (2 * num_arrays),
            out_specs=[hbm] * num_arrays, scratch_shapes=[pltpu.SemaphoreType.DMA((num_arrays,))]),
        out_shape=[jax.ShapeDtypeStruct(pool.shape, pool.dtype) for pool in pools],
        input_output_aliases={1 + num_arrays + i: i for i in range(num_arrays)},  # operand 0: the destinations
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),  # cells write disjoint groups
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * nbytes(*images)),
        interpret=interpret if interpret is not None else False,
    )(jnp.concatenate(dests), *images, *pools)

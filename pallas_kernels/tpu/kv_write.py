"""Mosaic TPU kernels that write a step's new K/V tokens into their page-pool slots, in place.

The pools keep the layout every backend shares, `[kv_heads, num_pages, page_size, head_dim]` (scales of quantized
pools `[kv_heads, num_pages, page_size]`), and are aliased to the outputs: with the pools donated to the jitted
step only the written rows move. Tokens whose slot lies in page 0, the scratch page where the engine sends padding
(see jaxserve/engine/page_manager.py), are skipped: several share a slot, and concurrent DMAs to it would race.

Mosaic copies HBM -> HBM only at row offsets aligned to the memory's packing (found by compiling for v5e, v6e,
v5p and v4): a 32-bit word holds 1 float32, 2 bfloat16 or 4 int8 / fp8 rows of a page, so a DMA along the
page_size dimension must start and end at multiples of that many rows (`pl.multiple_of` lets Mosaic prove it);
along lanes (the scales' tokens) only whole rows or 512-byte pieces move. So the unit of a DMA is a row group:
`rows_per_group` rows of a page (1 for float32, 2 for bfloat16, 4 for 8-bit values), a whole page row of
`page_size` lanes for the scales. The tokens are sorted by slot; the first token of each group (its leader) gets
the group's image: a first kernel copies the group's current rows from the pool into the image, XLA writes every
new token of the group over its row there, and a second kernel copies the images over their groups. Rows no new
token writes keep what they held; leaders' groups are disjoint, so the copies never race. float32 values need no
image: each token is its own group, copied straight from `new` in its own order.

All reads and writes of the pool are these DMAs of whole groups: an XLA gather of the groups' old rows made XLA
relayout (copy) the whole pool first, for some shapes and layouts. The extra bytes per token and head are its
group's image (2 or 4 rows of 2- or 1-byte values, a page row of `4 * page_size` bytes of scales) read from the
pool, merged and written back. The images are sized by the token count (the number of groups is only known at run
time), so a prefill chunk pays a group per token, like a decode step. Merging in VMEM inside one kernel instead
would need new tokens stored at sub-word rows, the copies Mosaic refuses.
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


def _kernel(dest_ref, *refs, groups, num_tokens, page_size, tokens_per_cell, to_pool):
    """Copies, for every position `p` of this cell with `dest_ref[row * num_tokens + p] >= 0` (row: the array's
    entry in `groups`), the row group at flat slot `dest` between image position `p` and the pool: into the pool
    (`to_pool`, pools aliased to the outputs) or out of it into the images."""
    count = len(groups)
    if to_pool:
        images, pools = refs[:count], refs[2 * count:3 * count]
    else:
        pools, images = refs[:count], refs[count:2 * count]
    sems = refs[-1]
    first = pl.program_id(0) * tokens_per_cell

    def copy(i, position, dest):
        rows, lanes, _ = groups[i]
        page = dest // page_size
        if lanes:  # a scales page row: `rows` lanes, one sublane
            image, pool = images[i].at[:, pl.ds(position, 1)], pools[i].at[:, pl.ds(page, 1)]
        else:
            image = images[i].at[:, pl.ds(pl.multiple_of(position * rows, rows), rows)]
            pool = pools[i].at[:, page, pl.ds(pl.multiple_of(dest % page_size, rows), rows)]
        source, target = (image, pool) if to_pool else (pool, image)
        return pltpu.make_async_copy(source, target, sems.at[i])

    def each_group(action):
        def body(j, carry):
            position = jnp.minimum(first + j, num_tokens - 1)
            for row in sorted({g[2] for g in groups}):
                dest = dest_ref[row * num_tokens + position]

                @pl.when((first + j < num_tokens) & (dest >= 0))
                def _():
                    for i in range(count):
                        if groups[i][2] == row:
                            action(copy(i, position, dest))
            return carry
        jax.lax.fori_loop(0, tokens_per_cell, body, 0)

    each_group(lambda c: c.start())
    each_group(lambda c: c.wait())


def _image_shape(pool: jax.Array, rows: int, num_tokens: int) -> jax.ShapeDtypeStruct:
    """`[kv_heads, tokens * rows, *rest]` for values, `[kv_heads, tokens, page_size]` for scales."""
    if pool.ndim == 3:
        return jax.ShapeDtypeStruct((pool.shape[0], num_tokens, pool.shape[2]), pool.dtype)
    return jax.ShapeDtypeStruct((pool.shape[0], num_tokens * rows, *pool.shape[3:]), pool.dtype)


def _group_copies(dests, groups, pools, images, *, page_size, num_tokens, to_pool, interpret):
    """One `_kernel` call: `images` (arrays when `to_pool`, else their shapes) into or out of `pools`."""
    count = len(pools)
    tokens_per_cell = min(TOKENS_PER_CELL, num_tokens)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    operands = (*images, *pools) if to_pool else tuple(pools)
    outputs = pools if to_pool else images
    return pl.pallas_call(
        functools.partial(_kernel, groups=groups, num_tokens=num_tokens, page_size=page_size,
                          tokens_per_cell=tokens_per_cell, to_pool=to_pool),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(cdiv(num_tokens, tokens_per_cell),), in_specs=[hbm] * len(operands),
            out_specs=[hbm] * count, scratch_shapes=[pltpu.SemaphoreType.DMA((count,))]),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        # operand 0 is the destinations; the pools follow the images
        input_output_aliases={1 + count + i: i for i in range(count)} if to_pool else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),  # cells copy disjoint groups
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * nbytes(*images)),
        interpret=interpret if interpret is not None else False,
    )(dests, *operands)


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
    sizes = [rows_per_group(pool.shape, pool.dtype) for pool in pools]
    distinct = sorted(set(sizes))
    groups = tuple((rows, pool.ndim == 3, distinct.index(rows)) for rows, pool in zip(sizes, pools))
    plans = {rows: _leaders(slots, valid, rows) for rows in distinct if rows > 1}
    dests = jnp.concatenate([plans[rows][1] if rows > 1 else jnp.where(valid, slots, -1) for rows in distinct])
    copies = functools.partial(_group_copies, dests, page_size=page_size, num_tokens=num_tokens, interpret=interpret)

    grouped = [i for i, rows in enumerate(sizes) if rows > 1]
    images = list(new)  # a float32 token is its own group
    if grouped:
        olds = copies(tuple(groups[i] for i in grouped), [pools[i] for i in grouped],
                      [_image_shape(pools[i], sizes[i], num_tokens) for i in grouped], to_pool=False)
        for i, old in zip(grouped, olds):
            order, _, leader, row = plans[sizes[i]]
            old = old.reshape(kv_heads, num_tokens, sizes[i], *pools[i].shape[3:])
            image = old.at[:, leader, row].set(new[i][:, order], mode="drop")
            images[i] = image.reshape(old.shape[0], -1, *old.shape[3:]) if pools[i].ndim == 4 else image
    return tuple(copies(groups, list(pools), images, to_pool=True))

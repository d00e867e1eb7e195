"""Mosaic TPU kernel that writes a step's new K/V tokens into their page-pool slots, in place.

Each token is one HBM -> HBM DMA per pool (all KV heads at once: `new[:, t]` -> `pool[:, page, offset]`); a
grid cell starts up to `TOKENS_PER_CELL` of them on one semaphore per pool and then waits for them all, so the copies
overlap. The pools are aliased to the outputs (`input_output_aliases`): with the pool donated to the jitted
step nothing but the new tokens moves. Tokens whose slot lies in page 0, the scratch page where the engine
sends padding (see jaxserve/engine/page_manager.py), are skipped: several of them share a slot, and writing
it from concurrent DMAs would be a race for no purpose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._planning import cdiv

TOKENS_PER_CELL = 128


def _kernel(slots_ref, *refs, num_arrays, num_tokens, page_size, tokens_per_cell):
    new_refs = refs[num_arrays:2 * num_arrays]
    pool_refs = refs[2 * num_arrays:3 * num_arrays]  # the outputs, aliased to the input pools
    sems = refs[3 * num_arrays]
    first = pl.program_id(0) * tokens_per_cell

    def copies(token):
        slot = slots_ref[token]
        page, offset = slot // page_size, slot % page_size
        return [pltpu.make_async_copy(new.at[:, pl.ds(token, 1)], pool.at[:, page, pl.ds(offset, 1)], sems.at[i])
                for i, (new, pool) in enumerate(zip(new_refs, pool_refs))]

    def each_written_token(action):
        def body(i, carry):
            token = first + i

            @pl.when((token < num_tokens) & (slots_ref[jnp.minimum(token, num_tokens - 1)] >= page_size))
            def _():
                for c in copies(token):
                    action(c)
            return carry
        jax.lax.fori_loop(0, tokens_per_cell, body, 0)

    each_written_token(lambda c: c.start())
    each_written_token(lambda c: c.wait())


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
    num_arrays = len(pools)
    tokens_per_cell = min(TOKENS_PER_CELL, num_tokens)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    slots = jnp.clip(slots.astype(jnp.int32), 0, num_pages * page_size - 1)
    return pl.pallas_call(
        functools.partial(_kernel, num_arrays=num_arrays, num_tokens=num_tokens, page_size=page_size,
                          tokens_per_cell=tokens_per_cell),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(cdiv(num_tokens, tokens_per_cell),), in_specs=[hbm] * (2 * num_arrays),
            out_specs=[hbm] * num_arrays, scratch_shapes=[pltpu.SemaphoreType.DMA((num_arrays,))]),
        out_shape=[jax.ShapeDtypeStruct(pool.shape, pool.dtype) for pool in pools],
        input_output_aliases={1 + i: i for i in range(num_arrays)},  # operand 0 is the scalar-prefetched slots
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),  # cells write disjoint slots
        interpret=interpret if interpret is not None else False,
    )(slots, *pools, *new)

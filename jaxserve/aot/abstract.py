"""`AbstractAllocator`: the runner's device state as `jax.ShapeDtypeStruct`s on a target's compile-only devices, and
the memory those devices would report holding it.

It is the `engine/allocator.py` protocol for `jaxserve compile`: the runner builds its pools, slot state, LoRA
stack and step examples through it exactly as it does on devices, and sizes its KV pool from `memory_stats`, which
answer as the target's device would with the runner's state so far in place (`bytes_in_use`: each device's
shards of it) and its allocator set as `jaxserve serve` sets it (`bytes_limit`: the utilization's share of a GPU,
a TPU's whole memory).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from jaxserve.aot.targets import Target
from jaxserve.config import ModelConfig
from jaxserve.loading.placement import checkpoint_shardings
from jaxserve.models import checkpoint_shapes


def abstract_weights(config: ModelConfig, dtype: Any, mesh: Mesh, expert_parallel: bool = False) -> dict:
    """The checkpoint-layout params of `config` as `ShapeDtypeStruct`s placed as a loader would place them."""
    return jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                        checkpoint_shapes(config, dtype), checkpoint_shardings(config, dtype, mesh, expert_parallel))


def device_bytes(tree: Any) -> int:
    """Bytes of `tree`'s arrays (or `ShapeDtypeStruct`s) held by one device: each leaf's shard (a leaf with no
    sharding counts whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        sharding = getattr(sharding, "sharding", sharding)  # a Format's
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


class AbstractAllocator:
    """`ShapeDtypeStruct`s in place of arrays, on `target`'s devices; serving at `utilization` of their memory."""

    def __init__(self, target: Target, utilization: float):
        self.target = target
        self.utilization = utilization

    def full(self, shape: tuple[int, ...], dtype: Any, sharding: Sharding | None, fill: Any = 0
             ) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

    def put(self, tree: Any, sharding: Sharding) -> Any:
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), np.asarray(leaf).dtype,
                                                              sharding=sharding), tree)

    def weights(self, model: str, config: ModelConfig, dtype: Any, mesh: Mesh) -> dict:
        return abstract_weights(config, dtype, mesh)

    def checkpoint(self, read: Callable[[], dict], shapes: dict) -> dict:
        return shapes

    def place(self, convert: Callable[[Any], Any], read: Callable[[], Any], shapes: Any,
              shardings: Callable[[Any], Any]) -> Any:
        shapes = jax.eval_shape(convert, shapes)  # nothing is read: a head compiles from its config alone
        return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                            shapes, shardings(shapes))

    @property
    def bytes_limit(self) -> int:
        """What the target's device reports as its allocator's limit under `jaxserve serve`."""
        hbm = self.target.chip.hbm_bytes
        return int(hbm * self.utilization) if self.target.platform == "gpu" else hbm

    def memory_stats(self, device: Any, resident: Any) -> dict:
        return {"bytes_limit": self.bytes_limit, "bytes_in_use": device_bytes(resident)}

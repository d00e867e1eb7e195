"""Where the runner's device state comes from: the `Allocator` protocol and `DeviceAllocator`, the one serving uses.

Every array the runner keeps between steps (the KV pools, the slot and penalty state, the sampling table, the LoRA
stack, a draft model's weights) and every device-side example its warm-up feeds the steps is made through the
runner's allocator. Serving makes arrays on the devices; `jaxserve compile` passes an allocator that makes
`jax.ShapeDtypeStruct`s with the same shardings on a target's compile-only devices (`aot/abstract.py`), so the
runner, its steps and their examples are built by the same code either way and only the arrays differ.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format
from jax.sharding import Mesh, Sharding

from jaxserve.config import ModelConfig


class Allocator(Protocol):
    def full(self, shape: tuple[int, ...], dtype: Any, sharding: Sharding | Format | None, fill: Any = 0) -> Any:
        """An array of `shape` filled with `fill`, placed by `sharding` (a `Format`: in its layout too; None: the
        default device)."""

    def put(self, tree: Any, sharding: Sharding) -> Any:
        """Host arrays (a pytree) placed by `sharding`."""

    def weights(self, model: str, config: ModelConfig, dtype: Any, mesh: Mesh) -> dict:
        """Checkpoint-layout params of `model` (a draft model) placed on `mesh`."""

    def checkpoint(self, read: Callable[[], dict], shapes: dict) -> dict:
        """Checkpoint-layout params `read()` reads (placed as `shapes`, ShapeDtypeStructs with their shardings,
        say): a model's MTP layer."""

    def place(self, convert: Callable[[Any], Any], read: Callable[[], Any], shapes: Any,
              shardings: Callable[[Any], Any]) -> Any:
        """`convert(read())` computed on the devices and placed by `shardings(its shapes)` (an EAGLE-3 head's
        serving-layout params from its checkpoint tensors); `shapes`: what `read()` returns, as ShapeDtypeStructs."""

    def memory_stats(self, device: Any, resident: Any) -> dict | None:
        """`device.memory_stats()` (None on a CPU) once `resident` (the runner's state so far) is allocated."""


class DeviceAllocator:
    """Arrays on the devices: what serving runs with."""

    def full(self, shape: tuple[int, ...], dtype: Any, sharding: Sharding | Format | None, fill: Any = 0
             ) -> jax.Array:
        if isinstance(sharding, Format):  # made in its layout, never relaid (a pool may take most of the memory)
            return jax.jit(functools.partial(jnp.full, shape, fill, dtype), out_shardings=sharding)()
        return jnp.full(shape, fill, dtype, device=sharding)

    def put(self, tree: Any, sharding: Sharding) -> Any:
        return jax.device_put(tree, sharding)

    def weights(self, model: str, config: ModelConfig, dtype: Any, mesh: Mesh) -> dict:
        from jaxserve.loading import load_model

        return load_model(model, dtype, mesh=mesh).params

    def checkpoint(self, read: Callable[[], dict], shapes: dict) -> dict:
        return read()

    def place(self, convert: Callable[[Any], Any], read: Callable[[], Any], shapes: Any,
              shardings: Callable[[Any], Any]) -> Any:
        tree = read()
        return jax.jit(convert, out_shardings=shardings(jax.eval_shape(convert, tree)))(tree)

    def memory_stats(self, device: Any, resident: Any) -> dict | None:
        return device.memory_stats()

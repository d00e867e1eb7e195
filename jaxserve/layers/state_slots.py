"""Per-sequence state of the layers that keep one instead of KV pages (Gated DeltaNet's, `layers/gated_deltanet.py`;
a Mamba layer's would be the same two arrays): one row per decode slot of the engine, preallocated, donated and
updated inside the jitted steps as the page pools are.

A step's rows name their slots (`AttentionMetadata.state_slots`; a row that is not live names one past the last
slot, so its write is dropped). A row whose first token is at position 0 starts from zeros: admission and
preemption by recompute need no clearing step, and a chunk after the first continues from what the previous chunk
left.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.distributed.tensor_parallel import MODEL_AXIS


@flax.struct.dataclass
class StateSlots:
    """One layer's states: the convolution's last inputs `[slots, channels, kernel - 1]` (the model's dtype) and the
    recurrent state `[slots, heads, ...]` (float32); channels and heads split over the model axis."""

    conv: jax.Array
    recurrent: jax.Array

    def read(self, slots: jax.Array, fresh: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The states of rows in `slots [B]` (zeros where `fresh [B]`: the row starts its sequence)."""
        def rows(pool: jax.Array) -> jax.Array:
            taken = jnp.take(pool, slots, axis=0, mode="clip")
            return jnp.where(fresh.reshape(-1, *(1,) * (pool.ndim - 1)), jnp.zeros((), pool.dtype), taken)
        return rows(self.conv), rows(self.recurrent)

    def write(self, slots: jax.Array, conv: jax.Array, recurrent: jax.Array) -> "StateSlots":
        """The pools with rows `slots [B]` replaced (slots past the pool: dropped)."""
        return StateSlots(conv=self.conv.at[slots].set(conv.astype(self.conv.dtype), mode="drop"),
                          recurrent=self.recurrent.at[slots].set(recurrent.astype(self.recurrent.dtype),
                                                                 mode="drop"))


def state_shardings(mesh) -> StateSlots:
    """Both pools split on their channels / heads axis (axis 1) over the model axis."""
    if mesh is None:
        return StateSlots(None, None)
    return StateSlots(conv=NamedSharding(mesh, P(None, MODEL_AXIS)), recurrent=NamedSharding(mesh, P(None, MODEL_AXIS)))

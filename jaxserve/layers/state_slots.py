"""Per-sequence state of the layers that keep one instead of KV pages (Gated DeltaNet's, `layers/gated_deltanet.py`;
a Mamba layer's would be the same two arrays): rows preallocated, donated and updated inside the jitted steps as the
page pools are. Each decode slot has one row, or under speculative decoding K + 1 (vLLM's approach): a verify step
writes the state after each of a row's tokens into its slot's rows, and the slot's state is the one after its last
accepted token (`SlotState.state_buffers`, `engine/steps.py`).

A step's rows name the state rows they read and write (`AttentionMetadata.state_slots`; a row that is not live
names one past every row, so its write is dropped). A row whose first token is at position 0 starts from zeros:
admission and preemption by recompute need no clearing step, and a chunk after the first continues from what the
previous chunk left.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.distributed.tensor_parallel import MODEL_AXIS


@flax.struct.dataclass
class StateSlots:
    """One layer's states: the convolution's last inputs `[rows, channels, kernel - 1]` (the model's dtype) and the
    recurrent state `[rows, heads, ...]` (float32); channels and heads split over the model axis. Under prefix
    caching, `saved_conv` / `saved_recurrent` hold the state checkpoints (`engine/state_checkpoints.py`): states
    saved at positions a later sequence with the same prefix may start from (else None)."""

    conv: jax.Array
    recurrent: jax.Array
    saved_conv: jax.Array | None = None
    saved_recurrent: jax.Array | None = None

    def read(self, slots: jax.Array, fresh: jax.Array, sources: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
        """The states in rows `slots [B]`: zeros where `fresh [B]` (the row starts its sequence), else the
        checkpoint `sources [B]` names (>= 0: a prefix hit's first chunk), else the slot's own."""
        def rows(pool: jax.Array, saved: jax.Array | None) -> jax.Array:
            shape = (-1, *(1,) * (pool.ndim - 1))
            taken = jnp.take(pool, slots, axis=0, mode="clip")
            if saved is not None and sources is not None:
                restored = jnp.take(saved, sources, axis=0, mode="clip")
                taken = jnp.where((sources >= 0).reshape(shape), restored, taken)
            return jnp.where(fresh.reshape(shape), jnp.zeros((), pool.dtype), taken)
        return rows(self.conv, self.saved_conv), rows(self.recurrent, self.saved_recurrent)

    def write(self, slots: jax.Array, conv: jax.Array, recurrent: jax.Array) -> "StateSlots":
        """The pools with rows `slots [B]` replaced (slots past the pool: dropped)."""
        return self.replace(conv=self.conv.at[slots].set(conv.astype(self.conv.dtype), mode="drop"),
                            recurrent=self.recurrent.at[slots].set(recurrent.astype(self.recurrent.dtype),
                                                                   mode="drop"))

    def save(self, ids: jax.Array, conv: jax.Array, recurrent: jax.Array) -> "StateSlots":
        """The checkpoints with rows `ids [N]` replaced by `conv [N, ...]` and `recurrent [N, ...]` (-1: none)."""
        ids = jnp.where(ids < 0, self.saved_recurrent.shape[0], ids)
        return self.replace(
            saved_conv=self.saved_conv.at[ids].set(conv.astype(self.saved_conv.dtype), mode="drop"),
            saved_recurrent=self.saved_recurrent.at[ids].set(recurrent.astype(self.saved_recurrent.dtype),
                                                             mode="drop"))


def state_shardings(mesh, checkpoints: bool = False) -> StateSlots:
    """The pools (and the checkpoints) split on their channels / heads axis (axis 1) over the model axis."""
    if mesh is None:
        return StateSlots(None, None)
    split = NamedSharding(mesh, P(None, MODEL_AXIS))
    return StateSlots(split, split, split if checkpoints else None, split if checkpoints else None)

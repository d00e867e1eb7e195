"""The LoRA contribution of a batch whose rows use different adapters (or none), for one linear.

Every adapter in the device stack is applied to every row and each row keeps its own: `x @ a` gives every slot's
`[rows, T, L, W]` low-rank activations at once, the mask zeroes all but the row's slot (all of them for a base-model
row, which then gets exactly zero), and one matmul over (slot, rank) expands them. With ranks and slot counts small
against the hidden size this costs `L * W / out` of the base matmul in each direction, with static shapes, no
gather of per-row weight copies, and under tensor parallelism `a` and `b` split like their base kernel
(`lora/weights.py`), so a row-parallel layer's partial sums are all-reduced like the base layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """`x [rows, T, in]`, `a [in, L, W]`, `b [L, W, out]`, `mask [rows, 1, L, 1]` (one-hot of each row's slot) ->
    each row's `x @ A[slot] @ B[slot]` `[rows, T, out]` in `x.dtype`, float32 accumulation."""
    low = jnp.einsum("bti,ilw->btlw", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    low = (low * mask).astype(x.dtype)
    return jnp.einsum("btlw,lwo->bto", low, b.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def lora_variables(stack: dict, row_slots: jax.Array, dtype) -> dict:
    """The forward's "lora" collection: every adapted linear's `a`, `b` and the rows' slot mask `[rows, 1, L, 1]`
    (row_slots int32 `[rows]`, -1: the base model, an all-zero mask row)."""
    num_loras = jax.tree.leaves(stack)[0].shape[1]
    mask = (row_slots[:, None, None, None] == jnp.arange(num_loras)[None, None, :, None]).astype(dtype)
    return jax.tree.map(lambda linear: {**linear, "mask": mask}, stack,
                        is_leaf=lambda node: isinstance(node, dict) and "a" in node)

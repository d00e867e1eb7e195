"""Pieces shared by the Triton-backend kernels.

Owns the version-tolerant import of Pallas' Triton API (``jax.experimental.
pallas.triton``: present in jax 0.10 and 0.11, deprecated in 0.11, maybe gone
later), the compiler-parameter constructor, and the in-kernel step both kernels
run per KV tile: gather the tile's pages through the page table, score, mask,
and update an online-softmax accumulator in float32.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._planning import MASK_VALUE

try:  # Importing may warn (deprecated in jax 0.11) or fail (future jax).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed jax
    pltriton = None

TRITON_AVAILABLE: bool = pltriton is not None


def compiler_params(num_warps: int, num_stages: int) -> Any:
    """Triton CompilerParams; passing them also selects the Triton backend on GPU."""
    if pltriton is None:  # pragma: no cover
        return None
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def require_backend(interpret: bool) -> None:
    if not interpret and pltriton is None:  # pragma: no cover
        raise RuntimeError(
            "this jax has no jax.experimental.pallas.triton; only interpret=True works"
        )


def masked_store(ref: Any, value: jax.Array, mask: jax.Array) -> None:
    """Stores ``value`` where ``mask`` holds; rows outside the mask keep their data."""
    if pltriton is not None:
        pltriton.store(ref, value, mask=mask)
    else:  # pragma: no cover - interpret-only fallback
        ref[...] = jnp.where(mask, value, ref[...])


def matmul(a: jax.Array, b: jax.Array, *, transpose_b: bool) -> jax.Array:
    """2-D matmul with float32 accumulation; float32 inputs use full (IEEE) precision.

    Triton's default for float32 is TF32, about 1e-3 relative error per product,
    so float32 asks for HIGHEST explicitly.
    """
    contract_b = 1 if transpose_b else 0
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def init_softmax_state(
    rows: int, head_dim: int, sinks: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(unnormalized output, running max, running denominator), all float32.

    With ``sinks`` (f32[rows], gpt-oss's attention sinks) each row starts as if it had seen one key of logit
    ``sinks[row]`` and value zero, which adds the sink to the softmax's denominator only.  A row given
    ``MASK_VALUE`` as its sink starts as without one: the first real key rescales that term to zero.
    """
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    if sinks is None:
        return acc, jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
    return acc, sinks.astype(jnp.float32), jnp.ones((rows,), jnp.float32)


def attend_kv_tile(
    state: tuple[jax.Array, jax.Array, jax.Array],
    q: jax.Array,
    page_ids: jax.Array,
    key_in_range: jax.Array,
    allowed: jax.Array,
    *,
    k_pages_ref: Any,
    v_pages_ref: Any,
    k_scales_ref: Any | None,
    v_scales_ref: Any | None,
    sm_scale: float,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax step over a KV tile of ``len(page_ids)`` whole pages; with ``soft_cap`` the scaled
    logits are capped as ``soft_cap * tanh(logit / soft_cap)`` (Gemma 2) before the mask.

    q: [rows, D] in the compute dtype; page_ids: int32[pages] (physical pages of
    the tile, in order); key_in_range: bool[tile] (the key slot holds real data
    of this sequence); allowed: bool[rows, tile] (this row may attend this key;
    must imply key_in_range).  k/v refs are one KV head's pool, [num_pages,
    page_size, D]; scale refs [num_pages, page_size] for int8 pools.

    Keys outside ``key_in_range`` may hold anything (NaN, stale data of other
    sequences): their logits are replaced, not multiplied, and their V rows and
    V scales are zeroed before the PV product.
    """
    acc, m_prev, l_prev = state
    rows, head_dim = q.shape
    tile = key_in_range.shape[0]
    k = k_pages_ref[page_ids].reshape(tile, head_dim)
    v = v_pages_ref[page_ids].reshape(tile, head_dim)
    v = jnp.where(key_in_range[:, None], v, jnp.zeros_like(v))

    logits = matmul(q, k.astype(q.dtype), transpose_b=True)  # [rows, tile] f32
    if k_scales_ref is not None:
        k_scale = k_scales_ref[page_ids].reshape(tile)
        logits = logits * k_scale[None, :]
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(allowed, logits, MASK_VALUE)

    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
    correction = jnp.exp(m_prev - m_next)
    probs = jnp.where(allowed, jnp.exp(logits - m_next[:, None]), 0.0)
    l_next = correction * l_prev + jnp.sum(probs, axis=1)
    if v_scales_ref is not None:
        v_scale = v_scales_ref[page_ids].reshape(tile)
        v_scale = jnp.where(key_in_range, v_scale, 0.0)
        probs = probs * v_scale[None, :]
    pv = matmul(probs.astype(q.dtype), v.astype(q.dtype), transpose_b=False)
    return correction[:, None] * acc + pv, m_next, l_next


def finish_softmax(
    state: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """Normalized output [rows, D] and log-sum-exp [rows]; empty rows give 0 and MASK_VALUE."""
    acc, m, l = state
    nonempty = l > 0.0
    safe_l = jnp.where(nonempty, l, 1.0)
    out = acc / safe_l[:, None]
    lse = jnp.where(nonempty, m + jnp.log(safe_l), MASK_VALUE)
    return out, lse


def ds(start: jax.Array | int, size: int) -> Any:
    return pl.ds(start, size)

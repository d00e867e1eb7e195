"""Plain jax.numpy references for the paged-attention kernels (gather + masked softmax).

These define the semantics the kernels must match and are the "xla" baseline in
benchmarks/kernel_bench.py.  They materialize gathered K/V copies, so they are for
checking and comparison, not for speed.  Masking replaces logits and zeroes V
rather than multiplying, so garbage (even NaN) in pages or slots a sequence does
not own never reaches the output; a sequence with no keys gives zeros.  Attention
sinks (gpt-oss) are one more logit per query head in each softmax, with no value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._planning import default_sm_scale


def _gather_kv(
    pages: jax.Array, scales: jax.Array | None, page_table: jax.Array
) -> jax.Array:
    """[kv_heads, num_pages, page_size, D] x int32[rows, pages_per_seq] -> f32[kv_heads, rows, keys, D]."""
    kv_heads, _, page_size, head_dim = pages.shape
    rows, pages_per_seq = page_table.shape
    kv = pages[:, page_table].astype(jnp.float32)
    if scales is not None:
        kv = kv * scales[:, page_table].astype(jnp.float32)[..., None]
    return kv.reshape(kv_heads, rows, pages_per_seq * page_size, head_dim)


def cap(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma 2's attention-logit soft-cap, ``soft_cap * tanh(logits / soft_cap)``; no cap when None."""
    return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)


def _attend(logits: jax.Array, mask: jax.Array, v: jax.Array, sinks: jax.Array | None, equation: str) -> jax.Array:
    """Masked softmax of ``logits [..., heads, group, keys]`` (with a sink logit per query head when given,
    ``sinks: [heads, group]``) times ``v`` by ``equation``; a row with no keys gives zeros."""
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)[..., None]
        row_max = jnp.maximum(row_max, sinks)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - row_max)
    out = jnp.einsum(equation, probs, v, precision=lax.Precision.HIGHEST)
    return out / jnp.where(denom > 0, denom, 1.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention, same contract as ``pallas_kernels.paged_attention``."""
    batch, num_q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    group = num_q_heads // kv_heads
    scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale

    k = _gather_kv(k_pages, k_scales, page_indices)  # [kv_heads, batch, keys, D]
    v = _gather_kv(v_pages, v_scales, page_indices)
    keys = k.shape[2]
    pos = jnp.arange(keys, dtype=jnp.int32)
    lengths = lengths.astype(jnp.int32)
    valid = pos[None, :] < lengths[:, None]  # [batch, keys]
    if sliding_window is not None:
        valid &= pos[None, :] >= lengths[:, None] - sliding_window

    qg = q.astype(jnp.float32).reshape(batch, kv_heads, group, head_dim)
    logits = cap(jnp.einsum("bhgd,hbkd->bhgk", qg, k, precision=lax.Precision.HIGHEST) * scale, soft_cap)
    v = jnp.where(valid[None, :, :, None], v, 0.0)
    sink_logits = None if sinks is None else sinks.reshape(kv_heads, group)
    out = _attend(logits, valid[:, None, None, :], v, sink_logits, "bhgk,hbkd->bhgd")
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    query_limits: jax.Array | None = None,
) -> jax.Array:
    """Ragged prefill/extend attention, same contract as ``pallas_kernels.ragged_paged_attention``.

    ``query_limits`` (int32[num_tokens], ragged like q): the last key position each query sees (at least its own;
    Gemma 3's image tokens see their whole image); None: its own position (causal).

    Loops (``lax.scan``) over sequences; each step attends all tokens to one
    sequence's keys and keeps the rows that belong to it.  Rows of the padded
    tail (and of inactive sequences) come out 0.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    group = num_q_heads // kv_heads
    scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    max_seqs = kv_lens.shape[0]
    n = jnp.reshape(jnp.asarray(num_seqs), (-1,))[0].astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    qg = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    sink_logits = None if sinks is None else sinks.reshape(kv_heads, group)

    def one_sequence(out: jax.Array, s: jax.Array) -> tuple[jax.Array, None]:
        table = lax.dynamic_slice_in_dim(page_indices, s, 1, axis=0)
        k = _gather_kv(k_pages, None if k_scales is None else k_scales, table)[:, 0]
        v = _gather_kv(v_pages, None if v_scales is None else v_scales, table)[:, 0]
        keys = k.shape[1]
        q_start, q_end = cu[s], cu[s + 1]
        kv_len = kv_lens[s].astype(jnp.int32)
        mine = (token >= q_start) & (token < q_end) & (s < n)  # [tokens]
        q_pos = kv_len - (q_end - q_start) + (token - q_start)
        limit = q_pos if query_limits is None else query_limits.astype(jnp.int32)
        key_pos = jnp.arange(keys, dtype=jnp.int32)
        valid = (key_pos[None, :] <= limit[:, None]) & (key_pos[None, :] < kv_len)
        if sliding_window is not None:
            valid &= key_pos[None, :] > q_pos[:, None] - sliding_window
        valid &= mine[:, None]  # [tokens, keys]
        logits = cap(jnp.einsum("thgd,hkd->thgk", qg, k, precision=lax.Precision.HIGHEST) * scale, soft_cap)
        v = jnp.where((key_pos < kv_len)[None, :, None], v, 0.0)
        o = _attend(logits, valid[:, None, None, :], v, sink_logits, "thgk,hkd->thgd")
        return out + jnp.where(mine[:, None, None, None], o, 0.0), None

    out0 = jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32)
    out, _ = lax.scan(one_sequence, out0, jnp.arange(max_seqs, dtype=jnp.int32))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

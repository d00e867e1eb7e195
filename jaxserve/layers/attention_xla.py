"""The `xla` attention backend: paged attention in plain jax.numpy, the default on CPU and the fallback anywhere.

New K/V go in by an XLA scatter (`paged_kv.scatter_kv`). Queries read the pages blockwise with an online softmax
(flash attention in plain XLA): a `fori_loop` over each row's key blocks in use, each head's keys contracted without
transposing them. Quantized pools are read as stored, their per-token scales applied per key block, so the whole pool
is never dequantized. Attention sinks (gpt-oss) start each query's online softmax: a logit with no value.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.layers.paged_kv import AttentionMetadata, KVPages, QuantizedPages, scatter_kv


@dataclasses.dataclass(frozen=True)
class XlaAttention:
    """Paged attention in plain XLA (see the module docstring); one device's heads per call."""

    name: str = "xla"

    def write_kv(self, kv: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                 kv_cache_dtype: str) -> KVPages:
        return scatter_kv(kv, k, v, slot_mapping, kv_cache_dtype=kv_cache_dtype)

    def attend(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
               sliding_window: int | None, soft_cap: float | None, sinks: jax.Array | None) -> jax.Array:
        return xla_paged_attention(q, kv, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap, sinks=sinks)


DECODE_BLOCK_TOKENS = 32  # keys per loop iteration for one query token: the fastest block size measured on CPU
PREFILL_BLOCK_TOKENS = 128  # with many query tokens per row a block has more work, so fewer, larger blocks


def xla_paged_attention(q, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float, sliding_window: int | None,
                        soft_cap: float | None = None, sinks: jax.Array | None = None,
                        value_dim: int | None = None, expand: Callable | None = None) -> jax.Array:
    """Causal attention blockwise over each row's pages with an online softmax (flash attention in plain XLA).
    A cache with no V pool (MLA) reads each key's first `value_dim` dims as its value: the output is
    `[B, T, q_heads, value_dim]`. With `expand` (MLA decompressed) each block of the one latent pool's rows,
    `[1, B, block, width]`, becomes every query head's own keys and values, `([q_heads, B, block, head_dim],
    [q_heads, B, block, value_dim])`, attended as multi-head attention.

    The loop runs only as many key blocks as the longest context in the batch needs and never
    materializes a sequence's whole K/V, which on CPU beats both one gather of all pages (decode) and
    attending to every page (prefill); figures in benchmarks/RESULTS.md.
    """
    batch, num_tokens, num_q_heads, head_dim = q.shape
    k_pool, v_pool = kv.k, kv.v
    value_dim = head_dim if v_pool is not None or value_dim is None else value_dim
    num_kv_heads, _, page_size, _ = k_pool.shape
    num_kv_heads = num_q_heads if expand is not None else num_kv_heads
    quantized = isinstance(k_pool, QuantizedPages)
    group = num_q_heads // num_kv_heads
    target_tokens = DECODE_BLOCK_TOKENS if num_tokens == 1 else PREFILL_BLOCK_TOKENS
    pages_per_block = max(1, target_tokens // page_size)
    block_tokens = pages_per_block * page_size
    page_tables = meta.page_tables
    padding = -page_tables.shape[1] % pages_per_block
    if padding:  # every block slice must stay inside the table (extra entries point at the scratch page)
        page_tables = jnp.pad(page_tables, ((0, 0), (0, padding)))
    query = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    query = query.astype(jnp.float32) * sm_scale  # [B, K, G, T, D]
    query_pos = meta.positions[:, None, None, :, None]  # against key positions [..., block]
    query_limit = query_pos if meta.query_limits is None else meta.query_limits[:, None, None, :, None]
    context_lens = meta.context_lens[:, None, None, None, None]
    real_query = (jnp.arange(num_tokens) < meta.query_lens[:, None])[:, None, None, :, None]  # padding sees nothing
    num_blocks = (jnp.max(meta.context_lens) + block_tokens - 1) // block_tokens

    def block(index, carry):
        running_max, denominator, accumulator = carry
        pages = jax.lax.dynamic_slice_in_dim(page_tables, index * pages_per_block, pages_per_block, axis=1)
        keys = key_block(k_pool, pages, block_tokens)
        if expand is not None:
            keys, values = expand(keys)
        else:
            values = keys[..., :value_dim] if v_pool is None else key_block(v_pool, pages, block_tokens)
        key_pos = index * block_tokens + jnp.arange(block_tokens)
        # Slots past a row's context (the scratch page, pages it does not own) may hold anything, even NaN or
        # inf: zero their values, since a zero probability times NaN would still be NaN. Inside the context
        # every slot holds this row's own keys, so masking the scores of invisible ones there is enough.
        in_context = key_pos < meta.context_lens[:, None]  # [B, block]
        values = jnp.where(in_context[None, :, :, None], values, 0)
        scores = jnp.einsum("kbsd,bkgtd->bkgts", keys, query, preferred_element_type=jnp.float32)
        if quantized:  # per-key scales applied to the scores and the probabilities, as the Pallas kernels do
            k_scales = key_block_scales(k_pool, pages, block_tokens)
            v_scales = jnp.where(in_context[None], key_block_scales(v_pool, pages, block_tokens), 0.0)
            scores = scores * k_scales.transpose(1, 0, 2)[:, :, None, None, :]
        if soft_cap is not None:  # Gemma 2's attention-logit soft-cap: cap * tanh(score / cap), before the mask
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        visible = (key_pos <= query_limit) & (key_pos < context_lens) & real_query
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
        probs = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(running_max - safe_max)
        denominator = denominator * rescale + jnp.sum(probs, axis=-1)
        if quantized:
            probs = probs * v_scales.transpose(1, 0, 2)[:, :, None, None, :]
        accumulator = accumulator * rescale[..., None] + jnp.einsum(
            "bkgts,kbsd->bkgtd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return new_max, denominator, accumulator

    stats_shape = (batch, num_kv_heads, group, num_tokens)
    if sinks is None:
        running_max, denominator = jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32)
    else:  # as if each query had seen one key of the sink's logit and value zero
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        running_max, denominator = jnp.broadcast_to(sink, stats_shape), jnp.ones(stats_shape, jnp.float32)
    init = (running_max, denominator, jnp.zeros(stats_shape + (value_dim,), jnp.float32))
    _, denominator, accumulator = jax.lax.fori_loop(0, num_blocks, block, init)
    out = accumulator / jnp.maximum(denominator, 1e-30)[..., None]  # a query with no keys (padding) gives zeros
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_tokens, num_q_heads, value_dim).astype(q.dtype)


def key_block(pool, pages: jax.Array, block_tokens: int) -> jax.Array:
    """The keys (or values) of one block of pages, `[kv_heads, B, block_tokens, head_dim]`: stored values
    converted to float32 (exact for int8 and fp8) when the pool is quantized; the scales are applied apart."""
    num_kv_heads, _, _, head_dim = pool.shape
    if isinstance(pool, QuantizedPages):
        return pool.values[:, pages].reshape(num_kv_heads, -1, block_tokens, head_dim).astype(jnp.float32)
    return pool[:, pages].reshape(num_kv_heads, -1, block_tokens, head_dim)


def key_block_scales(pool: QuantizedPages, pages: jax.Array, block_tokens: int) -> jax.Array:
    """The per-token scales of one block of pages, `[kv_heads, B, block_tokens]`."""
    return pool.scales[:, pages].reshape(pool.shape[0], -1, block_tokens)

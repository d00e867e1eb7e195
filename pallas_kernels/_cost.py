"""What a kernel call costs, for `pl.pallas_call(cost_estimate=...)`: XLA cannot see into a kernel, so its cost
model (the TPU compiler's `optimal_seconds`, the schedulers) counts what the kernel says here.

Attention is counted from static shapes with the context bound by the padded page table (every row as long as
its table allows, or as a sliding window lets it see): a kernel's real work is at most this.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def nbytes(*arrays) -> int:
    """Bytes of arrays or ShapeDtypeStructs."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in arrays)


def visible_keys(context: int, sliding_window: int | None, query_tokens: int, block_tokens: int) -> int:
    """Keys a block of `query_tokens` consecutive queries reads at most: the padded context, or the window plus
    the block's span, rounded out to whole KV blocks."""
    if sliding_window is None:
        return context
    span = sliding_window + query_tokens - 1
    return min(context, (-(-span // block_tokens) + 1) * block_tokens)


def attention_cost(*, query_rows: int, keys: int, head_dim: int, kv_bytes_per_key: int, kv_reads: int,
                   io_bytes: int, soft_cap: bool = False) -> pl.CostEstimate:
    """`query_rows` matmul rows (tokens x query heads, as the kernel pads them) each scoring `keys` keys and
    summing as many values (`Q K^T` and `P V`: 4 flops per key and head_dim element), one exp per score (and a
    tanh with `soft_cap`); `kv_reads` keys read from HBM at `kv_bytes_per_key` (K and V, with their scales), plus
    `io_bytes` of queries, outputs and tables."""
    scores = query_rows * keys
    return pl.CostEstimate(flops=4 * scores * head_dim, transcendentals=scores * (2 if soft_cap else 1),
                           bytes_accessed=kv_reads * kv_bytes_per_key + io_bytes)


def kv_bytes_per_key(head_dim: int, kv_dtype, quantized: bool) -> int:
    """HBM bytes of one key's K and V (and their float32 scales)."""
    return 2 * head_dim * jnp.dtype(kv_dtype).itemsize + (8 if quantized else 0)

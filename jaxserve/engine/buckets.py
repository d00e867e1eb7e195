"""The padded sizes compiled steps take: a size's bucket, the power-of-two ladders between two sizes, and the
prefill chunk whose bucket fits a token budget (host only, no jax)."""

from __future__ import annotations


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... up to and including `largest` (which need not be a power of two)."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    buckets.append(largest)
    return tuple(buckets)


def chunk_fitting(remaining: int, budget: int, buckets: tuple[int, ...]) -> int:
    """The tokens of a prefill chunk (of at most `remaining`) whose length bucket fits `budget` (0: none fits)."""
    num_tokens = min(remaining, budget)
    if num_tokens <= 0 or budget < buckets[0]:
        return 0
    if bucket_for(num_tokens, buckets) > budget:  # take the largest bucket that fits, whole
        return max(bucket for bucket in buckets if bucket <= budget)
    return num_tokens


def bucket_for(size: int, buckets: tuple[int, ...]) -> int:
    """The smallest of `buckets` (ascending) that holds `size`."""
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")

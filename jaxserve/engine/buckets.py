"""The padded sizes compiled steps take: a size's bucket, and the power-of-two ladders between two sizes (host
only, no jax)."""

from __future__ import annotations


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... up to and including `largest` (which need not be a power of two)."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    buckets.append(largest)
    return tuple(buckets)


def bucket_for(size: int, buckets: tuple[int, ...]) -> int:
    """The smallest of `buckets` (ascending) that holds `size`."""
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")

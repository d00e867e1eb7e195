"""Shared timing helpers for jaxserve benchmarks.

Owns: waiting for asynchronous jax results (``block_until_ready`` on any
pytree), timing a jitted callable (warm-up calls that absorb compilation, then
the median of repeated samples, each sample averaging enough back-to-back calls
to drown Python dispatch overhead), measuring the device's copy bandwidth with a
jitted copy of a large array, and a short description of the device.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def block_until_ready(tree: Any) -> Any:
    """Waits for every jax array in ``tree``; returns ``tree``."""
    return jax.block_until_ready(tree)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: median / min / max over samples, plus how they were taken."""

    median_s: float
    min_s: float
    max_s: float
    samples: int
    calls_per_sample: int

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def time_fn(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 2,
    repeats: int = 10,
    min_sample_s: float = 0.005,
    max_calls_per_sample: int = 1000,
) -> Timing:
    """Times ``fn(*args)`` (normally a jitted function) in seconds per call.

    ``warmup`` calls first (compilation, autotuning, allocator warm-up), then
    ``repeats`` samples.  Each sample runs ``n`` calls back to back and blocks
    once at the end, with ``n`` chosen so a sample lasts at least
    ``min_sample_s``; the reported figure is the median of sample / n.
    """
    for _ in range(max(1, warmup)):
        block_until_ready(fn(*args))
    start = time.perf_counter()
    block_until_ready(fn(*args))
    single = max(time.perf_counter() - start, 1e-7)
    calls = int(min(max_calls_per_sample, max(1, math.ceil(min_sample_s / single))))

    per_call = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        block_until_ready(out)
        per_call.append((time.perf_counter() - start) / calls)
    return Timing(
        median_s=statistics.median(per_call),
        min_s=min(per_call),
        max_s=max(per_call),
        samples=len(per_call),
        calls_per_sample=calls,
    )


def measure_copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a jitted copy of a ``num_bytes`` array.

    Counts bytes read plus bytes written (2 * num_bytes per call), the figure
    to compare with a kernel's bytes moved per second.  The copy is ``x + 1``
    (so XLA cannot elide it) with the input donated, so every call reuses the
    same buffer instead of faulting in fresh memory.
    """
    elements = max(1, num_bytes // 4)
    copy = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    buf = block_until_ready(copy(jnp.zeros((elements,), jnp.float32)))
    for _ in range(2):
        buf = block_until_ready(copy(buf))
    start = time.perf_counter()
    buf = block_until_ready(copy(buf))
    calls = max(1, math.ceil(0.02 / max(time.perf_counter() - start, 1e-7)))
    per_call = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(calls):
            buf = copy(buf)
        block_until_ready(buf)
        per_call.append((time.perf_counter() - start) / calls)
    del buf
    return 2.0 * elements * 4 / statistics.median(per_call)


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device memory read bandwidth in bytes/s from a jitted sum over a ``num_bytes`` array.

    Counts bytes read only: the figure for work that streams data in and writes next to nothing, such as a
    decode step reading the weights and the KV cache (on the 2-core CPU: ~29 GB/s, about half the copy
    figure, which counts a read and a write per byte).
    """
    data = jnp.ones((max(1, num_bytes // 4),), jnp.float32)
    timing = time_fn(jax.jit(jnp.sum), data, warmup=2, repeats=repeats, min_sample_s=0.02)
    return data.size * 4 / timing.median_s


def device_summary() -> dict[str, Any]:
    """Backend, device kind and count, jax/jaxlib versions."""
    import jaxlib

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }

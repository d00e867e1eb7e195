"""What a benchmark ran on, for its result file: CPU model, usable cores, memory, Python, load, accelerators."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask), falling back to os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info(include_jax: bool = True) -> dict[str, Any]:
    """The host (and, with `include_jax`, its jax devices); imports jax only when asked."""
    info: dict[str, Any] = {"cpu": cpu_model(), "cores": usable_cores(), "memory_gib": memory_gib(),
                            "load_average_1_5_15": load_average(), "python": platform.python_version()}
    if include_jax:
        import jax
        import jaxlib

        devices = jax.devices()
        info.update(backend=jax.default_backend(), device=devices[0].device_kind, device_count=len(devices),
                    jax=jax.__version__, jaxlib=jaxlib.__version__)
    for module in ("torch", "transformers"):
        if module in sys.modules:
            info[module] = sys.modules[module].__version__
    return info

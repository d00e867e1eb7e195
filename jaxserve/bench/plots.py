"""`jaxserve bench serve --plot`: one PNG of a run (matplotlib, Agg): the TTFT and ITL distributions, and output
tokens per second with the requests in flight over the run's time."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from jaxserve.bench.metrics import RequestResult, output_timeline, percentile


def draw_serving(results: Sequence[RequestResult], path: str | Path, title: str) -> Path:
    """Three panels of one run's successful requests; returns the PNG's path. ImportError names matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    ttft_ms = np.array([r.ttft for r in done]) * 1000.0
    itl_ms = np.array([gap for r in done for gap in r.itl]) * 1000.0
    chunks, active = output_timeline(results)
    fig, (ax_ttft, ax_itl, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, values, name in ((ax_ttft, ttft_ms, "TTFT"), (ax_itl, itl_ms, "ITL")):
        if values.size:
            ax.hist(values, bins=min(50, max(5, values.size // 4)), color="tab:blue", alpha=0.8)
            for p, style in ((50, "--"), (99, ":")):
                ax.axvline(percentile(values, p), color="black", linestyle=style, label=f"p{p}")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        ax.grid(True, alpha=0.3)
    seconds = np.arange(len(chunks))
    ax_time.plot(seconds, chunks, color="tab:blue", label="output tokens/s")
    ax_time.set_xlabel("time since the first request (s)")
    ax_time.set_ylabel("output tokens / s")
    ax_time.grid(True, alpha=0.3)
    in_flight = ax_time.twinx()
    in_flight.step(seconds, active, where="post", color="tab:orange", label="requests in flight")
    in_flight.set_ylabel("requests in flight")
    fig.legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

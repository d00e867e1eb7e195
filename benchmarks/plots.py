"""The research benchmarks' plots (matplotlib, Agg backend, PNG): throughput vs concurrency and %
of roofline (`jaxserve bench serve --plot` draws its own: jaxserve/bench/plots.py).

Owns only drawing; the scripts that measure call these functions with numbers they already have. Run as a
script to redraw every plot from result JSON files:

    python benchmarks/plots.py benchmarks/results/roofline.json benchmarks/results/throughput-prompts.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Mapping, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_vs_concurrency(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path,
                              title: str) -> Path:
    """One line per series of (concurrency, output tok/s) points, log2 x axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(ticks, [str(int(t)) if float(t).is_integer() else str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def roofline_percentage(points: Sequence[tuple[int, float]], path: str | Path, title: str) -> Path:
    """Bars of % of the roofline floor reached per decode batch size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = [str(b) for b, _ in points]
    values = [pct for _, pct in points]
    bars = ax.bar(labels, values, color="tab:blue")
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.0f}%", (bar.get_x() + bar.get_width() / 2, value), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("% of roofline (floor time / measured step time)")
    ax.set_ylim(0, max(100.0, max(values, default=0) * 1.15))
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def redraw(result_file: str | Path) -> list[Path]:
    """Draws the plots a result JSON supports next to it; returns the PNG paths."""
    from benchmarks import common

    data = common.read_result(result_file)
    base = Path(result_file).with_suffix("")
    label = common.machine_label(data["machine"])
    drawn = []
    if data.get("benchmark") == "roofline" and data.get("points"):
        drawn.append(roofline_percentage([(p["batch"], p["percent_of_roofline"]) for p in data["points"]],
                                         f"{base}.png", f"{data['model']}, ctx {data['context']}, {label}"))
    if str(data.get("benchmark", "")).startswith("throughput") and data.get("closed_loop_sweep"):
        sweep = data["closed_loop_sweep"]
        drawn.append(throughput_vs_concurrency(
            {"offline closed loop": [(p["concurrency"], p["output_throughput"]) for p in sweep]},
            f"{base}.png", f"jaxserve offline, {data['model']}, {label}"))
    return drawn


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Redraw benchmark plots from result JSON files.")
    parser.add_argument("result_files", nargs="+")
    args = parser.parse_args(argv)
    for result_file in args.result_files:
        for png in redraw(result_file):
            print(png)


if __name__ == "__main__":
    main()

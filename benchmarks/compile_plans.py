"""`jaxserve compile` over published model shapes and targets: each one's memory plan, compile seconds and (TPU)
the compiler's estimated decode step against the bandwidth roofline. Estimates, never measurements.

    python benchmarks/compile_plans.py --shapes llama-3.1-8b qwen3-30b-a3b gpt-oss-20b --targets h200 v6e-8 v5e-8

Each (shape, target) runs `jaxserve compile` in its own process on a config.json of the shape
(`benchmarks/random_model.py`), with tensor parallelism over all of the target's devices, and keeps its JSON.
The roofline of a decode step is the bytes one device must read (its weights, and the KV pages of every row at
`--context` tokens) over the chip's memory bandwidth; the compiler's `optimal_seconds` counts our kernels' cost
estimates, which assume every row reads its whole page table (max_model_len), so at a short context the estimate
sits above the roofline. Writes benchmarks/results/compile_plans.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO_ROOT, format_table, write_result  # noqa: E402
from benchmarks.random_model import write_config  # noqa: E402

DECODE_ROWS = (1, 64, 256)
ENGINE = ["--max-num-seqs", "256", "--max-model-len", "8192", "--max-num-batched-tokens", "2048"]


def compile_plan(shape: str, target: str, folder: Path, jobs: int, steps: str | None = None) -> dict:
    """`jaxserve compile`'s JSON for the shape on the target, TP over all of its devices (only `steps`, comma-
    separated, when given)."""
    from jaxserve.aot.targets import target as target_named

    model = write_config(folder / shape, shape)
    out = folder / f"{shape}_{target}.json"
    devices = target_named(target).num_devices
    command = [sys.executable, "-m", "jaxserve", "compile", "--target", target, "--model", model, "-tp",
               str(devices), "--jobs", str(jobs), "--output-json", str(out), *ENGINE,
               *(["--steps", steps] if steps else [])]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if not out.exists():
        return {"shape": shape, "target": target, "error": f"exit {run.returncode}: "
                + (run.stderr.strip().splitlines() or ["?"])[-1]}
    return {"shape": shape, **json.loads(out.read_text())}


def decode_roofline(plan: dict, rows: int, context: int, kv_bytes_per_token: float) -> float:
    """Seconds one device needs at its memory bandwidth to read its weights and `rows` rows of `context` tokens."""
    from jaxserve.aot.targets import target as target_named

    bandwidth = target_named(plan["target"]).chip.hbm_bandwidth
    return (plan["weights_bytes_per_device"] + rows * context * kv_bytes_per_token) / bandwidth


def summary(plans: list[dict], context: int) -> list[list]:
    rows = []
    for plan in plans:
        if "error" in plan:
            rows.append([plan["shape"], plan["target"], plan["error"]] + [None] * (7 + len(DECODE_ROWS)))
            continue
        per_token = plan["kv_cache_bytes_per_device"] / max(plan["kv_cache_tokens"], 1)
        decode = {step["shape"]: step for step in plan["steps"] if step["name"] == "decode"}
        estimates = []
        for batch in DECODE_ROWS:
            step = decode.get(f"rows={batch}", {})
            estimate, roof = step.get("estimated_seconds"), decode_roofline(plan, batch, context, per_token)
            estimates.append(f"{estimate * 1e3:.2f} / {roof * 1e3:.2f}" if estimate else f"- / {roof * 1e3:.2f}")
        rows.append([plan["shape"], plan["target"], "fits" if plan["fits"] else "DOES NOT FIT",
                     plan["weights_bytes_per_device"] / 2**30, plan["kv_cache_bytes_per_device"] / 2**30,
                     plan["kv_cache_tokens"], plan["peak_bytes_per_device"] / 2**30, len(plan["steps"]),
                     plan["compile_seconds"], plan["compile_wall_seconds"], *estimates])
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b"])
    parser.add_argument("--targets", nargs="+", default=["h200", "v6e-8", "v5e-8"])
    parser.add_argument("--jobs", type=int, default=1, help="threads compiling at once (1: the sum is exact)")
    parser.add_argument("--context", type=int, default=8192,
                        help="tokens per row for the roofline (default max-model-len, as the kernels' estimates)")
    parser.add_argument("--steps", default=None, metavar="NAMES",
                        help="only these steps, comma-separated (default: all; the plan's peak then covers these)")
    parser.add_argument("--result-file", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    plans = []
    with tempfile.TemporaryDirectory(prefix="jaxserve-plans-") as folder:
        for shape in args.shapes:
            for target in args.targets:
                plans.append(compile_plan(shape, target, Path(folder), args.jobs, args.steps))
                print(f"{shape} on {target}: {plans[-1].get('verdict', plans[-1].get('error'))}", flush=True)
    headers = ["shape", "target", "plan", "weights GiB", "KV GiB", "KV tokens", "peak GiB", "shapes", "compile s",
               "wall s", *(f"decode {b} est./roof ms" for b in DECODE_ROWS)]
    write_result("compile_plans", {"engine": ENGINE, "context": args.context, "plans": plans}, args.result_file, argv)
    print(format_table(headers, summary(plans, args.context)))
    return plans


if __name__ == "__main__":
    main()

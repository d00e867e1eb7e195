"""What prompt scoring costs: for each prefill shape, the seconds of the first call (compile + one run) of the plain
and the scoring prefill (`prefill_scores_step`, compiled at start-up too) and the median seconds of later calls.

    python benchmarks/prompt_scoring.py --max-num-batched-tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    import jax

    from jaxserve import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=16, warmup=False, compilation_cache_dir=None)
    runner = llm.llm_engine.runner
    print("| rows x tokens | first call plain (s) | first call scoring (s) | call plain (ms) | call scoring (ms) |")
    print("|---|---|---|---|---|")
    totals = [0.0, 0.0]
    by_shape: dict[tuple, dict[str, tuple[float, float]]] = {}
    for kind, inputs in runner.example_inputs():
        if kind not in ("prefill", "prefill_scores"):
            continue
        shape = inputs[0].shape
        started = time.perf_counter()
        runner.replay(kind, inputs)
        jax.block_until_ready(runner.kv_cache)
        compile_seconds = time.perf_counter() - started
        times = []
        for _ in range(args.repeats):
            jax.block_until_ready(runner.kv_cache)
            started = time.perf_counter()
            runner.replay(kind, inputs)
            jax.block_until_ready(runner.kv_cache)
            times.append(time.perf_counter() - started)
        by_shape.setdefault(shape, {})[kind] = (compile_seconds, statistics.median(times))
    for shape, kinds in by_shape.items():
        (cp, tp), (cs, ts) = kinds["prefill"], kinds["prefill_scores"]
        totals[0] += cp
        totals[1] += cs
        print(f"| {shape[0]} x {shape[1]} | {cp:.1f} | {cs:.1f} | {tp * 1e3:.0f} | {ts * 1e3:.0f} |")
    print(f"| all | {totals[0]:.1f} | {totals[1]:.1f} | | |")


if __name__ == "__main__":
    main()

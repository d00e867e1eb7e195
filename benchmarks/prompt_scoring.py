"""What prompt scoring costs: for each prefill shape, the seconds of the first call (compile + one run) of the prefill
and of the scoring step that follows a prefill holding a scoring chunk (`prompt_scores_step`: the LM head over every
position, log-softmax, rank, top 20; compiled at start-up too), and the median milliseconds of later calls of each.

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

    def timed(kind: str, inputs: tuple) -> tuple[float, float]:
        """(seconds of the first call, median seconds of the next `repeats`)."""
        seconds = []
        for _ in range(1 + args.repeats):
            started = time.perf_counter()
            if kind == "score":  # reads the params only
                step = runner.steps["score"]
                jax.block_until_ready(step.fn(*step.state(), inputs))
            else:  # donates the pool: run keeps the runner's state current
                runner.steps.run(kind, inputs)
                jax.block_until_ready(runner.kv_cache)
            seconds.append(time.perf_counter() - started)
        return seconds[0], statistics.median(seconds[1:])

    print("| rows x tokens | first call prefill (s) | first call scoring (s) | prefill (ms) | scoring (ms) |")
    print("|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for prefill, score in zip(runner.steps["prefill"].examples(), runner.steps["score"].examples()):
        (first_prefill, prefill_seconds), (first_score, score_seconds) = timed("prefill", prefill), timed("score", score)
        totals[0] += first_prefill
        totals[1] += first_score
        rows, tokens = prefill.token_ids.shape
        print(f"| {rows} x {tokens} | {first_prefill:.1f} | {first_score:.1f} | {prefill_seconds * 1e3:.0f} | "
              f"{score_seconds * 1e3:.0f} |")
    print(f"| all | {totals[0]:.1f} | {totals[1]:.1f} | | |")


if __name__ == "__main__":
    main()

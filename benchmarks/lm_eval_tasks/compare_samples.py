"""Compares two lm-eval runs' `--log_samples` files task by task: the largest difference of a loglikelihood, how
many is_greedy flags and generated answers differ, and each run's metric.

    python benchmarks/lm_eval_tasks/compare_samples.py RUN_A_DIR RUN_B_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def samples(run: Path) -> dict[str, dict[int, dict]]:
    """task -> doc_id -> sample, from the newest samples file of each task under `run`."""
    found: dict[str, Path] = {}
    for path in sorted(run.rglob("samples_*.jsonl")):
        found[path.name[len("samples_"):].rsplit("_", 1)[0]] = path
    return {task: {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}
            for task, path in found.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    a, b = samples(args.run_a), samples(args.run_b)
    for task in sorted(set(a) & set(b)):
        docs = sorted(set(a[task]) & set(b[task]))
        diffs, greedy, answers, metric = [], 0, 0, None
        for doc in docs:
            sa, sb = a[task][doc], b[task][doc]
            metric = next(m for m in ("acc", "exact_match") if m in sa)
            for ra, rb in zip(sa["filtered_resps"], sb["filtered_resps"]):
                if isinstance(ra, list):  # loglikelihood: [logprob, is_greedy]
                    diffs.append(abs(float(ra[0]) - float(rb[0])))
                    greedy += ra[1] != rb[1]
                else:
                    answers += ra != rb
        mean = lambda run: sum(run[task][d][metric] for d in docs) / len(docs)  # noqa: E731
        line = f"{task}: {len(docs)} docs, {metric} {mean(a):.4f} vs {mean(b):.4f}"
        if diffs:
            line += f", {len(diffs)} loglikelihoods: max |diff| {max(diffs):.2e}, is_greedy differs {greedy}"
        else:
            line += f", generated answers differ: {answers}"
        print(line)


if __name__ == "__main__":
    main()

"""Multi-turn conversations whose prefixes outgrow the device KV pool: what the host and disk tiers save.

`--num-conversations` conversations of `--turns` turns, each with its own document of `--doc-len` random tokens as
its system prompt; every turn appends `--user-len` user tokens to the conversation so far (document, earlier
turns, earlier answers) and asks for `--output-len` greedy tokens (EOS ignored). Turns go round the conversations
(every conversation's turn 1, then every turn 2, ...), one request at a time, so a later turn finds its prefix
only if the pool, or a tier, kept it since that conversation's previous turn. The device pool is
`--num-kv-pages` pages: by default a quarter of the working set (every conversation's final length).

Modes, each a fresh engine over the same workload: `off` (no tiers: an evicted prefix is recomputed), `host`
(`kv_offloading_size`), `host+disk` (and `kv_offloading_dir`, a fresh directory), `restart` (a new engine over the
`host+disk` run's directory, with an empty host tier: its first turns find their documents on disk). Reported per
mode: TTFT p50/p90 of the later turns (2 and on; for `restart`, of every turn too), prompt tokens computed
(prefilled, not served from a cache), and whether every answer equals the `off` run's.

    python benchmarks/multi_turn.py                                  # 8 conversations x 3 turns, 768-token docs
    python benchmarks/multi_turn.py --modes off host --turns 4
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench.metrics import percentile

NAME = "multi_turn"
MODES = ("off", "host", "host+disk", "restart")


def workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's document, and its user tokens per turn (random ids, away from the special tokens)."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    docs = [rng.integers(100, vocab_size, args.doc_len).tolist() for _ in range(args.num_conversations)]
    users = [[rng.integers(100, vocab_size, args.user_len).tolist() for _ in range(args.turns)]
             for _ in range(args.num_conversations)]
    return docs, users


def final_len(args: argparse.Namespace) -> int:
    """A conversation's length after its last turn (the engine's max_model_len)."""
    return args.doc_len + args.turns * (args.user_len + args.output_len)


def pool_pages(args: argparse.Namespace) -> int:
    """A quarter of the working set (every conversation's final length), in pages, plus the scratch page."""
    return args.num_kv_pages or max(-(-final_len(args) // args.page_size) + 1,
                                    args.num_conversations * final_len(args) // (4 * args.page_size) + 1)


def run_mode(mode: str, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import LLM, SamplingParams

    options = dict(common.engine_options(args), num_kv_pages=pool_pages(args), max_num_seqs=1,
                   max_model_len=final_len(args))
    if mode != "off":
        options["kv_offloading_size"] = 0.0 if mode == "restart" else args.kv_offloading_size
    if mode in ("host+disk", "restart"):
        options["kv_offloading_dir"] = directory
    llm = LLM(**options)
    docs, users = workload(args, llm.llm_engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    history = [list(doc) for doc in docs]
    ttft, computed, answers = {}, {}, []
    started = time.perf_counter()
    for turn in range(args.turns):
        for conversation in range(args.num_conversations):
            prompt = history[conversation] + users[conversation][turn]
            (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            metrics = output.metrics
            ttft.setdefault(turn, []).append(metrics.first_token_time - metrics.arrival_time)
            computed[turn] = computed.get(turn, 0) + len(prompt) - output.num_cached_tokens
            answer = list(output.outputs[0].token_ids)
            answers.append(answer)
            history[conversation] = prompt + answer
    seconds = time.perf_counter() - started
    engine = llm.llm_engine
    stats = engine.stats()
    engine.shutdown()  # the disk tier's pending files, before a restart reads them
    later = [t for turn in range(1, args.turns) for t in ttft[turn]]
    result = {"mode": mode, "seconds": seconds, "ttft_later_p50_ms": 1000 * percentile(later, 50),
              "ttft_later_p90_ms": 1000 * percentile(later, 90),
              "ttft_all_p50_ms": 1000 * percentile([t for ts in ttft.values() for t in ts], 50),
              "ttft_first_turn_p50_ms": 1000 * percentile(ttft[0], 50),
              "prefill_tokens_later": sum(computed[turn] for turn in range(1, args.turns)),
              "prefill_tokens_all": sum(computed.values()), "num_pages": engine.runner.kv_plan.num_pages,
              "device_hits": stats.prefix_cache_hits, "max_disk_write_lag_s": (
                  engine.page_manager.tiers.disk.max_write_lag if mode != "off" and engine.page_manager.tiers.disk
                  else None), "tiers": [list(t) for t in stats.external_prefix_cache],
              "transfers": [list(t) for t in stats.kv_transfers], "answers": answers}
    del llm, engine
    gc.collect()
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-len", type=int, default=768)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-offloading-size", type=float, default=2.0, help="GiB of host tier (modes host, host+disk)")
    common.add_common_args(parser)
    common.add_engine_args(parser, max_num_seqs=1)  # max_model_len: a conversation's final length
    argv, args = common.start(parser, argv)
    if "off" not in args.modes:
        args.modes.insert(0, "off")  # the reference answers
    directory = tempfile.mkdtemp(prefix="jaxserve-kv-")
    try:
        results = [run_mode(mode, directory, args) for mode in args.modes]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    reference = results[0]["answers"]
    rows = []
    for result in results:
        result["identical"] = result.pop("answers") == reference
        rows.append([result["mode"], result["ttft_later_p50_ms"], result["ttft_later_p90_ms"],
                     result["ttft_first_turn_p50_ms"], result["prefill_tokens_later"], result["prefill_tokens_all"],
                     results[0]["ttft_later_p50_ms"] / result["ttft_later_p50_ms"], result["identical"]])
    print(common.format_table(["mode", "later TTFT p50 ms", "later p90 ms", "turn-1 p50 ms", "prefill later",
                               "prefill all", "later p50 speed-up", "identical"], rows))
    payload = {"argv": argv, "machine": common.machine_info(), "commit": common.git_commit(),
               "num_kv_pages": results[0]["num_pages"], "results": results}
    common.write_result(NAME, payload, args.result_file)
    return payload


if __name__ == "__main__":
    main()

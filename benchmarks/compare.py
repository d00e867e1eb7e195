"""jaxserve vs Hugging Face transformers on one workload, one machine, one invocation: ratios, not anecdotes.

Owns the comparison run: the same requests (default 64 random prompts of 128 tokens x 64 output tokens,
EOS ignored, greedy, the default model in float32) go through jaxserve's `LLM.generate` and through HF
`generate` in static batches; then batch-1 decode speed for both; then the roofline percentage of jaxserve's
decode step at the workload's batch and mean decode context. Engine start-up and HF load are reported
separately and excluded from throughput. The greedy outputs of both are compared token by token as a
check that both ran the same model (small float differences may flip a near-tie late in a sequence).

    python benchmarks/compare.py                      # the default workload
    python benchmarks/compare.py --dataset prompts --num-prompts 64 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline, throughput
from jaxserve.bench import dataset_args, datasets
from benchmarks.baselines import hf_transformers

NAME = "compare"


def agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> dict[str, float]:
    """Fraction of identical sequences and mean length of the common prefix as a fraction of the length.

    Both sides must hold one sequence per request; a missing sequence is an error, not a partial agreement.
    """
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} sequences against {len(theirs)}: both sides must answer every request")
    prefixes = []
    for a, b in zip(ours, theirs):
        same = 0
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
        prefixes.append(same / max(1, max(len(a), len(b))))
    identical = sum(list(a) == list(b) for a, b in zip(ours, theirs))
    return {"identical_fraction": identical / max(1, len(prefixes)),
            "mean_common_prefix_fraction": sum(prefixes) / max(1, len(prefixes))}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_workload_args(parser)
    common.add_engine_args(parser)
    common.add_common_args(parser)
    parser.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch (default: --max-num-seqs)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    parser.add_argument("--single-stream-tokens", type=int, default=32, help="batch-1 decode length (0 = skip)")
    parser.add_argument("--skip-roofline", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="jaxserve only (no ratios)")
    return parser


def run_jaxserve(args: argparse.Namespace) -> tuple[dict[str, Any], list, Any]:
    """Start-up, offline throughput, batch-1 decode and roofline point; returns (summary, outputs, records)."""
    load_before = common.load_average()
    llm, startup_s = throughput.start_engine(common.engine_options(args))
    config = llm.llm_engine.engine_config
    records = dataset_args.build_requests(args, llm.get_tokenizer(), llm.llm_engine.vocab_size, config.max_model_len)
    throughput.warm_up(llm, llm.llm_engine.vocab_size)
    offline = throughput.run_offline(llm, records, use_tqdm=not args.disable_tqdm)
    single = (throughput.single_stream_decode(llm, records[0].prompt_token_ids, args.single_stream_tokens)
              if args.single_stream_tokens else None)
    point = None
    if not args.skip_roofline:
        stats = datasets.length_stats(records)
        context = int(round(stats["mean_prompt_len"] + stats["expected_output_tokens"] / len(records) / 2))
        batch = min(len(records), config.max_num_seqs)
        ceilings = roofline.measure_ceilings(args.dtype)
        point = {"ceilings": ceilings, **roofline.roofline_point(llm, ceilings, batch, context)}
        floor_s = roofline.offline_floor_seconds(
            llm.llm_engine.model.config, roofline.param_counts(llm.llm_engine.runner.params), stats["prompt_tokens"],
            stats["expected_output_tokens"], len(records), ceilings["matmul_flops_s"])
        point["offline_floor_s"] = floor_s
        point["offline_floor_output_tok_s"] = stats["expected_output_tokens"] / floor_s
    summary = {"startup_s": startup_s, "result": offline.summary(), "single_stream": single, "roofline": point,
               "engine": {k: v for k, v in vars(config).items() if not k.startswith("_")},
               "load_average_before": load_before, "load_average_after": common.load_average()}
    outputs = offline.output_token_ids
    del llm
    gc.collect()
    return summary, outputs, records


def run_hf(args: argparse.Namespace, records: list) -> tuple[dict[str, Any], list]:
    load_before = common.load_average()
    threads = hf_transformers.set_torch_threads(args.threads)
    hf, load_s = hf_transformers.load_hf_model(args.model, args.dtype)
    result = hf_transformers.run_hf_offline(hf, records, args.hf_batch_size or args.max_num_seqs,
                                            not args.disable_tqdm)
    single = (hf_transformers.hf_single_stream_decode(hf, records[0].prompt_token_ids, args.single_stream_tokens)
              if args.single_stream_tokens else None)
    summary = {"load_s": load_s, "torch_threads": threads, "result": result.summary(), "single_stream": single,
               "load_average_before": load_before, "load_average_after": common.load_average()}
    outputs = result.output_token_ids
    del hf
    gc.collect()
    return summary, outputs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    jax_summary, jax_outputs, records = run_jaxserve(args)
    payload: dict[str, Any] = {"model": common.model_label(args.model), "dtype": args.dtype,
                               "workload": {**dataset_args.describe(args), **datasets.length_stats(records)},
                               "jaxserve": jax_summary}
    if not args.skip_hf:
        hf_summary, hf_outputs = run_hf(args, records)
        js, hs = jax_summary, hf_summary
        payload["hf_transformers"] = hf_summary
        payload["ratios"] = {
            "output_throughput": ratio(js["result"]["output_throughput"], hs["result"]["output_throughput"]),
            "total_throughput": ratio(js["result"]["total_throughput"], hs["result"]["total_throughput"]),
            "single_stream_decode": ratio((js["single_stream"] or {}).get("decode_tok_s"),
                                          (hs["single_stream"] or {}).get("decode_tok_s")),
            "offline_floor_vs_hf": ratio((js["roofline"] or {}).get("offline_floor_output_tok_s"),
                                         hs["result"]["output_throughput"]),
        }
        payload["greedy_agreement"] = agreement(jax_outputs, hf_outputs)
    path = common.write_result(NAME, payload, args.result_file, argv)
    report(payload)
    print(f"result: {path}")
    return payload


def report(payload: dict[str, Any]) -> None:
    js, hs = payload["jaxserve"], payload.get("hf_transformers")
    work = payload["workload"]
    print(f"\n{payload['model']} ({payload['dtype']}), {work['dataset_name']}: {work['requests']} requests, "
          f"{work['prompt_tokens']} prompt tokens, {work['expected_output_tokens']} output tokens, EOS ignored")

    def row(label: str, key: str, sub: str | None = None) -> list[Any]:
        def get(side: dict | None) -> float | None:
            if side is None:
                return None
            value = side.get(key) if sub is None else (side.get(key) or {}).get(sub)
            return value

        ours, theirs = get(js), get(hs)
        return [label, ours, theirs, ratio(ours, theirs)]

    rows = [row("output tok/s", "result", "output_throughput"), row("total tok/s", "result", "total_throughput"),
            row("requests/s", "result", "request_throughput"),
            row("batch-1 decode tok/s", "single_stream", "decode_tok_s"),
            ["start-up / load (s)", js["startup_s"], hs["load_s"] if hs else None, None]]
    print(common.format_table(["metric", "jaxserve", "HF transformers", "jaxserve / HF"], rows))
    split = js["result"].get("time_breakdown") or {}
    if split.get("decode_steps"):
        print(f"jaxserve time: {split['decode_steps_s']:.1f}s in {split['decode_steps']} pure decode steps (mean batch "
              f"{split['mean_decode_batch']:.1f}, {split['decode_only_tok_s']:.0f} tok/s), "
              f"{split['prefill_steps_s']:.1f}s in {split['prefill_steps']} steps with prefill, "
              f"{split['outside_steps_s']:.1f}s outside steps")
    if js.get("roofline"):
        point = js["roofline"]
        print(f"jaxserve decode step at batch {point['batch']}, ctx {point['context']}: "
              f"{1000 * point['step_s']:.1f} ms vs floor {1000 * point['floor_s']:.1f} "
              f"ms ({point['bound']}-bound) = {point['percent_of_roofline']:.1f}% of roofline")
        line = (f"offline floor (matmul FLOPs of the whole run at {point['ceilings']['matmul_flops_s'] / 1e9:.0f} "
                f"GFLOP/s): {point['offline_floor_s']:.1f} s = {point['offline_floor_output_tok_s']:.0f} output tok/s; "
                f"jaxserve reaches {100 * js['result']['output_throughput'] / point['offline_floor_output_tok_s']:.0f}%")
        if (payload.get("ratios") or {}).get("offline_floor_vs_hf"):
            line += f"; no engine at that rate beats HF by more than {payload['ratios']['offline_floor_vs_hf']:.2f}x"
        print(line)
    if payload.get("greedy_agreement"):
        agree = payload["greedy_agreement"]
        print(f"greedy outputs: {100 * agree['identical_fraction']:.0f}% identical sequences, common prefix "
              f"{100 * agree['mean_common_prefix_fraction']:.0f}% of length on average")


if __name__ == "__main__":
    main()

"""`jaxserve bench throughput` and `jaxserve bench latency`: the in-process benchmarks, with `vllm bench`'s flags
and result keys, over an engine built from every `jaxserve serve` engine flag.

    jaxserve bench throughput --model DIR --input-len 512 --output-len 128 --num-prompts 200 --output-json t.json
    jaxserve bench latency --model DIR --input-len 32 --output-len 128 --batch-size 8 --output-json l.json

Both ask for exactly `output-len` tokens per request (ignore_eos), sampled at temperature 1, as vLLM does. The
engine compiles while it is built, before anything is timed.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import numpy as np

from jaxserve.bench import dataset_args, datasets
from jaxserve.bench.report import print_block, write_json

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def _engine_parser(prog: str, description: str) -> argparse.ArgumentParser:
    from jaxserve.server.cli_args import add_engine_args

    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--n", type=dataset_args.positive_int, default=1, help="outputs per prompt")
    parser.add_argument("--output-json", default=None, help="write the result JSON here")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(parser)
    return parser


def _llm(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from jaxserve import LLM
    from jaxserve.server.cli_args import engine_config

    try:
        config = engine_config(args)
    except ValueError as err:
        parser.error(str(err))
    return LLM.from_engine_config(config)


def _settings(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    from jaxserve.bench.machine import machine_info

    config = llm.llm_engine.engine_config
    return {"model": args.model, "max_num_seqs": config.max_num_seqs, "max_model_len": config.max_model_len,
            "tensor_parallel_size": config.tensor_parallel_size, "n": args.n, "machine": machine_info()}


def throughput_main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _engine_parser("jaxserve bench throughput", "Offline throughput: every request submitted at once.")
    dataset_args.add_dataset_args(parser, num_prompts=1000)
    args = parser.parse_args(argv)
    problem = dataset_args.check_dataset_args(args)
    if problem:
        parser.error(problem)
    from jaxserve import SamplingParams

    llm = _llm(args, parser)
    engine = llm.llm_engine
    records = dataset_args.build_requests(args, llm.get_tokenizer(), engine.vocab_size,
                                          engine.engine_config.max_model_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in records]
    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len)
              for r in records]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - started
    prompt_tokens = sum(r.prompt_len for r in records)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result = {"elapsed_time": elapsed, "num_requests": len(records), "total_num_tokens": total,
              "requests_per_second": len(records) / elapsed, "tokens_per_second": total / elapsed,
              "total_output_tokens": output_tokens, "output_tokens_per_second": output_tokens / elapsed,
              **_settings(args, llm), "dataset": {**dataset_args.describe(args), **datasets.length_stats(records)}}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s", flush=True)
    if args.output_json:
        print(f"result: {write_json(args.output_json, result)}")
    return result


def latency_main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _engine_parser("jaxserve bench latency", "Latency of one batch, prefill to the last token.")
    parser.add_argument("--input-len", type=dataset_args.positive_int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=dataset_args.positive_int, default=128, help="output tokens per request")
    parser.add_argument("--batch-size", type=dataset_args.positive_int, default=8, help="requests in the batch")
    parser.add_argument("--num-iters-warmup", type=dataset_args.non_negative_int, default=10)
    parser.add_argument("--num-iters", type=dataset_args.positive_int, default=30)
    args = parser.parse_args(argv)
    from jaxserve import SamplingParams

    llm = _llm(args, parser)
    records = datasets.random_dataset(args.batch_size, args.input_len, args.output_len, llm.llm_engine.vocab_size,
                                      seed=args.seed, tokenizer=llm.get_tokenizer())
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in records]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def run_once() -> float:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in range(args.num_iters_warmup):
        run_once()
    latencies = [run_once() for _ in range(args.num_iters)]
    percentiles = {str(p): float(np.percentile(latencies, p)) for p in LATENCY_PERCENTILES}
    result = {"avg_latency": float(np.mean(latencies)), "latencies": latencies, "percentiles": percentiles,
              "input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
              **_settings(args, llm)}
    print_block("Latency", [("Avg latency (s):", f"{result['avg_latency']:.4f}")]
                + [(f"{p}% percentile latency (s):", f"{v:.4f}") for p, v in percentiles.items()])
    if args.output_json:
        print(f"result: {write_json(args.output_json, result)}")
    return result

"""`jaxserve bench serve`: the online serving benchmark against any OpenAI-compatible server, with `vllm bench
serve`'s flags, printed block and result JSON keys, so its numbers and files compare with vLLM's.

    jaxserve serve --port 8000 &                    # or vllm serve, llama-server, ...
    jaxserve bench serve --port 8000 --dataset-name random --random-input-len 512 --random-output-len 128 \
        --num-prompts 200 --request-rate 4 --max-concurrency 32 --save-result --result-dir results/

Several `--request-rate` or `--max-concurrency` values run one after another, a result file each.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import random
from pathlib import Path
from typing import Any, Sequence

from jaxserve.bench import client, dataset_args, datasets, metrics
from jaxserve.bench.client import CHAT, COMPLETIONS
from jaxserve.bench.report import print_block, write_json

BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "jaxserve": COMPLETIONS, "openai-chat": CHAT}


def request_slos(specs: Sequence[str]) -> dict[str, dict[str, float]]:
    """`--request-slo` values, CATEGORY:TTFT_MS[:TPOT_MS] ("*": every category), as the body fields each
    category's requests send (jaxserve's ttft_slo_ms / tpot_slo_ms; other servers ignore them)."""
    fields = {}
    for spec in specs:
        parts = spec.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            values = [float(part) for part in parts[1:]]
        except ValueError:
            raise ValueError(f"--request-slo takes CATEGORY:TTFT_MS[:TPOT_MS], got {spec!r}") from None
        fields[parts[0]] = dict(zip(("ttft_slo_ms", "tpot_slo_ms"), values))
    return fields


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve bench serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="openai",
                        help="openai / vllm / jaxserve: completions; openai-chat: chat completions")
    parser.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", choices=client.ENDPOINTS, default=None, help="default: the backend's")
    parser.add_argument("--model", default=None, help="the model to ask for (default: the first of /v1/models)")
    parser.add_argument("--served-model-name", default=None, help="the name sent in requests (default: --model)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="adapter names the server serves (its --lora-modules): each request asks for one of "
                             "them, drawn at random with --seed (vLLM's)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer dir for building prompts (default: --model's, else the default model's)")
    parser.add_argument("--label", default=None, help="the result's label and file-name prefix (default: backend)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    parser.add_argument("--request-rate", type=_rate, nargs="+", default=[math.inf],
                        help="requests/s (Poisson arrivals, or gamma with --burstiness); inf: all at once")
    parser.add_argument("--burstiness", type=_rate, default=1.0,
                        help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier, > 1 steadier")
    parser.add_argument("--max-concurrency", type=int, nargs="+", default=[0],
                        help="requests in flight at most (0: unlimited)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every output its full length")
    parser.add_argument("--percentile-metrics", default=",".join(metrics.PERCENTILE_METRICS),
                        help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,99")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                        help="SLOs for request goodput, e.g. ttft:2000 tpot:200 e2el:20000")
    parser.add_argument("--request-slo", nargs="+", default=[], metavar="CATEGORY:TTFT_MS[:TPOT_MS]",
                        help="latency targets sent with each request of a workload category ('*': all), e.g. the "
                             "mixed dataset's short:1000:200 long:20000:200 (jaxserve's ttft_slo_ms / tpot_slo_ms)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                        help="completions: send the prompt's token ids (exact lengths) or its text")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="drop requests whose prompt + output exceed the server's context length")
    parser.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                        help="poll /health this long before starting (0: the server is up)")
    parser.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds one request may take before it counts as failed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON")
    parser.add_argument("--save-detailed", action="store_true",
                        help="with --save-result: add per-request lengths, TTFTs, ITLs, latencies, send times, "
                             "texts, errors and workload categories")
    parser.add_argument("--result-dir", default=".", help="where result files go")
    parser.add_argument("--result-filename", default=None,
                        help="default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json")
    parser.add_argument("--metadata", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra key-value pairs for the result file")
    parser.add_argument("--plot", action="store_true",
                        help="with --save-result: a PNG beside it (TTFT and ITL distributions, output tokens/s "
                             "over time; needs matplotlib)")
    dataset_args.add_dataset_args(parser, num_prompts=1000)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, with every combined check an argparse error (exit 2, the problem named)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = dataset_args.check_dataset_args(args)
    try:
        args.goodput_ms = metrics.parse_goodput(args.goodput)
        args.targets = request_slos(args.request_slo)
        args.selected_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        unknown = set(args.selected_metrics) - set(metrics.PERCENTILE_METRICS)
        if unknown:
            raise ValueError(f"--percentile-metrics: unknown {', '.join(sorted(unknown))} (known: "
                             f"{', '.join(metrics.PERCENTILE_METRICS)})")
        wrong = ValueError(f"--metric-percentiles takes numbers in (0, 100), got {args.metric_percentiles!r}")
        try:
            args.percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        except ValueError:
            raise wrong from None
        if not args.percentiles or not all(0 < p < 100 for p in args.percentiles):
            raise wrong
    except ValueError as err:
        problem = problem or str(err)
    bad = [item for item in args.metadata if "=" not in item]
    if problem is None and bad:
        problem = f"--metadata takes KEY=VALUE, got {bad[0]!r}"
    args.extra = dict(item.split("=", 1) for item in args.metadata if "=" in item)
    if problem is None and any(c < 0 for c in args.max_concurrency):
        problem = "--max-concurrency must be >= 0"
    if problem is None and not args.request_timeout > 0:
        problem = "--request-timeout must be > 0"
    if problem is None and (args.plot or args.save_detailed) and not args.save_result:
        problem = "--plot and --save-detailed go with --save-result"
    if problem:
        parser.error(problem)
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.endpoint = args.endpoint or BACKENDS[args.backend]
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Runs every (rate, concurrency) of the flags; returns their results (the JSON written with --save-result)."""
    args = parse_args(argv)
    from jaxserve.bench.report import load_tokenizer
    from jaxserve.loading import hub

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if args.ready_check_timeout_sec:
        client.wait_for_server(args.base_url, args.ready_check_timeout_sec)
    model = args.model or client.served_model(args.base_url, headers)
    local = args.tokenizer or (args.model if args.model and (Path(args.model).exists() or hub.is_hub_id(args.model))
                               else None)
    if local is None:
        print("no --tokenizer (and --model is no local path or hub id): prompts are built with the default model's "
              "tokenizer")
    tokenizer = load_tokenizer(local)
    records = dataset_args.build_requests(args, tokenizer, len(tokenizer), args.max_model_len)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                                  ("min_p", args.min_p)) if v is not None}
    name = args.served_model_name or model
    draw = random.Random(args.seed)
    names = [draw.choice(args.lora_modules) if args.lora_modules else name for _ in records]
    bodies = [{**client.build_payload(r, args.endpoint, n, args.prompt_format, args.ignore_eos, tokenizer,
                                      sampling), **args.targets.get(r.category, args.targets.get("*", {}))}
              for r, n in zip(records, names)]
    prompt_lens = [r.prompt_len for r in records]

    print(f"Starting initial single prompt test run against {args.base_url}{args.endpoint} ...", flush=True)
    limit = "max_tokens" if args.endpoint == COMPLETIONS else "max_completion_tokens"
    probe, _ = asyncio.run(client.run_benchmark(args.base_url, args.endpoint, [{**bodies[0], limit: 4}],
                                                prompt_lens[:1], math.inf, 1.0, None, args.seed, True,
                                                args.request_timeout, headers))
    if not probe[0].success:
        raise SystemExit(f"Initial test run failed: {probe[0].error}")

    outcomes = []
    for rate in args.request_rate:
        for concurrency in args.max_concurrency:
            concurrency = concurrency or None
            print(f"Traffic request rate: {rate}\nBurstiness factor: {args.burstiness}\n"
                  f"Maximum request concurrency: {concurrency}", flush=True)
            results, duration = asyncio.run(client.run_benchmark(
                args.base_url, args.endpoint, bodies, prompt_lens, rate, args.burstiness, concurrency, args.seed,
                args.disable_tqdm, args.request_timeout, headers))
            summary = metrics.compute_serving_metrics(results, duration, args.goodput_ms, args.percentiles)
            print_block("Serving Benchmark Result", metrics.serving_report_rows(summary, concurrency, rate))
            failures = sorted({r.error for r in results if not r.success})
            if failures:
                print("failures:", *failures[:5], sep="\n  ", flush=True)
            outcome = {**_settings(args, model, rate, concurrency, records),
                       **metrics.vllm_result(summary, results, args.selected_metrics, args.percentiles,
                                             args.save_detailed)}
            if args.save_detailed:
                outcome["categories"] = [r.category for r in records]
            if args.save_result:
                path = _write(args, outcome, model, rate, concurrency)
                print(f"result: {path}", flush=True)
                if args.plot:
                    from jaxserve.bench.plots import draw_serving

                    print(f"plot: {draw_serving(results, path.with_suffix('.png'), outcome['label'])}")
            outcomes.append(outcome)
    return outcomes


def _settings(args: argparse.Namespace, model: str, rate: float, concurrency: int | None,
              records: Sequence[datasets.RequestRecord]) -> dict[str, Any]:
    from jaxserve.bench.machine import machine_info

    return {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
            "endpoint_type": args.backend, "label": args.label or args.backend, "model_id": model,
            "tokenizer_id": args.tokenizer or args.model or model, "lora_modules": args.lora_modules,
            "base_url": args.base_url, "endpoint": args.endpoint, "num_prompts": len(records),
            "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": args.burstiness,
            "max_concurrency": concurrency, "ignore_eos": args.ignore_eos,
            "goodput_slo_ms": args.goodput_ms, "request_slo_ms": args.targets,
            "dataset": {**dataset_args.describe(args), **datasets.length_stats(records)},
            "client_machine": machine_info(include_jax=False), **args.extra}


def _write(args: argparse.Namespace, outcome: dict[str, Any], model: str, rate: float,
           concurrency: int | None) -> Path:
    """The result file: --result-filename, or vLLM's LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json; a sweep of
    several runs with --result-filename writes STEM-RATEqps-concurrencyN.json for each."""
    name = args.result_filename
    run = f"{rate}qps{f'-concurrency{concurrency}' if concurrency else ''}"
    if name is None:
        name = f"{outcome['label']}-{run}-{Path(model).name}-{outcome['date']}.json"
    elif len(args.request_rate) * len(args.max_concurrency) > 1:
        name = f"{Path(name).stem}-{run}.json"
    return write_json(Path(args.result_dir) / name, outcome)

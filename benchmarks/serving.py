"""Online serving benchmark against any OpenAI-compatible server (jaxserve's, vLLM, llama.cpp, ...).

Owns the client side of the measurement: open-loop arrivals (Poisson at `--request-rate`, or gamma with
`--burstiness`; `inf` sends everything at once), an optional `--max-concurrency` gate, streaming requests
over httpx (SSE), and per-request timing. The metric math is `benchmarks/metrics.py`; the printed block is
`vllm bench serve`'s. TTFT and latency start when the request is actually sent: time spent waiting on the
concurrency gate is not counted. The first chunk carrying output text counts as the first token; token
counts come from the server's `usage` (stream_options.include_usage), else from counting text chunks.

    python -m jaxserve serve --port 8000 &          # or any other OpenAI-compatible server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --dataset prompts --num-prompts 64 \
        --request-rate 2 --max-concurrency 16 --goodput ttft:2000 tpot:200
    python benchmarks/serving.py --max-concurrency 1 4 16 --ignore-eos   # a sweep: one run per level
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, datasets, metrics
from benchmarks.datasets import RequestRecord
from benchmarks.metrics import RequestResult

NAME = "serving"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def arrival_intervals(num_requests: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> list[float]:
    """Seconds to wait after each request before sending the next: gamma(shape=burstiness, mean=1/rate).

    burstiness 1 gives a Poisson process; rate inf gives zeros (everything at once). The first request
    always goes at t = 0; the interval list has one entry per request (the last one unused).
    """
    import numpy as np

    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests).tolist()


def build_payload(record: RequestRecord, endpoint: str, model: str, prompt_format: str, ignore_eos: bool,
                  tokenizer: Any = None, temperature: float = 0.0) -> dict[str, Any]:
    """The JSON body for one streamed request. Completions send token ids unless text is asked for."""
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == CHAT:
        messages = record.messages
        if messages is None:
            text = record.prompt_text if record.prompt_text is not None else tokenizer.decode(record.prompt_token_ids)
            messages = [{"role": "user", "content": text}]
        body.update(messages=messages, max_completion_tokens=record.expected_output_len)
    else:
        if prompt_format == "text":
            text = record.prompt_text if record.prompt_text is not None else tokenizer.decode(record.prompt_token_ids)
            body["prompt"] = text
        else:
            body["prompt"] = record.prompt_token_ids
        body["max_tokens"] = record.expected_output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


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


def chunk_text(data: dict[str, Any], endpoint: str) -> str | None:
    """The output text a streamed chunk carries (None when it has no choices)."""
    choices = data.get("choices")
    if not choices:
        return None
    if endpoint == CHAT:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: Any, url: str, endpoint: str, body: dict[str, Any], prompt_len: int,
                       run_start: float, clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Streams one request; measures TTFT, inter-chunk gaps and latency from the moment it is sent."""
    result = RequestResult(success=False, prompt_len=prompt_len)
    sent = clock()
    result.send_time = sent - run_start
    last = sent
    chunks_with_text = 0
    usage = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            result.served_by = response.headers.get("x-jaxserve-worker", "")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"])[:300]
                    return result
                if data.get("usage"):
                    usage = data["usage"]
                text = chunk_text(data, endpoint)
                if not text:
                    continue
                result.generated_text += text
                now = clock()
                if chunks_with_text == 0:
                    result.ttft = now - sent
                else:
                    result.itl.append(now - last)
                last = now
                chunks_with_text += 1
        result.latency = last - sent
        result.output_len = int(usage["completion_tokens"]) if usage else chunks_with_text
        if usage and usage.get("prompt_tokens"):
            result.prompt_len = int(usage["prompt_tokens"])
        if usage and usage.get("prompt_tokens_details"):
            result.cached_tokens = int(usage["prompt_tokens_details"].get("cached_tokens") or 0)
        result.success = chunks_with_text > 0
        if not result.success:
            result.error = "the stream carried no output text"
    except Exception as err:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_benchmark(base_url: str, endpoint: str, bodies: Sequence[dict[str, Any]], prompt_lens: Sequence[int],
                        request_rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                        disable_tqdm: bool = False, timeout_s: float = 3600.0,
                        headers: dict[str, str] | None = None, clock: Callable[[], float] = time.perf_counter,
                        transport: Any = None) -> tuple[list[RequestResult], float]:
    """Sends every body on the arrival schedule; returns results (request order) and the run duration.

    `clock` (seconds) and `transport` (an httpx async transport) are for tests: a virtual clock and an
    in-process fake server make the timing checks exact.
    """
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + endpoint
    intervals = arrival_intervals(len(bodies), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(bodies), desc="requests", disable=disable_tqdm, dynamic_ncols=True)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers,
                                 transport=transport) as client:
        run_start = clock()

        async def one(index: int) -> RequestResult:
            args = (client, url, endpoint, bodies[index], prompt_lens[index], run_start, clock)
            if gate is None:
                result = await send_request(*args)
            else:
                async with gate:  # the wait here is not timed: send_request reads the clock when it sends
                    result = await send_request(*args)
            progress.update(1)
            return result

        tasks = []
        for index in range(len(bodies)):
            tasks.append(asyncio.create_task(one(index)))
            if intervals[index] > 0 and index + 1 < len(bodies):
                await asyncio.sleep(intervals[index])
        results = await asyncio.gather(*tasks)
        duration = clock() - run_start
    progress.close()
    return list(results), duration


def wait_for_server(base_url: str, timeout_s: float = 600.0, process: Any = None) -> None:
    """Polls GET /health until 200; raises RuntimeError on timeout or if `process` (a Popen) exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            response = httpx.get(base_url.rstrip("/") + "/health", timeout=5.0)
            if response.status_code == 200:
                return
            last_error = f"HTTP {response.status_code}"
        except httpx.HTTPError as err:
            last_error = f"{type(err).__name__}"
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} was not healthy within {timeout_s:.0f}s (last: {last_error})")


def served_model(base_url: str, headers: dict[str, str] | None = None) -> str:
    """The first model id GET /v1/models lists."""
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30.0, headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer dir for building the workload (default: the jaxserve default model's)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests/s (Poisson arrivals); inf = all at once; several values = a sweep")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1=Poisson)")
    parser.add_argument("--max-concurrency", type=int, nargs="+", default=[0],
                        help="requests in flight at most (0 = unlimited); several values = a sweep")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:20000")
    parser.add_argument("--request-slo", nargs="*", default=[], metavar="CATEGORY:TTFT_MS[:TPOT_MS]",
                        help="latency targets sent with each request of a workload category (e.g. the mixed "
                             "dataset's short:1000:200 long:20000:200; '*' for all): jaxserve schedules by them "
                             "under --scheduling-policy slo and counts its goodput")
    parser.add_argument("--percentiles", type=float, nargs="+", default=list(metrics.DEFAULT_PERCENTILES))
    parser.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                        help="completions: send token ids (auto, ids) or the prompt text")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension): fixed lengths")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--wait-for-server", type=float, default=0.0, metavar="SECONDS",
                        help="poll /health this long before starting")
    parser.add_argument("--request-timeout", type=float, default=3600.0)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="drop requests whose prompt + output exceed the server's context length")
    parser.add_argument("--label", default=None, help="server name for tables and plots (default: the model)")
    datasets.add_dataset_args(parser, num_prompts=64, input_len=128, output_len=64)
    common.add_common_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slo = metrics.parse_goodput(args.goodput)
        targets = request_slos(args.request_slo)
    except ValueError as err:
        parser.error(str(err))
    common.quiet_logs()
    common.seed_everything(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if args.wait_for_server:
        wait_for_server(args.base_url, args.wait_for_server)
    model = args.model or served_model(args.base_url, headers)
    tokenizer = common.load_tokenizer(args.tokenizer)
    records = datasets.build_requests(args, tokenizer, len(tokenizer), args.max_model_len)
    bodies = [{**build_payload(r, args.endpoint, model, args.prompt_format, args.ignore_eos, tokenizer,
                               args.temperature), **targets.get(r.category, targets.get("*", {}))} for r in records]
    prompt_lens = [r.prompt_len for r in records]

    print(f"Initial test run with one request to {args.base_url}{args.endpoint} ...", flush=True)
    probe_body = {**bodies[0], **({"max_tokens": 4} if args.endpoint == COMPLETIONS else {"max_completion_tokens": 4})}
    probe, _ = asyncio.run(run_benchmark(args.base_url, args.endpoint, [probe_body], prompt_lens[:1], math.inf, 1.0,
                                         None, args.seed, True, args.request_timeout, headers))
    if not probe[0].success:
        raise SystemExit(f"the test request failed: {probe[0].error}")

    runs = []
    for rate in args.request_rate:
        for concurrency in args.max_concurrency:
            concurrency = concurrency or None
            print(f"run: request rate {rate}, max concurrency {concurrency or 'unlimited'}, "
                  f"{len(bodies)} requests", flush=True)
            results, duration = asyncio.run(run_benchmark(
                args.base_url, args.endpoint, bodies, prompt_lens, rate, args.burstiness, concurrency, args.seed,
                args.disable_tqdm, args.request_timeout, headers))
            summary = metrics.compute_serving_metrics(results, duration, slo, args.percentiles)
            common.print_block("Serving Benchmark Result",
                               metrics.serving_report_rows(summary, concurrency, rate))
            failures = sorted({r.error for r in results if not r.success})
            if failures:
                print("failures:", *failures[:5], sep="\n  ")
            runs.append({"request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
                         "max_concurrency": concurrency, "metrics": summary.as_dict(),
                         "requests": [_request_row(r, record) for r, record in zip(results, records)]})

    payload = {"server": args.label or model, "base_url": args.base_url, "endpoint": args.endpoint,
               "model": model, "goodput_slo_ms": slo, "request_slo_ms": targets, "ignore_eos": args.ignore_eos,
               "workload": {**datasets.describe(args), **datasets.length_stats(records)},
               "runs": runs, "load_average_after": common.load_average()}
    path = common.write_result(NAME, payload, args.result_file, argv, machine=common.machine_info(include_jax=False))
    if not args.no_plot:
        from benchmarks import plots

        for png in plots.draw_serving(payload, path.with_suffix(""), common.machine_label(common.machine_info(False))):
            print(f"plot: {png}")
    if len(runs) > 1:
        print(common.format_table(
            ["rate", "concurrency", "ok", "out tok/s", "req/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p99 ms"],
            [[str(r["request_rate"]), str(r["max_concurrency"] or "inf"), r["metrics"]["completed"],
              r["metrics"]["output_throughput"], r["metrics"]["request_throughput"],
              r["metrics"]["ttft_ms"]["median"], r["metrics"]["tpot_ms"]["median"],
              r["metrics"]["itl_ms"].get("p99")] for r in runs]))
    print(f"result: {path}")
    return payload


def _request_row(result: RequestResult, record: RequestRecord) -> dict[str, Any]:
    return {"success": result.success, "category": record.category, "prompt_len": result.prompt_len,
            "output_len": result.output_len, "cached_tokens": result.cached_tokens,
            "ttft": result.ttft, "tpot": metrics.tpot(result), "latency": result.latency,
            "send_time": result.send_time, "itl": result.itl, "error": result.error}


if __name__ == "__main__":
    main()

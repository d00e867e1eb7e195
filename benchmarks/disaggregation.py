"""Prefill/decode disaggregation against data parallelism, behind vllm-router, on one machine.

Two setups of two fresh `python -m jaxserve serve` workers each (the default model unless `--model`):
* `pd`: a prefill worker (`--kv-transfer-config` kv_producer) and a decode worker (kv_consumer) behind
  `vllm-router --vllm-pd-disaggregation` (the decode worker pulls each prompt's KV over jax's transfer server);
* `dp`: two plain workers behind `vllm-router --policy round_robin` (two data-parallel replicas).
The workload: `--num-requests` completions of random token ids arriving as a Poisson process at `--request-rate`;
every `--long-every`-th prompt is `--long-len` tokens, the others `--short-len`; each streams `--output-len` tokens
(greedy, EOS ignored). Reported per setup and per prompt kind: TTFT and inter-token latency p50/p99, the requests
that failed, and for `pd` what the decode worker computed and received.

On a CPU host every worker shares the same cores, so this measures the protocol's costs (the transfer, the extra
hop, the one-token prefill on the decode worker) and not the isolation of decodes from prefills that separate
accelerators give: a prefill on P still slows D's decodes here.

    python benchmarks/disaggregation.py
    python benchmarks/disaggregation.py --num-requests 64 --request-rate 4 --long-len 1536
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from benchmarks.routing import Processes, wait_healthy, worker_counters
from benchmarks.run_default_suite import free_port
from jaxserve.bench import client
from jaxserve.bench.metrics import percentile

NAME = "disaggregation"
WORKER = ["--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "16",
          "--log-stats-interval", "0"]
ROUTER = str(Path(sys.executable).with_name("vllm-router"))


class Setup:
    """Two workers (each with its `roles`' --kv-transfer-config, None: plain) and vllm-router; stopped on exit."""

    def __init__(self, name: str, model: list[str], roles: tuple[str | None, str | None], timeout_s: float):
        self.started = Processes()
        self.workers = [f"http://127.0.0.1:{free_port()}" for _ in roles]
        self.router = f"http://127.0.0.1:{free_port()}"
        try:
            for index, (url, role) in enumerate(zip(self.workers, roles)):
                flags = ["--kv-transfer-config", json.dumps({"kv_role": role})] if role else []
                self.started.start([sys.executable, "-m", "jaxserve", "serve", *model, "--port",
                                    url.rsplit(":", 1)[1], *WORKER, *flags], f"{name}-worker{index}")
                client.wait_for_server(url, timeout_s, self.started.processes[-1])
            fronts = (["--vllm-pd-disaggregation", "--prefill", self.workers[0], "--decode", self.workers[1]]
                      if roles[0] else ["--worker-urls", *self.workers])
            self.started.start([ROUTER, *fronts, "--policy", "round_robin", "--port", self.router.rsplit(":", 1)[1],
                                "--prometheus-port", str(free_port())], f"{name}-router")
            wait_healthy(self.router, 60, self.started.processes[-1])
        except BaseException:
            self.started.stop()
            raise


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int], float]]:
    """(kind, prompt token ids, arrival second) per request, the same for every setup."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    arrivals = np.cumsum(rng.exponential(1 / args.request_rate, args.num_requests))
    requests = []
    for index, arrival in enumerate(arrivals):
        kind = "long" if index % args.long_every == 0 else "short"
        length = args.long_len if kind == "long" else args.short_len
        requests.append((kind, rng.integers(100, vocab - 100, length).tolist(), float(arrival)))
    return requests


async def run_workload(base_url: str, model: str, requests: list, output_len: int) -> list[tuple[str, Any]]:
    async with client.open_session(3600.0) as session:
        loop = asyncio.get_running_loop()
        start_time = loop.time()

        async def one(kind: str, prompt: list[int], arrival: float) -> tuple[str, Any]:
            await asyncio.sleep(max(0.0, start_time + arrival - loop.time()))
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            return kind, await client.send_request(session, base_url + client.COMPLETIONS, client.COMPLETIONS, body,
                                                   len(prompt), 0.0)

        return await asyncio.gather(*(one(*request) for request in requests))


def figures(results: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for kind in ("short", "long", "all"):
        done = [r for k, r in results if kind in (k, "all")]
        ok = [r for r in done if r.success]
        ttft, itl = [r.ttft for r in ok], [gap for r in ok for gap in r.itl]
        out[kind] = {"requests": len(done), "failed": len(done) - len(ok),
                     **{f"ttft_ms_p{p}": round(1000 * percentile(ttft, p), 1) for p in (50, 99)},
                     **{f"itl_ms_p{p}": round(1000 * percentile(itl, p), 2) for p in (50, 99)}}
    errors = sorted({r.error for _, r in results if not r.success})
    if errors:
        out["errors"] = errors[:3]
    return out


def run_setup(name: str, roles: tuple, requests: list, args: argparse.Namespace) -> dict[str, Any]:
    model = ["--model", args.model] if args.model else []
    setup = Setup(name, model, roles, args.server_timeout)
    watched = ("jaxserve:prompt_tokens_computed_total", "jaxserve:kv_transfer_tokens_received_total",
               "jaxserve:kv_transfer_pull_seconds_sum", "jaxserve:kv_transfer_pull_failures_total")
    try:
        served = client.served_model(setup.workers[0])
        asyncio.run(run_workload(setup.router, served, requests[:2], 4))  # warm the path (not counted)
        before = [worker_counters(url, watched) for url in setup.workers]
        results = asyncio.run(run_workload(setup.router, served, requests, args.output_len))
        after = [worker_counters(url, watched) for url in setup.workers]
    finally:
        setup.started.stop()
    return {"figures": figures(results), "commands": setup.started.commands,
            "workers": [{name.split(":")[1]: round(a[name] - b[name], 3) for name in watched}
                        for a, b in zip(after, before)]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--setups", nargs="*", choices=("pd", "dp"), default=["pd", "dp"])
    parser.add_argument("--server-timeout", type=float, default=600.0)
    common.add_common_args(parser)
    argv, args = common.start(parser, argv)
    requests = workload(args, common.load_tokenizer(args.model).vocab_size if args.model else 49152)
    roles = {"pd": ("kv_producer", "kv_consumer"), "dp": (None, None)}
    setups = {name: run_setup(name, roles[name], requests, args) for name in args.setups}
    rows = [[name, kind, f[kind]["ttft_ms_p50"], f[kind]["ttft_ms_p99"], f[kind]["itl_ms_p50"], f[kind]["itl_ms_p99"],
             f[kind]["failed"]] for name, f in ((n, s["figures"]) for n, s in setups.items())
            for kind in ("short", "long", "all")]
    print(common.format_table(["setup", "prompts", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                               "failed"], rows))
    payload = {"setups": setups, "worker_flags": WORKER, "load_average_after": common.load_average()}
    path = common.write_result(NAME, payload, args.result_file, argv, machine=common.machine_info(include_jax=False))
    print(f"result: {path}")
    return payload


if __name__ == "__main__":
    main()

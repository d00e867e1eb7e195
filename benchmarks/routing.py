"""Routing across servers with vllm-router, and what the router adds.

Policies (`--policies`, vllm-router's): `cache_aware`, `round_robin`, `power_of_two`, and `kv_aware`, whose
workers publish their KV cache events. For each, two fresh `python -m jaxserve serve` workers and the router in
front of them. `--num-conversations` chats, each with
its own system document (about `--doc-tokens` tokens of the prompt file's texts) and `--turns` user turns (the
prompt file's questions); a turn is the whole conversation so far (document, earlier questions and the answers
the server gave) plus the next question, streamed, greedy,
`--output-len` tokens (EOS ignored). `--concurrency` conversations run at a time, each one turn after another.
Reported per policy: the prefix-cache hit rate of the later turns (turn 2 and on) from the answers'
`usage.prompt_tokens_details.cached_tokens` and from the workers' own counters, their TTFT p50/p90, the requests
each worker served, and the router process's CPU seconds per request. `--num-kv-pages` gives each worker fewer
pages than the conversations need, so caches evict (where exact KV events should beat the router's own guess).

Overhead (`--overhead-requests`): one worker and a router in front of it; short distinct chats, one at a time,
alternately straight to the worker and through the router. Reported: TTFT p50 and the time per streamed chunk
(p50 of the gaps) both ways, and their differences.

    python benchmarks/routing.py                                   # 16 conversations x 4 turns, both parts
    python benchmarks/routing.py --policies cache_aware kv_aware round_robin --overhead-requests 0
    python benchmarks/routing.py --policies cache_aware kv_aware --overhead-requests 0 --num-kv-pages 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench import client, datasets
from jaxserve.bench.metrics import percentile
from benchmarks.run_default_suite import free_port, stop_server

NAME = "routing"
POLICIES = ("cache_aware", "kv_aware", "round_robin", "power_of_two")
BLOCK_SIZE = 16  # the workers' page size, which vllm-router's kv_aware must be told
WORKER = ["--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
          "--log-stats-interval", "0"]


def conversations(args: argparse.Namespace, tokenizer: Any) -> list[tuple[str, list[str]]]:
    """Each conversation's document and its questions, from the prompt file (the same for every policy)."""
    import numpy as np

    entries = datasets.load_prompt_file()
    rng = np.random.default_rng(args.seed)
    chats = []
    for _ in range(args.num_conversations):
        order = rng.permutation(len(entries))
        doc, used = "Reference notes for this conversation:\n", 0
        while len(tokenizer.encode(doc)) < args.doc_tokens and used < len(order):
            doc += entries[order[used]]["prompt"] + "\n"
            used += 1
        questions = [entries[order[(used + turn) % len(order)]]["prompt"] for turn in range(args.turns)]
        chats.append((doc, questions))
    return chats


def start(command: list[str], name: str) -> tuple[subprocess.Popen, str]:
    print(f"$ {' '.join(command)} &", flush=True)
    with tempfile.NamedTemporaryFile("w", prefix=f"jaxserve-{name}-", suffix=".log", delete=False) as log:
        return subprocess.Popen(command, cwd=common.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT), log.name


class Processes:
    """Processes started for a run, their commands and logs; `stop` stops them all, the last started first."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.commands: list[str] = []

    def start(self, command: list[str], name: str) -> None:
        process, log = start(command, name)
        self.processes.append(process)
        self.logs.append(log)
        self.commands.append(" ".join(command))

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_server(process)


class Servers:
    """`num_workers` fresh workers and a router over them with `policy`; stopped on exit."""

    def __init__(self, num_workers: int, policy: str, timeout_s: float, worker_flags: Sequence[str] = ()):
        self.started = Processes()
        self.workers = [f"http://127.0.0.1:{free_port()}" for _ in range(num_workers)]
        self.router = f"http://127.0.0.1:{free_port()}"
        events = [free_port() for _ in self.workers] if policy == "kv_aware" else []
        try:
            for index, url in enumerate(self.workers):
                flags = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint":
                                                           f"tcp://127.0.0.1:{events[index]}"})] if events else []
                self.started.start([sys.executable, "-m", "jaxserve", "serve", "--port", url.rsplit(":", 1)[1],
                                    *WORKER, *worker_flags, "--block-size", str(BLOCK_SIZE), *flags],
                                   f"worker{index}")
                client.wait_for_server(url, timeout_s, self.started.processes[-1])
            model = client.served_model(self.workers[0])
            kv = [f"--kv-event-source={url}=tcp://127.0.0.1:{event}" for url, event in zip(self.workers, events)]
            self.started.start([str(Path(sys.executable).with_name("vllm-router")), "--worker-urls", *self.workers,
                                "--policy", policy, "--port", self.router.rsplit(":", 1)[1], "--prometheus-port",
                                str(free_port()), *(["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model",
                                                     model, *kv] if events else [])], "router")
            wait_healthy(self.router, 60, self.started.processes[-1])
        except BaseException:
            self.started.stop()
            raise


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen) -> None:
    """Until GET /health answers 200 (vllm-router's body is empty, so only the status is read)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the router at {url} did not become healthy")
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_counters(url: str, wanted: Sequence[str] = ("jaxserve:prefix_cache_queries_total",
                                                       "jaxserve:prefix_cache_hits_total",
                                                       "jaxserve:request_success_total")) -> dict[str, float]:
    """A worker's metrics named `wanted`, each summed over its labels."""
    import httpx

    counters = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0]
        if name in counters:
            counters[name] += float(line.split()[-1])
    return counters


async def run_conversations(base_url: str, model: str, chats: list[tuple[str, list[str]]],
                            args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every turn of every conversation through `base_url`; one row per turn."""
    gate = asyncio.Semaphore(args.concurrency)
    rows: list[dict[str, Any]] = []
    async with client.open_session(3600.0) as session:
        async def converse(index: int, doc: str, questions: list[str]) -> None:
            messages = [{"role": "system", "content": doc}]
            async with gate:
                for turn, question in enumerate(questions, 1):
                    messages.append({"role": "user", "content": question})
                    body = {"model": model, "messages": messages, "max_tokens": args.output_len, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                    result = await client.send_request(session, base_url + client.CHAT, client.CHAT, body, 0, 0.0)
                    rows.append({"conversation": index, "turn": turn, "success": result.success,
                                 "error": result.error, "ttft": result.ttft, "prompt_len": result.prompt_len,
                                 "cached_tokens": result.cached_tokens,
                                 "itl": result.itl})
                    messages.append({"role": "assistant", "content": result.generated_text})

        await asyncio.gather(*(converse(i, doc, questions) for i, (doc, questions) in enumerate(chats)))
    return rows


def policy_figures(rows: list[dict[str, Any]], before: list[dict], after: list[dict]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 1 and r["success"]]
    queries = sum(a["jaxserve:prefix_cache_queries_total"] - b["jaxserve:prefix_cache_queries_total"]
                  for a, b in zip(after, before))
    hits = sum(a["jaxserve:prefix_cache_hits_total"] - b["jaxserve:prefix_cache_hits_total"]
               for a, b in zip(after, before))
    ttft = [r["ttft"] for r in later]
    return {"requests": len(rows), "failed": sum(not r["success"] for r in rows),
            "later_turn_hit_rate": round(sum(r["cached_tokens"] for r in later)
                                         / max(1, sum(r["prompt_len"] for r in later)), 3),
            "worker_hit_rate": round(hits / max(1.0, queries), 3),
            "later_ttft_ms": {f"p{p}": round(1000 * percentile(ttft, p), 1) for p in (50, 90)},
            "served_per_worker": [int(a["jaxserve:request_success_total"] - b["jaxserve:request_success_total"])
                                  for a, b in zip(after, before)]}


def run_policy(policy: str, chats: list[tuple[str, list[str]]], args: argparse.Namespace) -> dict[str, Any]:
    servers = Servers(2, policy, args.server_timeout,
                      ["--num-kv-pages", str(args.num_kv_pages)] if args.num_kv_pages else [])
    try:
        model = client.served_model(servers.workers[0])
        before = [worker_counters(url) for url in servers.workers]
        router_cpu = cpu_seconds(servers.started.processes[-1].pid)
        rows = asyncio.run(run_conversations(servers.router, model, chats, args))
        router_cpu = cpu_seconds(servers.started.processes[-1].pid) - router_cpu
        after = [worker_counters(url) for url in servers.workers]
    finally:
        servers.started.stop()
    figures = policy_figures(rows, before, after)
    figures["router_cpu_ms_per_request"] = round(1000 * router_cpu / max(1, len(rows)), 2)
    return {"figures": figures, "rows": rows, "commands": servers.started.commands}


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Short chats one at a time, alternately direct and through the router, over one worker."""
    entries = datasets.load_prompt_file()
    servers = Servers(1, "round_robin", args.server_timeout)
    try:
        model = client.served_model(servers.router)
        results: dict[str, list] = {"direct": [], "router": []}

        async def go() -> None:
            async with client.open_session(600.0) as session:
                for index in range(args.overhead_requests):
                    way = "direct" if index % 2 == 0 else "router"
                    base = servers.workers[0] if way == "direct" else servers.router
                    body = {"model": model, "messages": datasets.chat_messages(entries[index % len(entries)]),
                            "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
                    results[way].append(await client.send_request(session, base + client.CHAT, client.CHAT, body,
                                                                   0, 0.0))

        asyncio.run(go())
    finally:
        servers.started.stop()
    figures = {}
    for way, done in results.items():
        ok = [r for r in done if r.success]
        figures[way] = {"requests": len(done), "failed": len(done) - len(ok),
                        "ttft_ms_p50": round(1000 * percentile([r.ttft for r in ok], 50), 2),
                        "chunk_gap_ms_p50": round(1000 * percentile([g for r in ok for g in r.itl], 50), 3)}
    figures["added"] = {"ttft_ms_p50": round(figures["router"]["ttft_ms_p50"] - figures["direct"]["ttft_ms_p50"], 2),
                        "chunk_gap_ms_p50": round(figures["router"]["chunk_gap_ms_p50"]
                                                  - figures["direct"]["chunk_gap_ms_p50"], 3)}
    return {"figures": figures, "commands": servers.started.commands}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="*", choices=POLICIES, default=["cache_aware", "round_robin"])
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    parser.add_argument("--overhead-requests", type=int, default=40, help="0: skip the router-overhead part")
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds a worker may take to start")
    parser.add_argument("--num-kv-pages", type=int, default=None,
                        help="each worker's KV pages (of 16 tokens): fewer than the conversations need evicts")
    common.add_common_args(parser)
    argv, args = common.start(parser, argv)
    chats = conversations(args, common.load_tokenizer(None))
    policies = {policy: run_policy(policy, chats, args) for policy in args.policies}
    if policies:
        print(common.format_table(
            ["policy", "later-turn hit rate (usage)", "worker hit rate", "later TTFT p50/p90 ms",
             "served per worker", "router CPU ms/request", "failed"],
            [[policy, f["later_turn_hit_rate"], f["worker_hit_rate"],
              f"{f['later_ttft_ms']['p50']}/{f['later_ttft_ms']['p90']}", f["served_per_worker"],
              f["router_cpu_ms_per_request"], f["failed"]]
             for policy, f in ((p, r["figures"]) for p, r in policies.items())]))
    overhead = run_overhead(args) if args.overhead_requests else None
    if overhead is not None:
        f = overhead["figures"]
        print(common.format_table(["path", "TTFT p50 ms", "chunk gap p50 ms", "failed"],
                                  [[way, f[way]["ttft_ms_p50"], f[way]["chunk_gap_ms_p50"], f[way]["failed"]]
                                   for way in ("direct", "router")]
                                  + [["router - direct", f["added"]["ttft_ms_p50"], f["added"]["chunk_gap_ms_p50"],
                                      ""]]))
    payload = {"policies": policies, "overhead": overhead, "worker_flags": WORKER, "num_kv_pages": args.num_kv_pages,
               "load_average_after": common.load_average()}
    path = common.write_result(NAME, payload, args.result_file, argv, machine=common.machine_info(include_jax=False))
    print(f"result: {path}")
    return payload


if __name__ == "__main__":
    main()

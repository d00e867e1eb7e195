"""Scheduling for latency targets: the same workload against jaxserve servers that differ only in policy.

Two workloads (`--workload`), both `jaxserve bench serve --dataset-name mixed` streams:
- `mixed`: Poisson arrivals (`--request-rate`) of short chats (40-128 prompt tokens, 16-64 output) with
  `--long-fraction` of long prompts (1,500-2,000 tokens), every request carrying its category's latency targets
  (`--short-slo`, `--long-slo`: TTFT_MS:TPOT_MS);
- `burst`: `--burst-longs` long prompts at once, then from a second later a Poisson stream of `--num-prompts` short
  chats; no request sets targets: every one takes the server's (`--server-slo`, given to every arm).
Each arm starts a fresh `python -m jaxserve serve` with its flags (`ARMS`) and sends the identical requests on the
identical schedule.
Reported per arm: the short requests' TTFT p50/p90/p99 and TPOT p50/p90, goodput (requests that met both of their
targets, client-side), output and total throughput, and the long requests' completion times; plus a plot of each
request's TTFT over its send time for every arm.

    python benchmarks/slo_scheduling.py                          # fcfs vs slo, 120 requests at 0.7 req/s
    python benchmarks/slo_scheduling.py --arms fcfs fcfs+limits slo slo+limits --request-rate 0.8
    python benchmarks/slo_scheduling.py --workload burst --num-prompts 40 --request-rate 1
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench import client, serve
from jaxserve.bench.metrics import percentile
from benchmarks.run_default_suite import free_port, stop_server

NAME = "slo_scheduling"
# each arm's server flags on top of `SERVER`; the threshold keeps a long prompt's chunks small, so a step that also
# carries a short prompt stays short
LIMITS = ["--long-prefill-token-threshold", "128"]
ARMS = {"fcfs": ["--scheduling-policy", "fcfs"],
        "fcfs+limits": ["--scheduling-policy", "fcfs", *LIMITS],
        "slo": ["--scheduling-policy", "slo"],
        "slo+limits": ["--scheduling-policy", "slo", *LIMITS]}
BURST_DELAY = 1.0  # seconds from the long prompts to the first short one
SERVER = ["--max-model-len", "2112", "--max-num-batched-tokens", "512",
          "--log-stats-interval", "0"]


def summarize(requests: list[dict[str, Any]], targets: dict[str, dict[str, float]], duration: float
              ) -> dict[str, Any]:
    """One arm's figures from its per-request rows (times in ms)."""
    ok = [r for r in requests if r["success"]]
    short = [r for r in ok if r["category"] == "short"]
    long = [r for r in ok if r["category"] == "long"]

    def met(row: dict[str, Any]) -> bool:
        target = targets[row["category"]]
        return (1000 * row["ttft"] <= target["ttft_slo_ms"]
                and (row["tpot"] is None or 1000 * row["tpot"] <= target["tpot_slo_ms"]))

    def ms(values: list[float], p: float) -> float:
        return round(1000 * percentile(values, p), 1)

    ttft, tpot = [r["ttft"] for r in short], [r["tpot"] for r in short if r["tpot"] is not None]
    return {"requests": len(requests), "failed": len(requests) - len(ok),
            "short_ttft_ms": {f"p{p}": ms(ttft, p) for p in (50, 90, 99)},
            "short_tpot_ms": {f"p{p}": ms(tpot, p) for p in (50, 90)},
            "goodput": round(sum(met(r) for r in ok) / len(requests), 3),
            "goodput_short": round(sum(met(r) for r in short) / max(1, len(short)), 3),
            "output_tok_s": round(sum(r["output_len"] for r in ok) / duration, 1),
            "total_tok_s": round(sum(r["output_len"] + r["prompt_len"] for r in ok) / duration, 1),
            "long_ttft_ms": {"p50": ms([r["ttft"] for r in long], 50), "max": ms([r["ttft"] for r in long], 100)},
            "long_latency_ms": {"p50": ms([r["latency"] for r in long], 50),
                                "max": ms([r["latency"] for r in long], 100)},
            "long_completed": f"{len(long)}/{sum(1 for r in requests if r['category'] == 'long')}"}


def request_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per request from `jaxserve bench serve --save-detailed`'s per-request lists."""
    rows = []
    for values in zip(payload["categories"], payload["errors"], payload["input_lens"], payload["output_lens"],
                      payload["ttfts"], payload["latencies"], payload["start_times"]):
        category, error, prompt_len, output_len, ttft, latency, send_time = values
        tpot = (latency - ttft) / (output_len - 1) if output_len > 1 else None
        rows.append({"category": category, "success": not error, "error": error, "prompt_len": prompt_len,
                     "output_len": output_len, "ttft": ttft, "latency": latency, "tpot": tpot,
                     "send_time": send_time})
    return rows


def merged(payloads: list[dict[str, Any]], delays: list[float]) -> dict[str, Any]:
    """Several clients' detailed results as one run's: their per-request lists joined, send times from the first
    client's start (client i started `delays[i]` seconds after it), the duration until the last one ended."""
    keys = ("categories", "errors", "input_lens", "output_lens", "ttfts", "latencies")
    out: dict[str, Any] = {key: [v for p in payloads for v in p[key]] for key in keys}
    out["start_times"] = [t + delay for p, delay in zip(payloads, delays) for t in p["start_times"]]
    out["duration"] = max(delay + p["duration"] for p, delay in zip(payloads, delays))
    return out


def run_clients(clients: list[tuple[float, list[str]]], base_url: str, arm: str) -> dict[str, Any]:
    """Runs `jaxserve bench serve` once per `(delay, flags)` client, each started `delay` seconds after the first,
    concurrently; returns their merged detailed result."""
    payloads: list[Any] = [None] * len(clients)
    errors: list[BaseException] = []
    start = time.monotonic()
    delays = [0.0] * len(clients)

    def run(index: int, delay: float, flags: list[str]) -> None:
        time.sleep(delay)
        delays[index] = time.monotonic() - start
        try:
            payloads[index] = serve.main([*flags, "--base-url", base_url, "--save-result", "--save-detailed",
                                          "--result-dir", tempfile.mkdtemp(prefix="slo-"), "--label", arm])[0]
        except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, delay, flags)) for i, (delay, flags) in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return payloads[0] if len(payloads) == 1 else merged(payloads, delays)


def run_arm(arm: str, clients: list[tuple[float, list[str]]], server_flags: list[str], python: str,
            timeout_s: float) -> dict[str, Any]:
    """Starts the arm's server, runs the workload's clients against it, stops it; returns the detailed result."""
    port = free_port()
    command = [python, "-m", "jaxserve", "serve", "--port", str(port), *SERVER, *server_flags, *ARMS[arm]]
    print(f"\n$ {' '.join(command)} &", flush=True)
    with tempfile.NamedTemporaryFile("w", prefix=f"jaxserve-{arm}-", suffix=".log", delete=False) as log:
        server = subprocess.Popen(command, cwd=common.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        client.wait_for_server(f"http://127.0.0.1:{port}", timeout_s, server)
        payload = run_clients(clients, f"http://127.0.0.1:{port}", arm)
    finally:
        stop_server(server)
    payload["server_command"] = " ".join(command)
    payload["server_log"] = log.name
    return payload


def draw(arms: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """TTFT over send time, one panel per arm, short and long requests marked apart."""
    from benchmarks.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(arms), figsize=(5.5 * len(arms), 4), sharey=True, squeeze=False)
    for ax, (arm, payload) in zip(axes[0], arms.items()):
        rows = [r for r in request_rows(payload) if r["success"]]
        for category, marker, color in (("short", ".", "tab:blue"), ("long", "x", "tab:red")):
            chosen = [r for r in rows if r["category"] == category]
            ax.scatter([r["send_time"] for r in chosen], [r["ttft"] for r in chosen], marker=marker, s=18,
                       color=color, label=f"{category} ({len(chosen)})")
        ax.set_title(arm)
        ax.set_xlabel("send time (s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("TTFT (s)")
    fig.suptitle(title)
    return _save(fig, path)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["mixed", "burst"], default="mixed")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["fcfs", "slo"])
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--request-rate", type=float, default=0.7)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--short-slo", default="1000:500", metavar="TTFT_MS:TPOT_MS")
    parser.add_argument("--long-slo", default="20000:500", metavar="TTFT_MS:TPOT_MS")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the servers' decode slots")
    parser.add_argument("--burst-longs", type=int, default=4, help="burst: long prompts sent at once")
    parser.add_argument("--server-slo", default="1500:400", metavar="TTFT_MS:TPOT_MS",
                        help="burst: the server's targets (--ttft-slo-ms, --tpot-slo-ms), which every request takes")
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server may take to start")
    common.add_common_args(parser)
    args = parser.parse_args(argv)
    common_args = ["--dataset-name", "mixed", "--ignore-eos", "--disable-tqdm"]
    if args.workload == "mixed":
        targets = serve.request_slos([f"short:{args.short_slo}", f"long:{args.long_slo}"])
        server_flags = ["--max-num-seqs", str(args.max_num_seqs)]
        clients = [(0.0, [*common_args, "--num-prompts", str(args.num_prompts), "--mixed-long-fraction",
                          str(args.long_fraction), "--request-rate", str(args.request_rate), "--request-slo",
                          f"short:{args.short_slo}", f"long:{args.long_slo}", "--seed", str(args.seed)])]
    else:
        targets = serve.request_slos([f"short:{args.server_slo}", f"long:{args.server_slo}"])
        ttft_ms, tpot_ms = args.server_slo.split(":")
        server_flags = ["--max-num-seqs", str(args.max_num_seqs), "--ttft-slo-ms", ttft_ms, "--tpot-slo-ms", tpot_ms]
        clients = [(0.0, [*common_args, "--num-prompts", str(args.burst_longs), "--mixed-long-fraction", "1",
                          "--request-rate", "inf", "--seed", str(args.seed)]),
                   (BURST_DELAY, [*common_args, "--num-prompts", str(args.num_prompts), "--mixed-long-fraction", "0",
                                  "--request-rate", str(args.request_rate), "--seed", str(args.seed + 1)])]
    arms = {arm: run_arm(arm, clients, server_flags, sys.executable, args.server_timeout) for arm in args.arms}
    figures = {arm: summarize(request_rows(p), targets, p["duration"])
               for arm, p in arms.items()}
    print(common.format_table(
        ["arm", "short TTFT p50/p90/p99 ms", "short TPOT p50/p90 ms", "goodput", "out tok/s", "total tok/s",
         "long latency p50/max ms", "long done"],
        [[arm, "/".join(str(v) for v in f["short_ttft_ms"].values()),
          "/".join(str(v) for v in f["short_tpot_ms"].values()), f["goodput"], f["output_tok_s"], f["total_tok_s"],
          f"{f['long_latency_ms']['p50']}/{f['long_latency_ms']['max']}", f["long_completed"]]
         for arm, f in figures.items()]))
    payload = {"arms": {arm: {"figures": figures[arm], "server_command": p["server_command"],
                              "requests": request_rows(p)} for arm, p in arms.items()},
               "workload": args.workload, "clients": clients, "targets_ms": targets,
               "load_average_after": common.load_average()}
    path = common.write_result(NAME, payload, args.result_file, list(argv or sys.argv[1:]),
                               machine=common.machine_info(include_jax=False))
    if not args.no_plot:
        title = f"TTFT over time ({args.workload}): {', '.join(arms)}"
        print(f"plot: {draw(arms, path.with_suffix('.png'), title)}")
    print(f"result: {path}")
    return payload


if __name__ == "__main__":
    main()

"""`make bench`: the small default benchmark suite, sized to finish in under 10 minutes on 2 CPU cores.

Owns the list of default runs and their budget. Each step is one of the benchmark scripts, run as a
subprocess with the exact command printed (so RESULTS.md can quote it), its JSON written under
benchmarks/results/. Steps run in order of importance; a step whose estimated time no longer fits the
remaining budget is skipped and reported as such, never silently dropped. At the end, one table of the
headline numbers, and benchmarks/results/suite.json with every command, status and duration.

    python benchmarks/run_default_suite.py              # the suite (default model)
    python benchmarks/run_default_suite.py --dry-run    # print the commands only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common

BENCH_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass
class Step:
    name: str
    script: str  # path relative to benchmarks/
    args: list[str]
    estimate_s: float  # expected wall time on a quiet 2-core CPU machine, for budgeting
    needs_server: bool = False

    @property
    def result_file(self) -> Path:
        return common.RESULTS_DIR / f"{self.name}.json"

    def command(self, python: str) -> list[str]:
        if self.script.startswith("jaxserve "):  # a packaged command: vLLM's result flags
            return [python, "-m", *self.script.split(), *self.args, "--save-result", "--result-dir",
                    str(common.RESULTS_DIR), "--result-filename", f"{self.name}.json"]
        return [python, str(Path("benchmarks") / self.script), *self.args, "--result-file",
                str(self.result_file.relative_to(common.REPO_ROOT))]


ENGINE = ["--max-num-seqs", "64", "--max-model-len", "512", "--max-num-batched-tokens", "512"]


def default_steps(model: str | None) -> list[Step]:
    """The suite: small versions of every benchmark. Estimates are from runs on a shared 2-core EPYC."""
    model_args = ["--model", model] if model else []
    return [
        Step("compare", "compare.py", [*model_args, *ENGINE, "--dataset-name", "random", "--num-prompts", "64",
                                       "--input-len", "128", "--output-len", "64", "--hf-batch-size", "64",
                                       "--single-stream-tokens", "32"], estimate_s=150),
        Step("roofline", "roofline.py", [*model_args, *ENGINE, "--batch-sizes", "1", "4", "16", "64",
                                         "--context", "256"], estimate_s=40),
        Step("throughput-shared-prefix", "throughput.py",
             [*model_args, *ENGINE, "--dataset-name", "prefix_repetition", "--num-prompts", "64",
              "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-prefix-len", "256",
              "--prefix-repetition-suffix-len", "32", "--output-len", "16"], estimate_s=50),
        Step("serving", "jaxserve bench serve",
             ["--dataset-name", "prompts", "--num-prompts", "16", "--output-len", "32", "--max-model-len", "512",
              "--ignore-eos", "--max-concurrency", "1", "4", "16", "--goodput", "ttft:2000", "tpot:250",
              "--metric-percentiles", "50,90,99"], estimate_s=80, needs_server=True),
        Step("throughput-prompts", "throughput.py",
             [*model_args, *ENGINE, "--dataset-name", "prompts", "--num-prompts", "64", "--output-len", "64",
              "--concurrency", "1", "4", "16", "64", "--sweep-waves", "2"], estimate_s=150),
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(python: str, model: str | None, port: int) -> list[str]:
    return [python, "-m", "jaxserve", "serve", *(["--model", model] if model else []), "--port", str(port),
            *ENGINE, "--log-stats-interval", "0"]


def display_path(executable: str) -> str:
    """The interpreter relative to the repository root when it lives there (commands run from the root)."""
    try:
        return str(Path(executable).relative_to(common.REPO_ROOT))
    except ValueError:
        return executable


def server_available() -> bool:
    try:
        import jaxserve.server  # noqa: F401
    except ImportError:
        return False
    return True


def stop_server(server: subprocess.Popen) -> None:
    """Stops a server as Ctrl-C would (killed if it takes over 30 s)."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run_step(step: Step, python: str, model: str | None, timeout_s: float) -> dict[str, Any]:
    """Runs one step (starting and stopping a server for serving steps); returns its record."""
    command = step.command(python)
    server = None
    started = time.perf_counter()
    record: dict[str, Any] = {"name": step.name, "command": " ".join(command), "result_file": str(step.result_file)}
    try:
        if step.needs_server:
            from jaxserve.bench.client import wait_for_server

            port = free_port()
            record["server_command"] = " ".join(server_command(python, model, port))
            print(f"\n$ {record['server_command']} &", flush=True)
            server_log = tempfile.NamedTemporaryFile("w", prefix="jaxserve-server-", suffix=".log", delete=False)
            record["server_log"] = server_log.name
            server = subprocess.Popen(server_command(python, model, port), cwd=common.REPO_ROOT,
                                      stdout=server_log, stderr=subprocess.STDOUT)
            wait_for_server(f"http://127.0.0.1:{port}", timeout_s, server)
            command += ["--base-url", f"http://127.0.0.1:{port}"]
            if model:
                command += ["--tokenizer", model]
            record["command"] = " ".join(command)
        print(f"\n$ {record['command']}", flush=True)
        remaining = max(1.0, timeout_s - (time.perf_counter() - started))
        completed = subprocess.run(command, cwd=common.REPO_ROOT, timeout=remaining)
        record["status"] = "ok" if completed.returncode == 0 else f"failed (exit {completed.returncode})"
    except subprocess.TimeoutExpired:
        record["status"] = f"timed out after {timeout_s:.0f}s"
    except RuntimeError as err:
        record["status"] = f"failed: {err}"
    finally:
        if server is not None:
            stop_server(server)
    record["duration_s"] = time.perf_counter() - started
    return record


def headline(records: list[dict[str, Any]]) -> list[list[Any]]:
    """[step, metric, value] rows from the result files of the steps that succeeded."""
    rows: list[list[Any]] = []
    for record in records:
        if record.get("status") == "ok" and record["name"] == "serving":
            for run in serving_runs():
                level = f"c={run['max_concurrency']}"
                rows += [["serving", f"{level} output tok/s", run["output_throughput"]],
                         ["serving", f"{level} TTFT median ms", run["median_ttft_ms"]],
                         ["serving", f"{level} TPOT median ms", run["median_tpot_ms"]]]
        if record.get("status") != "ok" or not Path(record["result_file"]).exists():
            continue
        data = common.read_result(record["result_file"])
        name = record["name"]
        if name == "compare":
            jx, hf = data["jaxserve"], data.get("hf_transformers") or {}
            rows += [[name, "jaxserve output tok/s", jx["result"]["output_throughput"]],
                     [name, "HF transformers output tok/s", hf.get("result", {}).get("output_throughput")],
                     [name, "throughput ratio jaxserve/HF", data.get("ratios", {}).get("output_throughput")],
                     [name, "batch-1 decode tok/s jaxserve", (jx.get("single_stream") or {}).get("decode_tok_s")],
                     [name, "batch-1 decode ratio jaxserve/HF", data.get("ratios", {}).get("single_stream_decode")]]
            if jx.get("roofline"):
                rows.append([name, f"% of roofline at batch {jx['roofline']['batch']}",
                             jx["roofline"]["percent_of_roofline"]])
        elif name == "roofline":
            rows += [[name, f"% of roofline at batch {p['batch']}", p["percent_of_roofline"]] for p in data["points"]]
        elif name.startswith("throughput"):
            result = data["result"]
            rows += [[name, "output tok/s", result["output_throughput"]],
                     [name, "peak KV usage %", 100 * result["peak_kv_usage"]]]
            if result.get("prefix_hit_rate") is not None:
                rows.append([name, "prefix hit rate %", 100 * result["prefix_hit_rate"]])
            rows += [[name, f"closed loop c={p['concurrency']} output tok/s", p["output_throughput"]]
                     for p in data.get("closed_loop_sweep", [])]
    return rows


def serving_runs() -> list[dict[str, Any]]:
    """The serving step's result files (one per concurrency level: jaxserve bench serve's sweep), by level."""
    runs = [common.read_result(path) for path in common.RESULTS_DIR.glob("serving-*qps*.json")]
    return sorted(runs, key=lambda run: run["max_concurrency"] or 0)


def combined_concurrency_plot(records: list[dict[str, Any]]) -> Path | None:
    """Output tok/s vs concurrency, offline closed loop and online serving in one figure, when both ran."""
    from benchmarks import plots

    series, label = {}, None
    for record in records:
        if record.get("status") != "ok" or not Path(record["result_file"]).exists():
            continue
        data = common.read_result(record["result_file"])
        label = common.machine_label(data["machine"])
        if data.get("closed_loop_sweep"):
            series[f"offline, LLM engine closed loop ({data['workload']['dataset_name']})"] = [
                (p["concurrency"], p["output_throughput"]) for p in data["closed_loop_sweep"]]
    runs = [run for run in serving_runs() if run["max_concurrency"]]
    if runs:
        series[f"online, HTTP streaming ({runs[0]['dataset']['dataset_name']})"] = [
            (run["max_concurrency"], run["output_throughput"]) for run in runs]
    if not series:
        return None
    return plots.throughput_vs_concurrency(series, common.RESULTS_DIR / "throughput-vs-concurrency.png",
                                           f"jaxserve output throughput vs concurrency, {label}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model for every step (default: the embedded default model)")
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for the whole suite")
    parser.add_argument("--only", nargs="*", default=None, help="run only these step names")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    python = display_path(sys.executable or "python")
    steps = [s for s in default_steps(args.model) if args.only is None or s.name in args.only]
    if args.dry_run:
        for step in steps:
            if step.needs_server:
                print("$ " + " ".join(server_command(python, args.model, 8000)) + " &")
            print("$ " + " ".join(step.command(python)))
        return {"steps": [s.name for s in steps]}

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    suite_started = time.perf_counter()
    records: list[dict[str, Any]] = []
    has_server = server_available()
    for step in steps:
        spent = time.perf_counter() - suite_started
        left = args.budget - spent
        if step.needs_server and not has_server:
            records.append({"name": step.name, "status": "skipped: jaxserve.server cannot be imported"})
            continue
        if step.estimate_s > left:
            records.append({"name": step.name, "status": f"skipped: needs ~{step.estimate_s:.0f}s, {left:.0f}s left"})
            continue
        # a step may take twice its estimate (a busy shared machine), never more than the suite's budget
        records.append(run_step(step, python, args.model, min(left, 2 * step.estimate_s + 60)))
    total = time.perf_counter() - suite_started
    combined = combined_concurrency_plot(records)
    if combined:
        print(f"plot: {combined}")
    path = common.write_result("suite", {"budget_s": args.budget, "total_s": total, "steps": records}, None, argv)
    print("\n" + common.format_table(["step", "status", "seconds"],
                                     [[r["name"], r["status"], r.get("duration_s")] for r in records]))
    rows = headline(records)
    if rows:
        print("\n" + common.format_table(["step", "metric", "value"], rows))
    print(f"\nsuite: {total:.0f}s of {args.budget:.0f}s budget; {path}")
    return {"steps": records, "total_s": total}


if __name__ == "__main__":
    main()

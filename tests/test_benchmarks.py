"""benchmarks/ and the metric, workload and client code it shares with `jaxserve bench` (jaxserve/bench/): the metric
math against hand-computed values, the workloads, the streaming client on a virtual clock, every script's --help,
and every benchmark end to end on a tiny random model (the attention kernels on tiny shapes) with a tiny workload.
The `jaxserve bench` commands themselves are tests/test_bench_cli.py.

These tests check that the benchmarks measure correctly; they make no performance claims and assert no wall-clock
durations (the machine is shared): timing logic is checked on a virtual clock, where every duration is exact.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import common
from jaxserve.bench import client, datasets, metrics, serve
from jaxserve.bench.metrics import RequestResult

REPO = Path(__file__).resolve().parents[1]
TINY_ENGINE = ["--max-num-seqs", "4", "--max-model-len", "128", "--max-num-batched-tokens", "64"]
SCRIPTS = ["throughput.py", "compare.py", "roofline.py", "plots.py", "run_default_suite.py",
           "baselines/hf_transformers.py", "kernel_bench.py", "random_model.py", "loading_memory.py", "host_overhead.py",
           "gpu_8b.py", "quant_speed.py", "quality.py", "spec_decode.py", "prompt_scoring.py", "multi_turn.py", "hybrid_capacity.py", "slo_scheduling.py", "routing.py", "lora.py",
           "train_eagle3.py", "eagle3_speed.py",
           "lm_eval_tasks/make_data.py", "lm_eval_tasks/export_hf.py", "lm_eval_tasks/compare_samples.py"]


# -- metric math ---------------------------------------------------------------------------------------------


def test_tpot_excludes_the_first_token():
    # 5 tokens: first at 0.5 s, last at 1.3 s -> 4 gaps over 0.8 s
    assert metrics.tpot(RequestResult(True, 10, output_len=5, ttft=0.5, latency=1.3)) == pytest.approx(0.2)
    assert metrics.tpot(RequestResult(True, 10, output_len=1, ttft=0.5, latency=0.5)) is None
    assert metrics.tpot(RequestResult(True, 10, output_len=0)) is None


def test_percentiles_interpolate_linearly():
    values = [1.0, 2.0, 3.0, 4.0]
    assert metrics.percentile(values, 50) == pytest.approx(2.5)
    assert metrics.percentile(values, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7
    assert metrics.percentile(values, 99) == pytest.approx(3.97)
    assert metrics.percentile(values, 0) == 1.0 and metrics.percentile(values, 100) == 4.0
    assert math.isnan(metrics.percentile([], 50))
    stats = metrics.summarize_ms([0.001, 0.002, 0.003, 0.004])
    assert stats["mean"] == pytest.approx(2.5) and stats["median"] == pytest.approx(2.5)
    assert stats["p90"] == pytest.approx(3.7) and stats["p99"] == pytest.approx(3.97)


def test_parse_goodput():
    assert metrics.parse_goodput(["ttft:500", "TPOT:50.5", "e2el:3000"]) == {"ttft": 500.0, "tpot": 50.5,
                                                                         "e2el": 3000.0}
    assert metrics.parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:0"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad)


def test_goodput_counts_requests_meeting_every_slo():
    slo = {"ttft": 200.0, "tpot": 50.0, "e2el": 700.0}
    good = RequestResult(True, 8, output_len=11, ttft=0.150, latency=0.650)  # tpot 50 ms: on the limit
    slow_first = RequestResult(True, 8, output_len=11, ttft=0.250, latency=0.600)
    slow_tokens = RequestResult(True, 8, output_len=11, ttft=0.100, latency=0.700)  # tpot 60 ms
    slow_overall = RequestResult(True, 8, output_len=21, ttft=0.100, latency=0.900)  # tpot 40 ms, e2el 900 ms
    one_token = RequestResult(True, 8, output_len=1, ttft=0.190, latency=0.190)  # tpot counts as 0
    failed = RequestResult(False, 8, error="boom")
    requests = [good, slow_first, slow_tokens, slow_overall, one_token, failed]
    assert [metrics.meets_slo(r, slo) for r in requests] == [True, False, False, False, True, False]
    assert metrics.meets_slo(slow_overall, {"ttft": 200.0, "tpot": 50.0})  # only the e2el SLO fails it
    summary = metrics.compute_serving_metrics(requests, 2.0, slo)
    assert summary.goodput == pytest.approx(1.0)  # 2 good requests over 2 s


def test_compute_serving_metrics_by_hand():
    results = [
        RequestResult(True, prompt_len=10, output_len=4, ttft=0.1, latency=0.4, itl=[0.1, 0.1, 0.1]),
        RequestResult(True, prompt_len=20, output_len=3, ttft=0.3, latency=0.9, itl=[0.2, 0.4]),
        RequestResult(False, prompt_len=30, error="HTTP 500"),
    ]
    m = metrics.compute_serving_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 7)  # failed requests count nowhere
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(18.5)
    assert m.goodput is None
    assert m.ttft_ms["mean"] == pytest.approx(200.0) and m.ttft_ms["median"] == pytest.approx(200.0)
    # TPOT: (0.4 - 0.1) / 3 = 100 ms and (0.9 - 0.3) / 2 = 300 ms
    assert m.tpot_ms["mean"] == pytest.approx(200.0)
    assert m.tpot_ms["p90"] == pytest.approx(280.0)
    # ITL pools every gap: 100, 100, 100, 200, 400 ms
    assert m.itl_ms["mean"] == pytest.approx(180.0) and m.itl_ms["median"] == pytest.approx(100.0)
    assert m.itl_ms["p90"] == pytest.approx(320.0)
    assert m.e2el_ms["mean"] == pytest.approx(650.0)
    rows = dict(metrics.serving_report_rows(m, None, math.inf))
    assert rows["Successful requests:"] == "2" and rows["Request rate configured (RPS):"] == "inf"
    assert rows["Mean TPOT (ms):"] == "200.00" and "Request goodput (req/s):" not in rows
    with pytest.raises(ValueError):
        metrics.compute_serving_metrics(results, 0.0)


def test_arrival_intervals():
    assert client.arrival_intervals(5, math.inf) == [0.0] * 5
    poisson = client.arrival_intervals(4000, 10.0, seed=1)
    assert np.mean(poisson) == pytest.approx(0.1, rel=0.05)
    assert np.std(poisson) == pytest.approx(0.1, rel=0.1)  # exponential: std = mean
    bursty = client.arrival_intervals(4000, 10.0, burstiness=0.25, seed=1)
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.1) and np.std(bursty) > 1.5 * np.std(poisson)
    assert client.arrival_intervals(10, 3.0, seed=7) == client.arrival_intervals(10, 3.0, seed=7)
    with pytest.raises(ValueError):
        client.arrival_intervals(3, 0.0)


# -- workloads -----------------------------------------------------------------------------------------------


def test_random_dataset_lengths_and_determinism():
    records = datasets.random_dataset(50, 100, 20, vocab_size=1000, range_ratio=0.5, seed=3)
    assert len(records) == 50
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.expected_output_len <= 30 for r in records)
    assert all(0 <= t < 1000 for r in records for t in r.prompt_token_ids)
    assert records == datasets.random_dataset(50, 100, 20, vocab_size=1000, range_ratio=0.5, seed=3)
    assert records != datasets.random_dataset(50, 100, 20, vocab_size=1000, range_ratio=0.5, seed=4)
    fixed = datasets.random_dataset(4, 16, 8, vocab_size=1000)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(16, 8)}
    capped = datasets.random_dataset(20, 100, 20, vocab_size=1000, range_ratio=0.5, seed=3, max_model_len=120)
    assert capped and all(r.prompt_len + r.expected_output_len <= 120 for r in capped)


def test_prefix_repetition_dataset_shares_prefixes():
    records = datasets.prefix_repetition_dataset(12, num_prefixes=3, prefix_len=40, suffix_len=8, output_len=4,
                                                 vocab_size=1000, seed=0)
    groups: dict[str, set] = {}
    for record in records:
        assert record.prompt_len == 48
        groups.setdefault(record.category, set()).add(tuple(record.prompt_token_ids[:40]))
    assert len(groups) == 3 and all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({tuple(r.prompt_token_ids[40:]) for r in records}) == 12  # every suffix differs
    assert [r.category for r in records] != sorted(r.category for r in records)  # shuffled: groups interleave


def test_mixed_dataset_has_short_and_long_requests_in_their_ranges():
    records = datasets.mixed_dataset(200, 0.2, (40, 128), (1500, 2000), (16, 64), vocab_size=1000, seed=5)
    short = [r for r in records if r.category == "short"]
    long = [r for r in records if r.category == "long"]
    assert len(records) == 200 and 25 <= len(long) <= 55 and len(short) + len(long) == 200
    assert all(40 <= r.prompt_len <= 128 for r in short) and all(1500 <= r.prompt_len <= 2000 for r in long)
    assert all(16 <= r.expected_output_len <= 64 for r in records)
    assert records == datasets.mixed_dataset(200, 0.2, (40, 128), (1500, 2000), (16, 64), vocab_size=1000, seed=5)


def test_request_slos_and_the_slo_benchmarks_figures_by_hand():
    from benchmarks import slo_scheduling

    targets = serve.request_slos(["short:1000:200", "long:20000"])
    assert targets == {"short": {"ttft_slo_ms": 1000.0, "tpot_slo_ms": 200.0}, "long": {"ttft_slo_ms": 20000.0}}
    with pytest.raises(ValueError, match="CATEGORY:TTFT_MS"):
        serve.request_slos(["short:fast"])
    targets["long"]["tpot_slo_ms"] = 500.0

    def row(category, ttft, tpot, latency, output_len=10, success=True):
        return {"success": success, "category": category, "prompt_len": 100, "output_len": output_len,
                "ttft": ttft, "tpot": tpot, "latency": latency}

    rows = [row("short", 0.5, 0.1, 1.4), row("short", 1.5, 0.1, 2.4), row("short", 0.2, 0.3, 2.9),
            row("long", 9.0, 0.4, 12.6), row("long", 0, None, 0, success=False)]
    figures = slo_scheduling.summarize(rows, targets, duration=10.0)
    assert figures["short_ttft_ms"]["p50"] == 500.0 and figures["failed"] == 1
    assert figures["goodput"] == 0.4 and figures["goodput_short"] == pytest.approx(1 / 3, abs=1e-3)  # 1st, 4th
    assert figures["output_tok_s"] == 4.0 and figures["total_tok_s"] == 44.0
    assert figures["long_completed"] == "1/2" and figures["long_latency_ms"]["max"] == 12600.0
    # the burst workload's two clients as one run: send times from the first client's start
    lists = ("categories", "errors", "input_lens", "output_lens", "ttfts", "latencies")
    longs = {**{key: ["long"] if key == "categories" else [1] for key in lists}, "start_times": [0.0], "duration": 9.0}
    shorts = {**{key: ["short"] * 2 if key == "categories" else [2, 3] for key in lists}, "start_times": [0.0, 2.0],
              "duration": 4.0}
    merged = slo_scheduling.merged([longs, shorts], [0.0, 1.0])
    assert merged["categories"] == ["long", "short", "short"] and merged["start_times"] == [0.0, 1.0, 3.0]
    assert merged["duration"] == 9.0 and merged["ttfts"] == [1, 2, 3]


def test_prompt_file_is_diverse():
    entries = datasets.load_prompt_file()
    assert len(entries) >= 200
    assert len({e["category"] for e in entries}) >= 10
    assert len({e["id"] for e in entries}) == len(entries)
    assert len({e["prompt"] for e in entries}) == len(entries)
    lengths = sorted(len(e["prompt"]) for e in entries)
    assert lengths[0] < 20 and lengths[-1] > 800  # short questions and long contexts


def test_prompts_dataset_uses_the_chat_template(tiny_llama_dir):
    tokenizer = common.load_tokenizer(tiny_llama_dir)
    records = datasets.prompt_file_dataset(30, 16, tokenizer, seed=1, max_model_len=400)
    assert len(records) == 30 and all(r.prompt_len + 16 <= 400 for r in records)
    for record in records[:5]:
        expected = tokenizer.apply_chat_template(record.messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert record.prompt_token_ids == list(expected)
        assert record.prompt_text.startswith("<|im_start|>") and record.messages[-1]["role"] == "user"
    assert records == datasets.prompt_file_dataset(30, 16, tokenizer, seed=1, max_model_len=400)
    with_systems = datasets.prompt_file_dataset(300, 16, tokenizer, seed=1)
    assert any(r.messages[0]["role"] == "system" for r in with_systems)


# -- the streaming client against an in-process fake server on a virtual clock ----------------------------------

FIRST_CHUNK_S, GAP_S, CHUNKS = 0.25, 0.125, 4  # binary fractions: every sum and difference of them is exact


class VirtualClock:
    """The client's clock: seconds pass only when the fake server advances them."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeResponse:
    """What the client reads of an aiohttp response: status, headers, text() and the SSE lines of `content`."""

    def __init__(self, status: int, lines=None, text: str = ""):
        self.status, self.headers, self.content, self._text = status, {}, lines, text

    async def text(self, errors: str = "strict") -> str:
        return self._text

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class FakeSession:
    """An OpenAI server behind aiohttp's `session.post`, on a virtual clock; `received` is (arrival time, body).

    Each stream: an empty text chunk at once (not a token), then CHUNKS text chunks, the first FIRST_CHUNK_S after
    the request arrived and then one every GAP_S of virtual time, then usage and [DONE]. The stream hands control
    back to the event loop before every chunk, as a real connection would, so other requests' tasks run meanwhile.
    max_tokens 999 gets HTTP 400 with OpenAI's error JSON. The real aiohttp path is tests/test_bench_cli.py's.
    """

    def __init__(self, clock: VirtualClock):
        self.clock, self.received = clock, []

    def post(self, url: str, json: dict, **options) -> FakeResponse:  # options: aiohttp's trace context
        self.received.append((self.clock.now, json))
        if json.get("max_tokens") == 999:
            return FakeResponse(400, text='{"error": {"message": "too many tokens"}}')
        return FakeResponse(200, self.stream())

    async def stream(self):
        def event(data) -> bytes:
            return f"data: {data if isinstance(data, str) else json.dumps(data)}\n".encode()

        await asyncio.sleep(0)
        yield event({"choices": [{"index": 0, "text": ""}], "usage": None})
        for index in range(CHUNKS):
            await asyncio.sleep(0)
            self.clock.now += GAP_S if index else FIRST_CHUNK_S
            yield b"\n"
            yield event({"choices": [{"index": 0, "text": f"t{index}"}], "usage": None})
        yield event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": CHUNKS}})
        yield event("[DONE]")


def test_client_timing_excludes_the_concurrency_gate():
    record = datasets.RequestRecord([1, 2, 3], 4)
    body = client.build_payload(record, client.COMPLETIONS, "fake", "ids", ignore_eos=True)
    assert body["prompt"] == [1, 2, 3] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    clock = VirtualClock()
    session = FakeSession(clock)
    received = session.received
    results, duration = asyncio.run(client.run_benchmark("http://fake", client.COMPLETIONS, [body, body], [3, 3],
                                                         math.inf, 1.0, max_concurrency=1, seed=0,
                                                         disable_tqdm=True, clock=clock, session=session))
    one_request = FIRST_CHUNK_S + (CHUNKS - 1) * GAP_S
    # both were submitted at t = 0; the gate held the second until the first finished
    assert [t for t, _ in received] == [0.0, one_request] and [b for _, b in received] == [body, body]
    assert [r.send_time for r in results] == [0.0, one_request]
    for result in results:
        assert result.success, result.error
        assert result.output_len == CHUNKS and result.prompt_len == 7  # from the server's usage
        # timed from its own send: counting the gate would give the second request a TTFT of 2.5 x FIRST_CHUNK_S;
        # counting the empty first chunk as the first token would give 0
        assert result.ttft == FIRST_CHUNK_S
        assert result.itl == [GAP_S] * (CHUNKS - 1)
        assert result.latency == one_request
        assert metrics.tpot(result) == GAP_S
    assert duration == 2 * one_request


def test_client_reports_http_errors():
    body = {"model": "fake", "prompt": [1], "max_tokens": 999, "stream": True}
    results, _ = asyncio.run(client.run_benchmark("http://fake", client.COMPLETIONS, [body], [1], math.inf, 1.0,
                                                  None, 0, disable_tqdm=True, session=FakeSession(VirtualClock())))
    assert not results[0].success and "HTTP 400" in results[0].error and "too many tokens" in results[0].error


def test_chat_payload_and_chunks():
    record = datasets.RequestRecord([5, 6], 8, prompt_text="hi", messages=[{"role": "user", "content": "hi"}])
    body = client.build_payload(record, client.CHAT, "m", "ids", ignore_eos=False)
    assert body["messages"] == record.messages and body["max_completion_tokens"] == 8 and "ignore_eos" not in body
    assert client.build_payload(record, client.COMPLETIONS, "m", "text", False)["prompt"] == "hi"
    assert client.chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, client.CHAT) == ""
    assert client.chunk_text({"choices": [{"delta": {"content": "x"}}]}, client.CHAT) == "x"
    assert client.chunk_text({"choices": [], "usage": {}}, client.COMPLETIONS) is None


# -- every script end to end on a tiny model -----------------------------------------------------------------


# One process imports the heavy third-party libraries the scripts share (numpy, jax, transformers, ...) once, then
# forks a fresh child per script that runs it as `python benchmarks/SCRIPT --help` would: argv, sys.path[0] the
# script's folder, `__main__`, none of the repository's modules imported yet, stdout and stderr to files of its own,
# its exit status the script's. (Whether a script's folder on sys.path shadows a library's module is
# test_benchmark_scripts_shadow_no_module_a_library_imports'.)
HELP_DRIVER = r"""
import json, os, runpy, sys, traceback
for name in ("numpy", "jax", "jax.numpy", "flax", "transformers", "aiohttp", "safetensors"):
    try:
        __import__(name)
    except ImportError:
        pass
repo, out_dir, scripts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
codes = {}
for index, script in enumerate(scripts):
    path = os.path.join(repo, "benchmarks", script)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, suffix in ((1, "out"), (2, "err")):
                os.dup2(os.open(os.path.join(out_dir, f"{index}.{suffix}"), os.O_WRONLY | os.O_CREAT), fd)
            sys.argv = [path, "--help"]
            sys.path[0] = os.path.dirname(path)
            try:
                runpy.run_path(path, run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    codes[script] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def help_outputs(tmp_path_factory):
    """script -> (exit status, stdout, stderr) of its --help."""
    out_dir = tmp_path_factory.mktemp("help")
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, str(REPO), str(out_dir), json.dumps(SCRIPTS)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr
    codes = json.loads(run.stdout.splitlines()[-1])
    return {script: (codes[script], (out_dir / f"{index}.out").read_text(), (out_dir / f"{index}.err").read_text())
            for index, script in enumerate(SCRIPTS)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, help_outputs):
    returncode, stdout, stderr = help_outputs[script]
    assert returncode == 0, stderr
    assert "usage:" in stdout


def test_throughput_smoke(tiny_llama_dir, tmp_path):
    from benchmarks import throughput

    result_file = tmp_path / "throughput.json"
    payload = throughput.main(["--model", tiny_llama_dir, *TINY_ENGINE, "--dataset-name", "prefix_repetition",
                               "--num-prompts", "8", "--prefix-repetition-num-prefixes", "2",
                               "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "4",
                               "--output-len", "4", "--concurrency", "1", "4", "--disable-tqdm",
                               "--result-file", str(result_file)])
    saved = json.loads(result_file.read_text())
    result = saved["result"]
    assert saved["benchmark"] == "throughput-prefix_repetition" and saved["machine"]["cores"] >= 1
    assert result["num_requests"] == 8 and result["output_tokens"] == 32 and result["prompt_tokens"] == 8 * 36
    assert 0 < result["peak_kv_usage"] <= 1 and result["steps"] > 0
    assert result["prefix_hit_rate"] > 0.3  # 2 prefixes of 2 pages shared by 8 requests
    assert [p["concurrency"] for p in saved["closed_loop_sweep"]] == [1, 4]
    for point in saved["closed_loop_sweep"]:
        split = point["time_breakdown"]
        assert 0 < split["token_gap_median_s"] <= split["token_gap_p99_s"] <= split["token_gap_max_s"]
        assert split["longest_prefill_step_s"] > 0
    assert result_file.with_suffix(".png").exists()
    assert payload["startup_s"] > 0


def test_multi_turn_smoke(tiny_llama_dir, tmp_path):
    from benchmarks import multi_turn

    payload = multi_turn.main(["--model", tiny_llama_dir, "--modes", "host", "--num-conversations", "4", "--turns",
                               "2", "--doc-len", "48", "--user-len", "8", "--output-len", "4",
                               "--max-num-batched-tokens", "64", "--result-file", str(tmp_path / "mt.json")])
    off, host = payload["results"]  # "off" runs first: the reference answers
    assert (off["mode"], host["mode"]) == ("off", "host") and host["identical"]
    assert host["prefill_tokens_later"] < off["prefill_tokens_later"] and payload["num_kv_pages"] < 4 * 64 // 16


def test_host_overhead_smoke(tiny_llama_dir, tmp_path, capsys):
    from benchmarks import host_overhead

    payload = host_overhead.main(["--model", tiny_llama_dir, "--batch-sizes", "1", "4", "--num-requests", "4",
                                  "--input-len", "8", "--output-len", "6", "--vocab-size", "500", "--profile", "5",
                                  "--max-num-batched-tokens", "16",
                                  "--result-file", str(tmp_path / "host.json")])
    printed = capsys.readouterr().out
    assert "batch 4: the top 5 functions by own time" in printed and "tottime" in printed
    one, four = payload["runs"]
    assert (one["batch"], four["batch"]) == (1, 4)
    assert one["output_tokens"] == four["output_tokens"] == 4 * 6
    for run in payload["runs"]:
        assert set(run["phases_ms"]) == {"schedule", "prepare", "dispatch", "wait", "postprocess"}
        assert run["steps"] > 0 and run["device_step_ms"] > 0 and all(v >= 0 for v in run["phases_ms"].values())


def test_roofline_smoke(tiny_llama_dir, tmp_path):
    from benchmarks import roofline

    payload = roofline.main(["--model", tiny_llama_dir, *TINY_ENGINE, "--batch-sizes", "1", "4", "--context", "40",
                             "--repeats", "2", "--bandwidth-bytes", str(8 << 20), "--matmul-size", "128",
                             "--disable-tqdm", "--result-file", str(tmp_path / "roofline.json")])
    first, second = payload["points"]
    assert (first["batch"], second["batch"]) == (1, 4) and first["attended_tokens_per_seq"] >= 40
    assert all(p["step_s"] > 0 and p["percent_of_roofline"] > 0 for p in payload["points"])
    assert second["gflop"] == pytest.approx(4 * first["gflop"])
    assert (tmp_path / "roofline.png").exists()


def test_roofline_counts_by_hand():
    from benchmarks import roofline

    class Config:  # 2 layers, hidden 8, 2 q heads / 1 kv head of dim 4, one sliding layer of window 3
        hidden_size, num_layers, num_q_heads, num_kv_heads, head_dim = 8, 2, 2, 1, 4
        layer_sliding_windows = (None, 3)

    params = {"embed": {"embedding": np.zeros((10, 8))}, "final_norm": {"scale": np.zeros(8)},
              "layers_0": {"attn": {"qkv_proj": {"kernel": np.zeros((8, 16))}}, "input_norm": {"scale": np.zeros(8)}}}
    counts = roofline.param_counts(params)
    assert counts.tied_embeddings and counts.embedding == 80 and counts.other == 16
    assert counts.matmul == 128 + 80  # the tied embedding is the LM head
    cost = roofline.decode_cost(Config, counts, batch=2, context=5, dtype_bytes=4)
    attended = 5 + 3
    assert cost.flops == 2 * 208 * 2 + 4 * 2 * 4 * attended * 2
    assert cost.weight_bytes == (208 + 16) * 4
    assert cost.kv_bytes == 2 * attended * 2 * 1 * 4 * 4 + 2 * 2 * 2 * 1 * 4 * 4
    assert roofline.floor_seconds(cost, bandwidth=1e9, flops_rate=1e12)[1] == "memory"
    Config.vocab_size = 10  # LM head 10 x 8 = 80 of the 208 matmul params; the layers hold 128
    # 3 requests, 12 prompt tokens, 9 output tokens: 12 + (9 - 3) tokens run the layers, 9 run the LM head
    floor = roofline.offline_floor_seconds(Config, counts, prompt_tokens=12, output_tokens=9, requests=3,
                                           flops_rate=100.0)
    assert floor == pytest.approx(2 * (128 * 18 + 80 * 9) / 100.0)


def test_roofline_counts_experts_as_tokens_use_them():
    """A mixture of experts' step: FLOPs for top_k of E experts per token; bytes for the experts the batch
    reaches (uniform routing)."""
    from benchmarks import roofline
    from jaxserve.config import MoEConfig

    class Config:
        hidden_size, num_layers, num_q_heads, num_kv_heads, head_dim = 8, 1, 2, 1, 4
        layer_sliding_windows = (None,)
        moe = MoEConfig(num_experts=4, top_k=1, intermediate_size=2, normalize_top_k=True)

    params = {"embed": {"embedding": np.zeros((10, 8))},
              "layers_0": {"mlp": {"experts": {"down_proj": {"kernel": np.zeros((4, 2, 8))}},
                                   "router": {"kernel": np.zeros((8, 4))}}}}
    counts = roofline.param_counts(params)
    assert counts.experts == 64 and counts.matmul == 64 + 32 + 80
    cost = roofline.decode_cost(Config, counts, batch=2, context=1, dtype_bytes=1)
    assert cost.flops == 2 * (112 + 64 / 4) * 2 + 4 * 2 * 4 * 1 * 2
    assert cost.weight_bytes == 112 + 64 * (1 - 0.75 ** 2)


def test_greedy_agreement_by_hand():
    from benchmarks import compare

    assert compare.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == {"identical_fraction": 1.0,
                                                                         "mean_common_prefix_fraction": 1.0}
    # one sequence identical, one diverging after 1 of 4 tokens, one a token short (2 of 3)
    assert compare.agreement([[1, 2], [7, 8, 9, 9], [5, 6]], [[1, 2], [7, 0, 9, 9], [5, 6, 1]]) == \
        pytest.approx({"identical_fraction": 1 / 3, "mean_common_prefix_fraction": (1 + 1 / 4 + 2 / 3) / 3})
    with pytest.raises(ValueError):  # a side that answered fewer requests is not partly in agreement
        compare.agreement([[1, 2]], [[1, 2], [3]])


def test_benchmark_scripts_shadow_no_module_a_library_imports():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like a module a library looks
    for is imported in its place (transformers' model configs import `kernels` whenever one is importable)."""
    out = subprocess.run([sys.executable, "-c", "import transformers.activations, transformers.models.llama, flax, "
                          "jax, orbax.checkpoint, grain, safetensors, gguf"],
                         capture_output=True, text=True, timeout=300, cwd=REPO / "benchmarks")
    assert out.returncode == 0, out.stderr

def test_kernels_smoke(tmp_path):
    # a script that puts benchmarks/ on sys.path itself: run it as the command line does
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_bench.py"), "--impls", "xla-ref", "pallas-ours",
                          "--interpret", "--batches", "2", "--contexts", "40", "--warmup", "1", "--repeats", "1",
                          "--copy-bytes", str(1 << 20), "--out", str(tmp_path / "kernels.json")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [row["impl"] for row in rows] == ["xla-ref", "pallas-ours"]
    for row in rows:
        assert "error" not in row and "skipped" not in row, row
        # K and V of 2 sequences x 40 tokens x 3 kv heads x 64 dims in float32 (the smollm2-135m preset)
        assert row["kv_bytes"] == 2 * 2 * 40 * 3 * 64 * 4 and row["median_s"] > 0
        assert row["baseline"] == "xla-ref" and row["max_abs_diff_vs_baseline"] < 1e-5  # our kernel agrees


def test_hf_baseline_and_compare_smoke(tiny_llama_dir, tmp_path):
    from benchmarks import compare

    payload = compare.main(["--model", tiny_llama_dir, *TINY_ENGINE, "--num-prompts", "6", "--input-len", "12",
                            "--random-range-ratio", "0.5", "--output-len", "6", "--single-stream-tokens", "4",
                            "--disable-tqdm", "--result-file", str(tmp_path / "compare.json")])
    expected = payload["workload"]["expected_output_tokens"]
    assert payload["jaxserve"]["result"]["output_tokens"] == payload["hf_transformers"]["result"]["output_tokens"] \
        == expected
    assert payload["ratios"]["output_throughput"] > 0 and payload["jaxserve"]["roofline"]["percent_of_roofline"] > 0
    # same weights, both float32 on CPU, greedy, the tiny model: every token identical, as in test_engine's
    # test_greedy_matches_transformers, here with left padding in HF's static batches
    assert payload["greedy_agreement"] == {"identical_fraction": 1.0, "mean_common_prefix_fraction": 1.0}
    assert payload["jaxserve"]["roofline"]["offline_floor_s"] > 0 and payload["ratios"]["offline_floor_vs_hf"] > 0


def test_plots_redraw(tmp_path):
    from benchmarks import plots

    data = {"model": "m", "closed_loop_sweep": [{"concurrency": c, "output_throughput": 10.0 * c} for c in (1, 4)]}
    path = common.write_result("throughput-random", data, tmp_path / "throughput.json",
                               machine={"cpu": "test", "cores": 2})
    drawn = plots.redraw(path)
    assert [p.name for p in drawn] == ["throughput.png"] and drawn[0].stat().st_size > 1000


def test_suite_dry_run(capsys):
    from benchmarks import run_default_suite

    steps = run_default_suite.main(["--dry-run"])["steps"]
    assert {"compare", "roofline", "serving"} <= set(steps)
    printed = capsys.readouterr().out
    assert "benchmarks/compare.py" in printed and "--result-file" in printed and "jaxserve serve" in printed
    assert "-m jaxserve bench serve" in printed and "--result-filename serving.json" in printed


def test_every_random_model_shape_is_served_with_its_published_size(tmp_path):
    """Each shape's config.json parses (the families, ropes and windows jaxserve reads from it), with the published
    parameter counts: total, and active per token for the mixtures of experts."""
    import jax

    from benchmarks import random_model
    from jaxserve.loading.hf_files import hf_model_config
    from jaxserve.models import checkpoint_shapes

    published = {"llama-3.1-8b": (8.03, 8.03), "qwen3-30b-a3b": (30.5, 3.35), "mixtral-8x7b": (46.7, 12.9),
                 "gpt-oss-20b": (20.9, 3.6 + 0.58), "gemma-3-27b": (27.0, 27.0)}  # billions; gpt-oss: + embedding
    for shape in random_model.SHAPES:
        config = hf_model_config(random_model.write_config(tmp_path / shape, shape))
        leaves = jax.tree_util.tree_leaves_with_path(checkpoint_shapes(config))
        total = sum(math.prod(leaf.shape) for _, leaf in leaves)
        experts = sum(math.prod(leaf.shape) for path, leaf in leaves if "experts" in jax.tree_util.keystr(path))
        active = total - experts + (experts * config.moe.top_k // config.moe.num_experts if config.moe else 0)
        if shape in published:
            assert (total / 1e9, active / 1e9) == pytest.approx(published[shape], rel=0.01), shape
    gpt_oss = hf_model_config(str(tmp_path / "gpt-oss-20b"))
    assert gpt_oss.attention_sinks and gpt_oss.layer_sliding_windows[:2] == (128, None)
    assert dict(gpt_oss.layers[1].rope_scaling)["rope_type"] == "yarn"
    gemma = hf_model_config(str(tmp_path / "gemma-3-27b"))
    assert gemma.layer_sliding_windows[:6] == (1024,) * 5 + (None,) and gemma.activation == "gelu_tanh"
    assert (gemma.layers[0].rope_theta, gemma.layers[5].rope_theta) == (10000.0, 1000000.0)


def test_random_model_has_the_default_models_shapes(tmp_path):
    import gguf

    from benchmarks import random_model
    from jaxserve.loading import default_gguf_path, load_model
    from jaxserve.loading.gguf_convert import gguf_hf_config

    import dataclasses

    import transformers

    from jaxserve.models import config_from_hf

    described = config_from_hf(gguf_hf_config(gguf.GGUFReader(default_gguf_path())))
    stand_in = config_from_hf(transformers.LlamaConfig(**random_model.DEFAULT_MODEL_SHAPES))
    assert stand_in.rms_norm_eps == pytest.approx(described.rms_norm_eps)  # the GGUF stores it as float32
    same = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=0.0)  # the stand-in has no tokenizer
    assert dataclasses.replace(stand_in, **same) == dataclasses.replace(described, **same)
    # a small build loads in jaxserve with the shapes asked for
    path = random_model.build(str(tmp_path / "random"), num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    config = load_model(path).config
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.num_q_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (2, 64, 96, 4, 2, 16, 128)
    assert config.tie_word_embeddings


def test_loading_memory_builds_a_checkpoint_transformers_reads_and_measures_it(tmp_path):
    """The torch-free random checkpoint has HF's names, shapes and sharded layout (transformers loads it with no
    missing or unexpected tensor), and a measured load reports the params' bytes."""
    import torch
    import transformers

    from benchmarks import loading_memory

    shapes = {**loading_memory.RANDOM_1B_SHAPES, "vocab_size": 96, "hidden_size": 48, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
              "tie_word_embeddings": False}
    path = loading_memory.build_random_checkpoint(tmp_path / "random", shapes, shard_mib=0)
    assert len(list(path.glob("*.safetensors"))) > 2  # one tensor per file at shard_mib=0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    assert sum(p.numel() for p in model.parameters()) == sum(
        math.prod(shape) for shape in loading_memory.hf_tensor_shapes(shapes).values())
    result = loading_memory.measure(str(path), 1)
    assert result["model_bytes"] == result["placed_bytes"] == 2 * result["parameters"]
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["peak_rss"] >= result["rss_after"] > 0 and result["peak_rss"] >= result["baseline_rss"]


def test_gpu_8b_dry_run(tmp_path):
    """The GPU stage's script (`gpu_8b.py`) end to end on CPU at reduced scale: 1 layer of Llama-3.1-8B's shapes
    (vocabulary cut to 4096, float32: CPU bfloat16 matmuls are ~10x slower), random weights drawn on the device
    (`load_format="dummy"`, config.json alone), every part measured, and the int8 + fp8 variant engine; then a
    dummy load split over 3 devices: the sharding table's placement, the init's scale, and the bad-input errors."""
    import jax
    import jax.numpy as jnp

    from benchmarks import gpu_8b, random_model
    from jaxserve.distributed.tensor_parallel import make_mesh
    from jaxserve.engine.config import EngineConfig
    from jaxserve.loading import load_model
    from jaxserve.loading.placement import checkpoint_shardings

    result_file = tmp_path / "gpu-8b.json"
    payload = gpu_8b.main(["--num-layers", "1", "--vocab-size", "4096", "--dtype", "float32", "--batch-sizes", "1",
                           "2", "--context", "32", "--repeats", "1", "--concurrency", "2", "--waves", "1",
                           "--input-len", "16", "--output-len", "3", "--ttft-len", "32", "--ttft-repeats", "1",
                           "--max-num-batched-tokens", "16", "--variant-batch-sizes", "1",
                           "--variants", "int8-kv-fp8:quantization=int8,kv_cache_dtype=fp8",
                           "--result-file", str(result_file)])
    saved = json.loads(result_file.read_text())
    assert saved["errors"] == {} and saved["skipped"] == [] and saved["benchmark"] == "gpu_8b"
    parts = saved["parts"]
    model = saved["model_config"]
    published = random_model.SHAPES["llama-3.1-8b"]
    assert (model["num_layers"], model["vocab_size"]) == (1, 4096)
    assert (model["hidden_size"], model["intermediate_size"], model["num_q_heads"], model["num_kv_heads"],
            model["head_dim"], model["tie_word_embeddings"]) == (4096, 14336, 32, 8, 128, False)
    assert dict(model["rope_scaling"])["rope_type"] == "llama3" == published["rope_scaling"]["rope_type"]
    assert saved["engine"]["load_format"] == "dummy" and saved["engine"]["dtype"] == "float32"
    assert parts["sanity"]["finite_logprobs"] and len(parts["sanity"]["tokens"]) == 8
    assert parts["warmup"]["compile_s"] > 0
    # the decode step counts the 8B layers' weights: q/k/v/o, gate/up/down per layer, plus the LM head
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    one, two = parts["decode"]["points"]
    assert (one["batch"], two["batch"]) == (1, 2) and one["params"]["matmul"] == layer + 4096 * 4096
    assert all(p["step_s"] > 0 and p["percent_of_roofline"] > 0 for p in (one, two))
    (run,) = parts["throughput"]
    assert (run["concurrency"], run["num_requests"], run["output_tokens"], run["prompt_tokens"]) == (2, 2, 6, 32)
    assert parts["single_stream"]["output_tokens"] == 3 and parts["single_stream"]["decode_tok_s"] > 0
    assert parts["ttft"]["prompt_len"] == 32 and parts["ttft"]["ttft_s"] > 0
    variant = parts["variant int8-kv-fp8:quantization=int8,kv_cache_dtype=fp8"]
    assert (variant["quantization"], variant["kv_cache_dtype"]) == ("int8", "fp8")
    assert variant["sanity"]["finite_logprobs"]
    (point,) = variant["points"]
    assert point["batch"] == 1 and point["step_s"] > 0
    assert point["speedup"] == pytest.approx(one["step_s"] / point["step_s"])
    table = result_file.with_suffix(".txt").read_text()
    assert "decode step, batch 2" in table and "published (not measured here)" in table and "FAILED" not in table
    assert payload["parts"].keys() == parts.keys()
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="safetensors")
    config_only = random_model.write_config(tmp_path / "config-only", "smollm2-135m", num_hidden_layers=1)
    with pytest.raises(ValueError, match="safetensors"):  # without load_format="dummy" it needs weight files
        load_model(config_only)
    # split 3 ways, every parameter is drawn with the sharding table's placement, at the init's scale
    mesh = make_mesh(3)
    loaded = load_model(config_only, jnp.bfloat16, mesh=mesh, load_format="dummy")
    expected = checkpoint_shardings(loaded.config, jnp.bfloat16, mesh)
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(loaded.params), jax.tree.leaves(expected)):
        assert leaf.dtype == jnp.bfloat16 and leaf.sharding == sharding, path
        values = np.asarray(leaf, np.float32)
        if path[-1].key == "scale":
            assert (values == 1).all()
        else:  # [in, out] kernels: variance 1 / in; the [vocab, hidden] embedding: 1 / hidden
            fan_in = values.shape[1] if path[-1].key == "embedding" else values.shape[0]
            assert abs(values.std() * fan_in ** 0.5 - 1) < 0.02 and abs(values.mean()) * fan_in ** 0.5 < 0.02, path


def test_spec_decode_smoke(tiny_llama_dir, tmp_path):
    """Both prompt sets, every method (the tiny model as its own draft, a random EAGLE-3 head at K = 2), outputs
    equal to plain decoding."""
    import transformers

    from benchmarks import spec_decode
    from tests.eagle3_heads import save_eagle3_head

    head = save_eagle3_head(str(tmp_path / "head"), transformers.AutoConfig.from_pretrained(tiny_llama_dir),
                            aux_layers=(0, 1, 1))
    payload = spec_decode.main(["--model", tiny_llama_dir, "--max-model-len", "512", "--max-num-batched-tokens", "64",
                                "--num-prompts", "2", "--max-tokens", "8", "--methods", "plain", "ngram", "draft",
                                "eagle3:2", "--eagle3", head, "--result-file", str(tmp_path / "spec.json")])
    assert {row[0] for row in payload["summary"]} == {"plain", "ngram", "draft", "eagle3:2"}
    assert all(row[-1] is True for row in payload["summary"])
    assert payload["methods"]["draft"]["sets"]["copy"]["acceptance_rate"] > 0.9


def test_lora_smoke(tiny_llama_dir, tmp_path):
    """The base engine, a LoRA engine's base rows and two random adapters mixed: every run makes every token."""
    from benchmarks import lora

    payload = lora.main(["--model", tiny_llama_dir, "--max-model-len", "128", "--max-num-batched-tokens", "64",
                         "--max-num-seqs", "4", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                         "--num-adapters", "2", "--lora-rank", "4", "--result-file", str(tmp_path / "lora.json")])
    assert list(payload["results"]) == ["base engine", "LoRA engine, base rows", "LoRA engine, 2 adapters mixed"]
    assert all(run["output_tokens"] == 16 for run in payload["results"].values())

def test_prompt_scoring_smoke(tiny_llama_dir, capsys):
    from benchmarks import prompt_scoring

    prompt_scoring.main(["--model", tiny_llama_dir, "--max-model-len", "64", "--max-num-batched-tokens", "32",
                         "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 x 16 |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 7


def test_lm_eval_tasks_data_is_what_make_data_writes(tmp_path):
    """The shipped JSONL are make_data.py's output, and every task YAML reads a file that exists."""
    from benchmarks.lm_eval_tasks import make_data

    make_data.main(["--out", str(tmp_path)])
    for path in tmp_path.iterdir():
        assert path.read_text() == (REPO / "benchmarks" / "data" / path.name).read_text()
    for task in (REPO / "benchmarks" / "lm_eval_tasks").glob("jaxserve_*.yaml"):
        for line in task.read_text().splitlines():
            if line.strip().startswith("test: "):
                assert (REPO / line.split(": ", 1)[1]).is_file(), task


def test_compare_samples_by_hand(tmp_path, capsys):
    from benchmarks.lm_eval_tasks import compare_samples

    for run, (logprob, answer) in {"a": (-1.0, "7"), "b": (-1.25, "8")}.items():
        (tmp_path / run).mkdir()
        (tmp_path / run / "samples_mc_2026.jsonl").write_text(json.dumps(
            {"doc_id": 0, "filtered_resps": [[str(logprob), "True"], ["-3.0", "False"]], "acc": 1.0}) + "\n")
        (tmp_path / run / "samples_gen_2026.jsonl").write_text(json.dumps(
            {"doc_id": 0, "filtered_resps": [answer], "exact_match": float(answer == "7")}) + "\n")
    compare_samples.main([str(tmp_path / "a"), str(tmp_path / "b")])
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["gen: 1 docs, exact_match 1.0000 vs 0.0000, generated answers differ: 1",
                       "mc: 1 docs, acc 1.0000 vs 1.0000, 2 loglikelihoods: max |diff| 2.50e-01, is_greedy differs 0"]


def test_a_stream_that_ends_cleanly_before_done_is_a_failure():
    async def lines():
        yield b'data: {"choices": [{"index": 0, "text": "half"}]}\n'
        yield b"\n"  # then the server closes the stream cleanly, without [DONE]

    result = RequestResult(success=False, prompt_len=1)
    asyncio.run(client.read_events(lines(), client.COMPLETIONS, result, 0.0, VirtualClock()))
    assert not result.success and result.error == "the stream ended before [DONE]"
    assert result.generated_text == "half"

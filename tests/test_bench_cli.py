"""`jaxserve bench serve | throughput | latency` (jaxserve/bench/): vLLM's flags and result keys, on the tiny model,
against a real jaxserve server and against a fake OpenAI server that fails in every way a server can (errors,
dropped streams, no answer); the workloads' vLLM datasets; bad flags as argparse errors; and the Grafana dashboard
against a live server's /metrics, which must follow Prometheus' text-format rules.

No test asserts a duration: what is checked is counts, keys and the arithmetic between them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxserve.bench import client, datasets, serve
from jaxserve.bench.offline import latency_main, throughput_main
from jaxserve.bench.report import load_tokenizer
from tests.default_server import free_port


class ThreadServer:
    """A uvicorn server in a thread, on `port`."""

    def __init__(self, app: FastAPI, port: int, lifespan: str = "off"):
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                                    lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the fake worker did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

REPO = Path(__file__).resolve().parents[1]
TINY_ENGINE = ["--max-num-seqs", "4", "--max-model-len", "128", "--max-num-batched-tokens", "64"]
DASHBOARD = REPO / "deploy" / "grafana" / "jaxserve-dashboard.json"
PERCENTILE_KEYS = [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
                   for stat in ("mean", "median", "std", "p99")]
VLLM_KEYS = ["date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "max_output_tokens_per_s", "max_concurrent_requests", *PERCENTILE_KEYS]


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir, tmp_path_factory):
    """`jaxserve serve` on the tiny model with a host KV tier (so the tier metrics exist), for the module's tests."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--model", tiny_llama_dir, "--port",
                                    str(port), *TINY_ENGINE, "--log-stats-interval", "0", "--kv-offloading-size", "0.01"],
                                   cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        client.wait_for_server(url, 300, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_serve_against_jaxserve_writes_vllms_result_keys(live_server, tiny_llama_dir, tmp_path):
    outcomes = serve.main(["--base-url", live_server, "--tokenizer", tiny_llama_dir, "--dataset-name", "prompts",
                           "--num-prompts", "6", "--output-len", "5", "--ignore-eos", "--max-concurrency", "1", "3",
                           "--goodput", "ttft:60000", "--metric-percentiles", "50,99", "--disable-tqdm",
                           "--save-result", "--save-detailed", "--plot", "--result-dir", str(tmp_path),
                           "--result-filename", "run.json", "--metadata", "gpu=none"])
    files = sorted(tmp_path.glob("run-*.json"))
    assert [f.name for f in files] == ["run-infqps-concurrency1.json", "run-infqps-concurrency3.json"]
    for outcome, path in zip(outcomes, files):
        saved = json.loads(path.read_text())
        assert saved == json.loads(json.dumps(outcome, default=str))
        assert set(VLLM_KEYS) <= set(saved) and "p50_itl_ms" in saved and saved["gpu"] == "none"
        assert saved["completed"] == 6 and saved["failed"] == 0, saved["errors"]
        assert saved["total_output_tokens"] == 30 and saved["output_lens"] == [5] * 6
        assert saved["total_input_tokens"] == sum(saved["input_lens"])
        assert saved["output_throughput"] == pytest.approx(30 / saved["duration"])
        assert saved["request_throughput"] == pytest.approx(6 / saved["duration"])
        assert saved["total_token_throughput"] == pytest.approx((30 + saved["total_input_tokens"]) / saved["duration"])
        meeting = sum(ttft * 1000 <= 60000 for ttft in saved["ttfts"])
        assert saved["request_goodput"] == pytest.approx(meeting / saved["duration"])
        assert saved["median_ttft_ms"] > 0 and saved["mean_e2el_ms"] >= saved["mean_ttft_ms"]
        assert 1 <= saved["max_concurrent_requests"] <= 6 and saved["max_output_tokens_per_s"] >= 1
        assert path.with_suffix(".png").stat().st_size > 1000
    assert [o["max_concurrency"] for o in outcomes] == [1, 3]


def test_serve_chat_and_latency_targets_reach_the_server(live_server, tiny_llama_dir, tmp_path):
    # random token ids come back longer once decoded and re-encoded for a chat, so the chat run stays short
    chat = serve.main(["--base-url", live_server, "--tokenizer", tiny_llama_dir, "--backend", "openai-chat",
                       "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--ignore-eos",
                       "--request-rate", "50", "--disable-tqdm"])[0]
    assert chat["endpoint"] == client.CHAT and chat["completed"] == 3 and chat["total_output_tokens"] == 12
    before = slo_checked(live_server)
    mixed = serve.main(["--base-url", live_server, "--tokenizer", tiny_llama_dir, "--dataset-name", "mixed",
                        "--num-prompts", "4", "--mixed-short-input-range", "8", "10", "--mixed-long-input-range", "60",
                        "70", "--mixed-long-fraction", "0.5", "--output-len", "4", "--request-slo", "*:60000:60000",
                        "--ignore-eos", "--request-rate", "50", "--disable-tqdm"])[0]
    assert mixed["completed"] == 4 and mixed["dataset"]["max_prompt_len"] >= 60
    assert not list(tmp_path.iterdir())  # no --save-result, no file
    assert slo_checked(live_server) == before + 1 + 4  # the probe and the 4: their targets reached the server


def slo_checked(url: str) -> float:
    """The server's count of finished requests that had both a TTFT and a TPOT target."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('jaxserve:request_slo_checked_total{kind="both"'))


# -- a fake OpenAI server that fails in every way ----------------------------------------------------------------


def failing_server(modes: tuple[str, ...] = ("ok", "http", "event", "drop", "hang"),
                   seen_models: list[str] | None = None) -> FastAPI:
    """Answers its first request (the client's probe) and then, in turn: a whole stream, HTTP 500, an error event,
    a stream cut before [DONE], and no answer at all (or the given `modes`); appends each request's `model` to
    `seen_models`."""
    app = FastAPI()
    modes = itertools.cycle(modes)

    def event(data) -> bytes:
        return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()

    def chunk(text: str) -> bytes:
        return event({"choices": [{"index": 0, "text": text}]})

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if seen_models is not None:
            seen_models.append(body["model"])
        mode = next(modes)
        if mode == "http":
            return JSONResponse({"error": {"message": "the engine is on fire"}}, status_code=500)

        async def stream():
            if mode == "hang":
                await asyncio.sleep(3600)
            yield chunk("a")
            if mode == "event":
                yield event({"error": {"message": "decode failed"}})
                return
            if mode == "drop":
                raise RuntimeError("connection lost")  # uvicorn closes the connection mid-stream
            yield chunk("b")
            yield event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
            yield event("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def test_serve_spreads_requests_over_lora_modules(tiny_llama_dir, tmp_path):
    """--lora-modules: each request names one of the adapters (drawn with --seed), as vLLM's benchmark does."""
    models: list[str] = []
    fake = ThreadServer(failing_server(("ok",), models), free_port())
    try:
        outcome = serve.main(["--port", str(fake.port), "--tokenizer", tiny_llama_dir, "--random-input-len", "4",
                              "--random-output-len", "2", "--num-prompts", "40", "--lora-modules", "sql", "chat",
                              "--disable-tqdm", "--seed", "3"])[0]
    finally:
        fake.stop()
    assert outcome["completed"] == 40 and outcome["lora_modules"] == ["sql", "chat"]
    assert len(models) == 41 and set(models) == {"sql", "chat"}  # the probe and the 40 requests
    again: list[str] = []
    fake = ThreadServer(failing_server(("ok",), again), free_port())
    try:
        serve.main(["--port", str(fake.port), "--tokenizer", tiny_llama_dir, "--random-input-len", "4",
                    "--random-output-len", "2", "--num-prompts", "40", "--lora-modules", "sql", "chat",
                    "--disable-tqdm", "--seed", "3"])
    finally:
        fake.stop()
    assert sorted(again) == sorted(models)  # the same seed, the same draw (arrival order may differ)

def test_serve_counts_every_failure_names_it_and_never_hangs(tiny_llama_dir, tmp_path):
    fake = ThreadServer(failing_server(), free_port())
    try:
        outcome = serve.main(["--port", str(fake.port), "--tokenizer", tiny_llama_dir, "--random-input-len", "4",
                              "--random-output-len", "2", "--num-prompts", "10", "--max-concurrency", "1",
                              "--request-timeout", "2", "--disable-tqdm", "--save-result", "--save-detailed",
                              "--result-dir", str(tmp_path), "--result-filename", "failing.json"])[0]
    finally:
        fake.server.force_exit = True
        fake.stop()
    # the probe took "ok"; the run's 10 requests, one at a time, took http, event, drop, hang, ok, twice
    assert outcome["model_id"] == "fake" and outcome["completed"] == 2 and outcome["failed"] == 8
    assert outcome["total_output_tokens"] == 4 and outcome["total_input_tokens"] == 6
    errors = json.loads((tmp_path / "failing.json").read_text())["errors"]
    for first in (0, 5):
        http, event, drop, hang, ok = errors[first:first + 5]
        assert http.startswith("HTTP 500") and "on fire" in http
        assert "decode failed" in event
        assert "ClientPayloadError" in drop or "before [DONE]" in drop
        assert hang.startswith("TimeoutError") and ok == ""


# -- flags -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--request-rate", "0"], "must be > 0"),
    (["--num-prompts", "0"], "must be >= 1"),
    (["--percentile-metrics", "ttft,latency"], "unknown latency"),
    (["--metric-percentiles", "100"], "--metric-percentiles"),
    (["--metric-percentiles", "p99"], "--metric-percentiles"),
    (["--goodput", "ttft"], "goodput spec"),
    (["--metadata", "novalue"], "KEY=VALUE"),
    (["--plot"], "go with --save-result"),
    (["--dataset-name", "lmsys"], "invalid choice"),
    (["--mixed-output-range", "9", "3"], "LOW <= HIGH"),
])
def test_bad_serve_flags_are_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        serve.parse_args(flags)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_command_line_has_bench(capsys):
    listed = subprocess.run([sys.executable, "-m", "jaxserve", "bench"], capture_output=True, text=True, cwd=REPO)
    assert listed.returncode == 2 and "serve,throughput,latency" in listed.stdout
    # the rest through the same entry (`python -m jaxserve` calls jaxserve.cli.main with argv), in this process

    def run(*argv):
        from jaxserve.cli import main

        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            main(list(argv))
        out = capsys.readouterr()
        return stopped.value.code, out.out, out.err

    for command in ("serve", "throughput", "latency"):
        code, out, err = run("bench", command, "--help")
        assert code in (0, None) and f"jaxserve bench {command}" in out, err
    code, out, err = run("bench", "latency", "--batch-size", "0")
    assert code == 2 and "--batch-size" in err


# -- offline ------------------------------------------------------------------------------------------------------


def test_throughput_and_latency_write_vllms_keys(tiny_llama_dir, tmp_path):
    result = throughput_main(["--model", tiny_llama_dir, *TINY_ENGINE, "--input-len", "12", "--output-len", "5",
                              "--num-prompts", "6", "--disable-tqdm", "--output-json", str(tmp_path / "t.json")])
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["num_requests"] == 6 and saved["total_num_tokens"] == 6 * (12 + 5)
    assert saved["tokens_per_second"] == pytest.approx(saved["total_num_tokens"] / saved["elapsed_time"])
    assert saved["requests_per_second"] == pytest.approx(6 / saved["elapsed_time"]) and result == saved
    latency = latency_main(["--model", tiny_llama_dir, *TINY_ENGINE, "--input-len", "8", "--output-len", "4",
                            "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
                            "--output-json", str(tmp_path / "l.json")])
    saved = json.loads((tmp_path / "l.json").read_text())
    assert len(saved["latencies"]) == 3 and saved["avg_latency"] == pytest.approx(sum(saved["latencies"]) / 3)
    assert list(saved["percentiles"]) == ["10", "25", "50", "75", "90", "99"] and latency == saved
    assert min(saved["latencies"]) <= saved["percentiles"]["50"] <= max(saved["latencies"])


# -- datasets ------------------------------------------------------------------------------------------------------


def test_random_lengths_stay_in_the_range_ratio_and_share_the_prefix():
    records = datasets.random_dataset(200, 100, 40, vocab_size=500, range_ratio=0.25, seed=2, prefix_len=7)
    assert all(7 + 75 <= r.prompt_len <= 7 + 125 and 30 <= r.expected_output_len <= 50 for r in records)
    assert len({tuple(r.prompt_token_ids[:7]) for r in records}) == 1
    assert len({r.prompt_len for r in records}) > 20  # the lengths spread over the range


def test_sharegpt_parsing_and_vllms_filter(tiny_llama_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_llama_dir)
    long_answer = "word " * 40
    data = [{"conversations": [{"from": "human", "value": "Tell me about the sea and its tides."},
                               {"from": "gpt", "value": long_answer}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_answer}]},  # < 4
            {"conversations": [{"from": "human", "value": "Only one turn here, so it is skipped."}]},
            {"id": "no conversations"},
            {"conversation": [{"from": "human", "value": "What is a prime number, in short?"},
                              {"from": "gpt", "value": "A number with exactly two divisors, one and itself."}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    records = datasets.sharegpt_dataset(5, path, tokenizer, seed=0)
    assert sorted(r.prompt_text for r in records) == ["Tell me about the sea and its tides.",
                                                      "What is a prime number, in short?"]
    for record in records:
        assert record.prompt_token_ids == tokenizer(record.prompt_text)["input_ids"]
        answer = long_answer if "sea" in record.prompt_text else data[4]["conversation"][1]["value"]
        assert record.expected_output_len == len(tokenizer(answer)["input_ids"])
    fixed = datasets.sharegpt_dataset(2, path, tokenizer, output_len=3)
    assert {r.expected_output_len for r in fixed} == {3}
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list"):
        datasets.sharegpt_dataset(1, path, tokenizer)


def test_custom_prompt_file(tiny_llama_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_llama_dir)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Why is the sky blue?"}\n\n{"prompt": "Name a prime.", "system": "Be brief."}\n')
    records = datasets.prompt_file_dataset(4, 9, tokenizer, path=path)
    assert len(records) == 4 and {r.expected_output_len for r in records} == {9}
    assert any(r.messages[0] == {"role": "system", "content": "Be brief."} for r in records)
    raw = datasets.prompt_file_dataset(2, 9, tokenizer, path=path, skip_chat_template=True)
    assert {r.prompt_text for r in raw} <= {"Why is the sky blue?", "Name a prime."}
    path.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: every line needs a non-empty 'prompt'"):
        datasets.prompt_file_dataset(1, 9, tokenizer, path=path)


# -- the dashboard and /metrics ----------------------------------------------------------------------------------


def dashboard_metric_names() -> set[str]:
    """Every metric name the dashboard's PromQL expressions read (histogram series by their family's name)."""
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(expressions) >= 12
    return {name for expr in expressions for name in re.findall(r"\b(jaxserve:[a-zA-Z0-9_:]+)", expr)}


def scrape_after_a_request(url: str) -> str:
    """/metrics once the server has served a request (labelled histograms have series only after one)."""
    body = {"model": client.served_model(url), "prompt": [5, 6, 7], "max_tokens": 2}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return httpx.get(url + "/metrics").text


def test_every_dashboard_metric_exists_on_a_live_server(live_server):
    from prometheus_client.parser import text_string_to_metric_families

    text = scrape_after_a_request(live_server)
    samples = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    missing = sorted(dashboard_metric_names() - samples)
    assert not missing, f"the dashboard reads metrics the server does not export: {missing}"


def test_metrics_follow_the_prometheus_text_format(live_server):
    from prometheus_client.parser import text_string_to_metric_families

    text = scrape_after_a_request(live_server)
    families = list(text_string_to_metric_families(text))
    assert len(families) > 15
    typed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    helped = set(re.findall(r"^# HELP (\S+) ", text, flags=re.M))
    for family in families:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", family.name), family.name
        written = family.name + "_total" if family.type == "counter" else family.name  # the parser drops _total
        assert typed.get(written) == family.type and written in helped, family.name
        for sample in family.samples:
            assert all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label) for label in sample.labels), sample
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            if family.type == "histogram":
                assert sample.name.endswith(("_bucket", "_sum", "_count", "_created")), sample.name
    counters = [name for name, kind in typed.items() if kind == "counter"]
    assert counters and all(name.endswith("_total") for name in counters)


# -- connections the server closes ---------------------------------------------------------------------------------


class ClosingServer:
    """A raw HTTP/1.1 server (its own thread and event loop) answering /v1/models and streamed completions with
    keep-alive. `mode` "reused": it answers the first request of each connection and closes the connection as soon
    as a second request's headers arrive (what an idle timeout firing just as a pooled connection is reused does,
    made certain); "after_reading": it answers the first completion (the client's probe), then reads every other
    one whole and closes without an answer."""

    def __init__(self, mode: str):
        import threading

        self.mode, self.port, self.requests = mode, free_port(), 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self.connection, "127.0.0.1", self.port))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.mode == "reused" and served:
                    break  # the request's body is unread: the close resets the connection
                length = int(re.search(rb"content-length: *(\d+)", head.lower()).group(1)) if b"content-length" \
                    in head.lower() else 0
                await reader.readexactly(length)
                self.requests += 1
                if self.mode == "after_reading" and head.startswith(b"POST") and self.requests > 2:
                    break
                if head.startswith(b"GET"):
                    body, kind = json.dumps({"data": [{"id": "fake"}]}).encode(), b"application/json"
                else:
                    events = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
                              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
                    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
                    kind = b"text/event-stream"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def run_against(server: ClosingServer, tokenizer: str, tmp_path, capsys) -> tuple[dict, str]:
    try:
        outcome = serve.main(["--port", str(server.port), "--tokenizer", tokenizer, "--random-input-len", "4",
                              "--random-output-len", "2", "--num-prompts", "12", "--max-concurrency", "2",
                              "--request-timeout", "20", "--disable-tqdm", "--save-result", "--result-dir",
                              str(tmp_path), "--result-filename", "run.json"])[0]
    finally:
        server.stop()
    return outcome, capsys.readouterr().out


def test_a_connection_closed_under_a_reused_request_is_sent_again_and_counted(tiny_llama_dir, tmp_path, capsys):
    """Every request that reuses a pooled connection finds it closed before any answer (llama.cpp's server closing
    idle connections while the machine was busy lost 8 of 32 requests so): each is sent once more on a fresh
    connection, and the run completes every request, with the retries in the result and the printed block."""
    outcome, printed = run_against(ClosingServer("reused"), tiny_llama_dir, tmp_path, capsys)
    assert outcome["completed"] == 12 and outcome["failed"] == 0
    assert outcome["retries"] > 0 and json.loads((tmp_path / "run.json").read_text())["retries"] == outcome["retries"]
    assert re.search(rf"Retried on a fresh connection: +{outcome['retries']}\n", printed)


def test_a_server_that_drops_requests_it_read_still_fails_them(tiny_llama_dir, tmp_path, capsys):
    """Closed after reading each request: the one on the probe's pooled connection is sent once more, on a fresh
    connection, and every request still fails; none is sent a third time."""
    server = ClosingServer("after_reading")
    outcome, _ = run_against(server, tiny_llama_dir, tmp_path, capsys)
    assert outcome["completed"] == 0 and outcome["failed"] == 12 and outcome["retries"] <= 1
    assert server.requests == 2 + 12 + outcome["retries"]  # /v1/models and the probe, then each request

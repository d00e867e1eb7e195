"""The OpenAI-compatible server, end to end.

One real server process (`python -m jaxserve serve`, default model, small engine options) serves the
whole module: the official `openai` client, streaming, bad input, hang-ups, 100 concurrent requests,
/metrics, and a graceful SIGTERM (exit 0) at teardown. API keys, admission control and an engine
crash are checked in-process against the ASGI app over a fake engine (no model, no compiles).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

slow = pytest.mark.slow  # the tests that use the real server (default model)
REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
ENGINE_OPTIONS = ["--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "128"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, port: int, process: subprocess.Popen, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {name{labels}: value} plus {name: value} summed over labels."""
        text = httpx.get(self.url + "/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
            name = key.split("{", 1)[0]
            if "{" in key and key != name:
                samples[name] = samples.get(name, 0.0) + float(value)
        return samples


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "jaxserve", "serve", "--port", str(port), *ENGINE_OPTIONS,
               "--log-stats-interval", "2", "--shutdown-timeout", "10"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    handle = ServerProcess(port, process, log_path)
    statuses = []
    deadline = time.monotonic() + 400
    try:
        while True:
            assert process.poll() is None, f"server exited with {process.returncode}:\n{handle.log()[-3000:]}"
            assert time.monotonic() < deadline, f"server not healthy in time:\n{handle.log()[-3000:]}"
            try:
                status = httpx.get(handle.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status is not None and (not statuses or statuses[-1] != status):
                statuses.append(status)
            if status == 200:
                break
            time.sleep(0.25)
        handle.health_statuses = statuses
        yield handle
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, f"exit code {process.returncode} after SIGTERM:\n{handle.log()[-3000:]}"
    assert "Shutting down" in handle.log()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def running_gauge(server: ServerProcess) -> float:
    return server.metrics()["jaxserve:num_requests_running"]


def wait_idle(server: ServerProcess, within: float) -> float:
    """Seconds until running and waiting are both 0 (fails after `within`)."""
    started = time.monotonic()
    while True:
        samples = server.metrics()
        if samples["jaxserve:num_requests_running"] == 0 and samples["jaxserve:num_requests_waiting"] == 0:
            return time.monotonic() - started
        assert time.monotonic() - started < within, f"still busy after {within}s: {samples}"
        time.sleep(0.05)


# -- the official client ---------------------------------------------------------------------------------------


@slow
def test_health_went_from_503_to_200(server):
    assert server.health_statuses[-1] == 200
    assert 503 in server.health_statuses, "the HTTP server should answer 503 while the model loads"
    assert httpx.get(server.url + "/version").json()["version"]


@slow
def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@slow
def test_chat_capital_of_france(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


@slow
def test_completion_text_tokens_and_logprobs(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       logprobs=2)
    choice = answer.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert answer.usage.completion_tokens == len(choice.logprobs.tokens) <= 5
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text

    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": "The capital of France is"})
    token_ids = ids.json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=[token_ids, token_ids], max_tokens=5, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert by_ids.choices[0].text == by_ids.choices[1].text == choice.text
    assert by_ids.usage.prompt_tokens == 2 * len(token_ids)
    detok = httpx.post(str(client.base_url).replace("/v1/", "/detokenize"), json={"tokens": token_ids})
    assert detok.json()["prompt"] == "The capital of France is"


@slow
def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@slow
def test_n2_and_seed_reproducibility(client):
    messages = [{"role": "user", "content": "Tell me a short story about a cat."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=16, temperature=1.0,
                                           seed=1234)
    second = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=16, temperature=1.0,
                                            seed=1234)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.choices[0].message.content != first.choices[1].message.content
    assert first.usage.completion_tokens == second.usage.completion_tokens
    other = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=1.0, seed=99)
    assert other.choices[0].message.content != first.choices[0].message.content


@slow
def test_chat_logprobs_format(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2, "temperature": 0}
    content = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    entries = content["logprobs"]["content"]
    assert len(entries) >= 1
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["token"] == entry["top_logprobs"][0]["token"]  # greedy picks the top token
    assert "".join(e["token"] for e in entries) == content["message"]["content"]


# -- bad input ---------------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_MESSAGES = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [
    # (path, raw body or JSON, expected status, words the message must contain)
    (COMPLETIONS, b"{not json", 400, "malformed JSON"),
    (COMPLETIONS, b"", 400, "empty"),
    (COMPLETIONS, b"[1, 2]", 400, "JSON object"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt is required"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt must be"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt must not be empty"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt is empty"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n must be"),
    (COMPLETIONS, {"prompt": "x", "n": True}, 400, "n:"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 600}, 400, "max_model_len"),
    (COMPLETIONS, {"prompt": list(range(600))}, 400, "max_model_len"),
    (COMPLETIONS, {"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**9]}, 400, "vocabulary"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    (COMPLETIONS, {"prompt": "x", "n": 100000}, 400, "sequences"),
    (CHAT, {"model": MODEL}, 400, "messages is required"),
    (CHAT, {"messages": []}, 400, "non-empty"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "content"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "role"),
    (CHAT, {"messages": GOOD_MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": GOOD_MESSAGES, "max_tokens": 10**6}, 400, "max_model_len"),
    (CHAT, {"messages": GOOD_MESSAGES, "top_logprobs": 2}, 400, "logprobs"),
    (CHAT, {"messages": GOOD_MESSAGES, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": GOOD_MESSAGES, "model": "nope"}, 404, "nope"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
    ("/v1/nowhere", {}, 404, "Not Found"),
]


@slow
def test_bad_requests_get_openai_errors(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, status, words in BAD_REQUESTS:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = http.post(path, headers={"content-type": "application/json"}, **kwargs)
            assert response.status_code == status, (path, body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert words in error["message"], (body, error)
        # oversized bodies: declared (Content-Length) and streamed (chunked)
        huge = json.dumps({"prompt": "a" * (5 * 1024 * 1024)}).encode()
        assert http.post(COMPLETIONS, content=huge).status_code == 413
        chunks = (huge[i:i + 65536] for i in range(0, len(huge), 65536))
        response = http.post(COMPLETIONS, content=chunks)
        assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]
        # the server still answers correctly
        ok = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert "Traceback" not in server.log()


# -- hang-ups ----------------------------------------------------------------------------------------------------


@slow
def test_streaming_client_hangup_aborts_at_once(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                assert running_gauge(server) == 1
                break  # leaving iter_lines early closes the connection
    assert wait_idle(server, within=1.0) < 1.0
    assert server.metrics()["jaxserve:kv_cache_usage_perc"] == 0  # its pages are free again


@slow
def test_non_streaming_client_hangup_aborts(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + COMPLETIONS, json=body, timeout=1.5)
    assert wait_idle(server, within=1.0) < 1.0


# -- load --------------------------------------------------------------------------------------------------------


@slow
def test_100_concurrent_requests(server):
    rng = random.Random(0)
    topics = ["the sea", "a robot", "Paris", "music", "a small dog", "winter", "coffee", "the moon"]

    async def one(http: httpx.AsyncClient, index: int) -> str:
        stream = index % 2 == 0
        max_tokens = rng.randint(1, 8)
        if index % 3 == 0:
            path, body = COMPLETIONS, {"prompt": f"Write about {topics[index % 8]}" + " please" * (index % 7)}
        else:
            path, body = CHAT, {"messages": [{"role": "user", "content": f"Say something about {topics[index % 8]}."}]}
        body.update(model=MODEL, max_tokens=max_tokens, stream=stream, temperature=0.7, seed=index)
        if not stream:
            response = await http.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["finish_reason"]
        finish = None
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        finish = choice["finish_reason"] or finish
        return finish

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(100)))

    started = time.monotonic()
    finishes = asyncio.run(main())
    print(f"100 requests in {time.monotonic() - started:.1f}s")
    assert len(finishes) == 100 and set(finishes) <= {"stop", "length"}, finishes
    wait_idle(server, within=2.0)


@slow
def test_metrics_after_traffic(server):
    samples = server.metrics()
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"jaxserve:{gauge}" in samples
    assert samples["jaxserve:num_requests_running"] == 0 and samples["jaxserve:num_requests_waiting"] == 0
    assert 0 <= samples["jaxserve:kv_cache_usage_perc"] <= 1
    assert samples["jaxserve:prompt_tokens_total"] > 1000
    assert samples["jaxserve:generation_tokens_total"] > 300
    success = {k: v for k, v in samples.items() if k.startswith("jaxserve:request_success_total{")}
    by_reason = {reason: v for k, v in success.items() for reason in ("stop", "length", "abort")
                 if f'finished_reason="{reason}"' in k}
    assert by_reason["length"] >= 50 and by_reason["abort"] >= 2
    assert "jaxserve:num_preemptions_total" in samples
    assert samples["jaxserve:prefix_cache_queries_total"] >= samples["jaxserve:prefix_cache_hits_total"] > 0
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds"):
        count = samples[f"jaxserve:{histogram}_count"]
        assert count >= 50, (histogram, count)
        assert 0 < samples[f"jaxserve:{histogram}_sum"] / count < 120, histogram
    assert "Avg generation throughput" in server.log()


# -- in-process: API key, admission control, engine crash (fake engine) ------------------------------------------


class FakeTokenizer:
    """Bytes as tokens: enough for the server's tokenization paths."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **_):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


class FakeEngine:
    """Emits the token 'a' per step per request until max_tokens; `stalled` never runs anything, `crash` dies."""

    def __init__(self, mode: str = "normal"):
        from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

        self._types = (CompletionOutput, RequestMetrics, RequestOutput)
        self.mode = mode
        self.config = types.SimpleNamespace(max_model_len=64, max_num_seqs=2, model=None)
        self.model = types.SimpleNamespace(name="fake-model")
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 256
        self.stats = types.SimpleNamespace(prompt_tokens=0, generation_tokens=0, finished={}, steps=0)
        self.scheduler = types.SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)
        self.block_manager = types.SimpleNamespace(usage=0.0, num_prefix_queries=0, num_prefix_hits=0)
        self.requests: dict = {}
        self.pending: list = []
        self.aborts: list = []
        import threading

        self.lock = threading.Lock()
        self.wake = threading.Event()

    def validate_prompt(self, token_ids, params) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None):
        with self.lock:
            self.pending.append((request_id, list(prompt), params))
        self.wake.set()

    def abort_request(self, request_id):
        with self.lock:
            self.aborts.append(request_id)
        self.wake.set()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pending or self.aborts)

    def wait_for_requests(self, timeout=None) -> bool:
        if self.mode == "stalled":
            time.sleep(0.01)
            return False
        if not self.has_unfinished_requests():
            self.wake.wait(timeout)
            self.wake.clear()
        return self.has_unfinished_requests() and self.mode != "stalled"

    def step(self):
        CompletionOutput, RequestMetrics, RequestOutput = self._types
        if self.mode == "crash":
            raise RuntimeError("simulated device failure")
        with self.lock:
            for request_id, prompt, params in self.pending:
                self.requests[request_id] = (prompt, params, [], RequestMetrics(time.monotonic()))
            self.pending.clear()
            aborted, self.aborts = set(self.aborts), []
        outputs = []
        for request_id in list(self.requests):
            prompt, params, tokens, metrics = self.requests[request_id]
            reason = "abort" if request_id in aborted else None
            if reason is None:
                tokens.append(ord("a"))
                metrics.first_token_time = metrics.first_token_time or time.monotonic()
                metrics.last_token_time = time.monotonic()
                reason = "length" if len(tokens) >= params.max_tokens else None
            completions = [CompletionOutput(i, "a" * len(tokens), list(tokens), None, None, reason)
                           for i in range(params.n)]
            if reason:
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id, None, prompt, completions, reason is not None, metrics))
        time.sleep(0.01)
        return outputs


def run_in_process(engine: FakeEngine, check, max_waiting: int = 2, api_key: str | None = None) -> None:
    from jaxserve.server.api_server import ServerSettings, create_app
    from jaxserve.server.async_engine import AsyncEngine

    async_engine = AsyncEngine(lambda: engine, max_waiting=max_waiting)
    app = create_app(async_engine, ServerSettings(api_key=api_key, log_stats_interval=0))

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                for _ in range(200):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.01)
                await check(http, async_engine)

    asyncio.run(main())


def test_api_key_required_on_v1_routes():
    async def check(http: httpx.AsyncClient, _) -> None:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        missing = await http.post("/v1/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "incorrect" in wrong.json()["error"]["message"]
        good = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "aa"
        assert (await http.get("/health")).status_code == 200  # open
        assert (await http.get("/metrics")).status_code == 200

    run_in_process(FakeEngine(), check, api_key="sesame")


def test_admission_control_answers_503_with_retry_after():
    engine = FakeEngine("stalled")

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        body = {"prompt": "hi", "max_tokens": 2}
        held = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(4)]  # 2 slots + 2 waiting
        while async_engine.num_inflight_seqs < 4:
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert "capacity" in refused.json()["error"]["message"]
        engine.mode = "normal"
        engine.wake.set()
        answers = await asyncio.gather(*held)
        assert [a.status_code for a in answers] == [200] * 4
        assert async_engine.num_inflight_seqs == 0
        assert (await http.post("/v1/completions", json=body)).status_code == 200

    run_in_process(engine, check)


def test_engine_crash_fails_requests_with_500_and_health_503():
    engine = FakeEngine("stalled")

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        body = {"prompt": "hi", "max_tokens": 2}
        pending = asyncio.create_task(http.post("/v1/completions", json=body))
        streaming = asyncio.create_task(http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}))
        while async_engine.num_inflight_seqs < 2:
            await asyncio.sleep(0.01)
        engine.mode = "crash"
        engine.wake.set()
        answer = await pending
        assert answer.status_code == 500 and "crashed" in answer.json()["error"]["message"]
        events = [line for line in (await streaming).text.splitlines() if line.startswith("data: ")]
        assert "crashed" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
        assert (await http.get("/health")).status_code == 503
        later = await http.post("/v1/completions", json=body)
        assert later.status_code == 503

    run_in_process(engine, check)


def test_drain_timeout_ends_in_flight_requests_with_an_answer():
    engine = FakeEngine("stalled")

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        body = {"prompt": "hi", "max_tokens": 2}
        pending = asyncio.create_task(http.post("/v1/completions", json=body))
        streaming = asyncio.create_task(http.post("/v1/completions", json={**body, "stream": True}))
        while async_engine.num_inflight_seqs < 2:
            await asyncio.sleep(0.01)
        async_engine.drain(0.2)
        assert (await http.get("/health")).status_code == 503
        assert (await http.post("/v1/completions", json=body)).status_code == 503  # no new work while draining
        answer = await pending
        assert answer.status_code == 503 and "shut down" in answer.json()["error"]["message"]
        events = [line for line in (await streaming).text.splitlines() if line.startswith("data: ")]
        assert "shut down" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
        assert async_engine.num_inflight_seqs == 0 and len(engine.aborts) == 2  # the engine was told to drop both

    run_in_process(engine, check)


@slow
def test_sigterm_finishes_in_flight_requests_then_exits_0(server):
    """Runs last: SIGTERM mid-stream; the stream still completes, new connections are refused, exit status 0."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    events = []
    refused = None
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 2:
                server.process.send_signal(signal.SIGTERM)
            if len(events) == 4 and refused is None:
                time.sleep(0.3)
                try:
                    httpx.get(server.url + "/health", timeout=2)
                    refused = False
                except httpx.TransportError:
                    refused = True
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert refused, "the server kept accepting connections after SIGTERM"
    assert server.process.wait(timeout=60) == 0

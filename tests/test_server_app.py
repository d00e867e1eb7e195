"""The HTTP app in-process (ASGI, no sockets) over a fake engine: no model, no compiles.

The fake offers the `LLMEngine` interface the server uses — `add_request` (ValueError for an id in
use), `abort_request`, `step` with vLLM's `RequestOutputKind`s, `stats()` snapshots,
`default_sampling_params` — and records what it was asked, so these tests check what reaches the
engine: output kinds, priorities, chat templates, sampling defaults; plus API keys, admission
control, start-up, an engine crash, draining and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types
from typing import Awaitable, Callable

import httpx

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.stats import IterationStats, SchedulerStats
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

MODEL = "fake-model"
TOKEN = ord("a")
TOKEN_SECONDS = 0.01  # the fake's clock: its n-th token comes n of these after arrival


class FakeTokenizer:
    """Bytes as tokens. Without a `chat_template` argument it renders chats as `<role>content...<assistant>`."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, chat_template=None, **_):
        if chat_template is not None:
            import jinja2

            text = jinja2.Template(chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)
        else:
            text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text)


class FakeRequest:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int):
        self.request_id, self.prompt, self.params, self.priority = request_id, prompt, params, priority
        self.tokens: list[int] = []
        self.num_sent = 0  # tokens already in a DELTA output
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None

    def output(self) -> RequestOutput | None:
        kind = self.params.output_kind
        finished = self.finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        start = self.num_sent if kind == RequestOutputKind.DELTA else 0
        self.num_sent = len(self.tokens)
        new = self.tokens[start:]
        completions = [CompletionOutput(i, "a" * len(new), list(new), None, None, self.finish_reason)
                       for i in range(self.params.n)]
        last_token_time = self.arrival_time + len(self.tokens) * TOKEN_SECONDS if self.tokens else None
        metrics = RequestMetrics(self.arrival_time, self.arrival_time, self.first_token_time, last_token_time,
                                 last_token_time if finished else None)
        return RequestOutput(self.request_id, None, self.prompt, completions, finished, metrics)


class FakeEngine:
    """Each step emits the token 'a' for every running request until its max_tokens.

    Modes: "normal"; "stalled" (never steps, so requests stay in flight); "crash" (the next step raises).
    `received` maps each request id to (prompt token ids, SamplingParams, priority).
    """

    def __init__(self, mode: str = "normal", scheduling_policy: str = "fcfs"):
        self.mode = mode
        self.engine_config = types.SimpleNamespace(max_model_len=64, max_num_seqs=2, model=None,
                                                   scheduling_policy=scheduling_policy)
        self.model = types.SimpleNamespace(name=MODEL)
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 256
        self.default_sampling_params: dict = {}
        self.received: dict[str, tuple[list[int], SamplingParams, int]] = {}
        self.aborts: list[str] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._pending: list[FakeRequest] = []
        self._abort_queue: list[str] = []
        self._running: dict[str, FakeRequest] = {}
        self._live: set[str] = set()
        self._prompt_tokens = self._generation_tokens = self._steps = 0
        self._finished: dict[str, int] = {}
        self._stats = SchedulerStats()
        self._iteration = IterationStats()

    def stats(self) -> SchedulerStats:
        return self._stats

    def iteration_stats(self) -> IterationStats:
        return self._iteration

    validate_priority = LLMEngine.validate_priority  # the real rule (it reads only engine_config.scheduling_policy)

    def validate_prompt(self, token_ids, params) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) + params.max_tokens > self.engine_config.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None, lora_request=None) -> str:
        with self.lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
            self._live.add(request_id)
            self.received[request_id] = (list(prompt), params, priority)
            self._pending.append(FakeRequest(request_id, list(prompt), params, priority))
        self.wake.set()
        return request_id

    def abort_request(self, request_id) -> None:
        with self.lock:
            self.aborts.append(request_id)
            self._abort_queue.append(request_id)
        self.wake.set()

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._pending or self._abort_queue)

    def wait_for_requests(self, timeout=None) -> bool:
        if self.mode == "stalled":
            self.wake.wait(0.01)
            self.wake.clear()
            return False
        if not self.has_unfinished_requests():
            self.wake.wait(timeout)
            self.wake.clear()
        return self.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        if self.mode == "crash":
            raise RuntimeError("simulated device failure")
        with self.lock:
            for request in self._pending:
                self._running[request.request_id] = request
                self._prompt_tokens += len(request.prompt)
            self._pending.clear()
            aborted, self._abort_queue = set(self._abort_queue), []
        outputs, first_token, gaps = [], [], []
        for request in list(self._running.values()):
            if request.request_id in aborted:
                request.finish_reason = "abort"
            else:
                (gaps if request.tokens else first_token).append(TOKEN_SECONDS)
                request.tokens.append(TOKEN)
                self._generation_tokens += request.params.n
                request.first_token_time = request.first_token_time or request.arrival_time + TOKEN_SECONDS
                if len(request.tokens) >= request.params.max_tokens:
                    request.finish_reason = "length"
            output = request.output()
            if request.finish_reason is not None:
                del self._running[request.request_id]
                with self.lock:
                    self._live.discard(request.request_id)
                self._finished[request.finish_reason] = self._finished.get(request.finish_reason, 0) + 1
            if output is not None:
                outputs.append(output)
        self._steps += 1
        self._iteration = IterationStats(tuple(first_token), tuple(gaps))
        self._stats = SchedulerStats(
            num_running_seqs=sum(r.params.n for r in self._running.values()),
            num_waiting_seqs=sum(r.params.n for r in self._pending), kv_cache_usage=0.25 * len(self._running),
            prefix_cache_queries=7 * self._steps, prefix_cache_hits=3 * self._steps, num_preemptions=self._steps,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            request_success=tuple(sorted(self._finished.items())), num_steps=self._steps)
        return outputs


Check = Callable[[httpx.AsyncClient, object], Awaitable[None]]


def run_in_process(engine: FakeEngine | Callable[[], FakeEngine], check: Check, max_waiting: int = 2,
                   wait_ready: bool = True, **settings) -> None:
    """Runs the app's lifespan around `check(http_client, async_engine)`; waits for /health 200 first."""
    from jaxserve.server.api_server import ServerSettings, create_app
    from jaxserve.server.async_engine import AsyncEngine

    factory = engine if callable(engine) and not isinstance(engine, FakeEngine) else (lambda: engine)
    async_engine = AsyncEngine(factory, max_waiting=max_waiting)
    settings = {"served_model_names": [MODEL], "log_stats_interval": 0, **settings}
    app = create_app(async_engine, ServerSettings(**settings))

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                while wait_ready and (await http.get("/health")).status_code != 200:
                    await asyncio.sleep(0.01)
                await check(http, async_engine)

    asyncio.run(main())


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def metric_samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


# -- access and admission ----------------------------------------------------------------------------------------


def test_api_key_required_on_v1_routes():
    async def check(http: httpx.AsyncClient, _) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
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
        await wait_until(lambda: async_engine.num_inflight_seqs == 4)
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


def test_duplicate_request_id_cannot_break_another():
    """A client-chosen X-Request-Id already in flight gets 400; the request holding it is untouched."""
    engine = FakeEngine("stalled")

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        body = {"prompt": "hi", "max_tokens": 3}
        headers = {"X-Request-Id": "same"}
        first = asyncio.create_task(http.post("/v1/completions", json=body, headers=headers))
        await wait_until(lambda: async_engine.num_inflight_seqs == 1)
        for path, payload in (("/v1/completions", body),
                              ("/v1/completions", {**body, "stream": True})):
            duplicate = await http.post(path, json=payload, headers=headers)
            assert duplicate.status_code == 400, duplicate.text
            assert "already in use" in duplicate.json()["error"]["message"]
        assert engine.aborts == [] and async_engine.num_inflight_seqs == 1
        engine.mode = "normal"
        engine.wake.set()
        answer = await first
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "aaa"
        assert answer.json()["id"] == "cmpl-same"
        again = await http.post("/v1/completions", json=body, headers=headers)  # free once finished
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == "aaa"

    run_in_process(engine, check)


# -- start-up, crash and shutdown --------------------------------------------------------------------------------

MODEL_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
]


def test_model_routes_answer_503_while_loading_then_serve_the_known_name():
    release = threading.Event()

    def slow_factory() -> FakeEngine:
        assert release.wait(30), "the test never released the engine"
        return FakeEngine()

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        try:
            assert (await http.get("/health")).status_code == 503
            for method, path, body in MODEL_ROUTES:
                for named in ({}, {"model": MODEL}):
                    if body is None and named:
                        continue
                    response = await http.request(method, path, json={**body, **named} if body else None)
                    assert response.status_code == 503, (path, named, response.text)
                    assert response.headers["Retry-After"] and "loading" in response.json()["error"]["message"]
                if body is not None:
                    wrong = await http.request(method, path, json={**body, "model": "gpt-4"})
                    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        finally:
            release.set()
        await wait_until(lambda: async_engine.is_ready)
        for method, path, body in MODEL_ROUTES:
            response = await http.request(method, path, json={**body, "model": MODEL} if body else None)
            assert response.status_code == 200, (path, response.text)

    run_in_process(slow_factory, check, wait_ready=False)


def test_served_model_names_are_aliases_and_the_first_is_reported():
    async def check(http: httpx.AsyncClient, _) -> None:
        models = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["main-name", "alias"]
        for name in ("main-name", "alias", None):
            answer = await http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
            assert answer.status_code == 200 and answer.json()["model"] == "main-name"
        unknown = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert unknown.status_code == 404 and "main-name" in unknown.json()["error"]["message"]

    run_in_process(FakeEngine(), check, served_model_names=["main-name", "alias"])


def test_engine_crash_fails_requests_with_500_and_stops_the_server():
    engine = FakeEngine("stalled")
    fatal: list[BaseException] = []

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        async_engine.on_fatal_error = fatal.append
        body = {"prompt": "hi", "max_tokens": 2}
        pending = asyncio.create_task(http.post("/v1/completions", json=body))
        streaming = asyncio.create_task(http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}))
        await wait_until(lambda: async_engine.num_inflight_seqs == 2)
        engine.mode = "crash"
        engine.wake.set()
        answer = await pending
        assert answer.status_code == 500 and "crashed" in answer.json()["error"]["message"]
        events = sse_events((await streaming).text)
        assert "crashed" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        assert (await http.get("/health")).status_code == 503
        assert (await http.post("/v1/completions", json=body)).status_code == 503
        assert len(fatal) == 1 and "simulated device failure" in str(fatal[0])  # the server exits non-zero

    run_in_process(engine, check)


def test_drain_timeout_ends_in_flight_requests_with_an_answer():
    engine = FakeEngine("stalled")

    async def check(http: httpx.AsyncClient, async_engine) -> None:
        body = {"prompt": "hi", "max_tokens": 2}
        pending = asyncio.create_task(http.post("/v1/completions", json=body))
        streaming = asyncio.create_task(http.post("/v1/completions", json={**body, "stream": True}))
        await wait_until(lambda: async_engine.num_inflight_seqs == 2)
        async_engine.drain(0.2)
        assert (await http.get("/health")).status_code == 503
        assert (await http.post("/v1/completions", json=body)).status_code == 503  # no new work while draining
        answer = await pending
        assert answer.status_code == 503 and "shut down" in answer.json()["error"]["message"]
        events = sse_events((await streaming).text)
        assert "shut down" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        assert async_engine.num_inflight_seqs == 0 and len(engine.aborts) == 2  # the engine was told to drop both

    run_in_process(engine, check)


# -- what reaches the engine -------------------------------------------------------------------------------------


def test_streaming_asks_for_deltas_and_whole_answers_for_the_final_output_only():
    engine = FakeEngine()

    async def check(http: httpx.AsyncClient, _) -> None:
        body = {"prompt": ["hi", "yo"], "max_tokens": 5, "n": 2}
        whole = (await http.post("/v1/completions", json=body)).json()
        streamed = await http.post("/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}})
        events = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
        texts: dict[int, str] = {}
        for event in events:
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == {c["index"]: c["text"] for c in whole["choices"]} == {i: "aaaaa" for i in range(4)}
        assert events[-1]["usage"] == whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 20,
                                                         "total_tokens": 24,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        await http.post("/v1/chat/completions", json=chat)
        await http.post("/v1/chat/completions", json={**chat, "stream": True})
        kinds = [params.output_kind for _, params, _ in engine.received.values()]
        final, delta = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA
        assert kinds == [final, final, delta, delta, final, delta]

    run_in_process(engine, check, max_waiting=8)


def test_priority_reaches_the_engine():
    engine = FakeEngine(scheduling_policy="priority")

    async def check(http: httpx.AsyncClient, _) -> None:
        for priority in (-3, None, 7):
            body = {"prompt": "hi", "max_tokens": 1, **({} if priority is None else {"priority": priority})}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 2}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        assert [priority for _, _, priority in engine.received.values()] == [-3, 0, 7, 2]
        bad = await http.post("/v1/completions", json={"prompt": "hi", "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"

    run_in_process(engine, check)


def test_priority_needs_the_priority_policy():
    async def check(http: httpx.AsyncClient, _) -> None:
        refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 1})
        assert refused.status_code == 400 and "--scheduling-policy priority" in refused.json()["error"]["message"]
        assert (await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 0})
                ).status_code == 200

    run_in_process(FakeEngine(), check)


def test_latency_targets_reach_the_engine_and_bad_ones_are_400s():
    engine = FakeEngine()

    async def check(http: httpx.AsyncClient, _) -> None:
        body = {"prompt": "hi", "max_tokens": 1, "ttft_slo_ms": 250, "tpot_slo_ms": 40.5}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "ttft_slo_ms": 900.0}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        targets = [(params.ttft_slo_ms, params.tpot_slo_ms) for _, params, _ in engine.received.values()]
        assert targets == [(250, 40.5), (900.0, None)]
        for field, value in (("ttft_slo_ms", -1), ("tpot_slo_ms", 0), ("ttft_slo_ms", "soon")):
            bad = await http.post("/v1/completions", json={"prompt": "hi", field: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (field, value)

    run_in_process(engine, check)


def test_chat_uses_the_chat_template_setting():
    engine = FakeEngine()
    template = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"

    async def check(http: httpx.AsyncClient, _) -> None:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        (prompt, _, _), = engine.received.values()
        assert bytes(prompt).decode() == "[user:hi]"
        tokens = (await http.post("/tokenize", json={"messages": chat["messages"]})).json()["tokens"]
        assert bytes(tokens).decode() == "[user:hi]"

    run_in_process(engine, check, chat_template=template)


def test_generation_config_defaults_fill_only_unset_fields():
    engine = FakeEngine()
    engine.default_sampling_params = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
                                      "repetition_penalty": 1.2, "max_tokens": 3}

    async def check(http: httpx.AsyncClient, _) -> None:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        requests = [
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"prompt": "hi", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                 "repetition_penalty": 1.0, "max_tokens": 5}),
            ("/v1/chat/completions", {**chat, "max_completion_tokens": 4, "temperature": 0}),
        ]
        for path, body in requests:
            assert (await http.post(path, json=body)).status_code == 200
        params = [p for _, p, _ in engine.received.values()]
        fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
        got = [tuple(getattr(p, f) for f in fields) for p in params]
        assert got[0] == got[1] == (0.25, 0.5, 7, 0.1, 1.2, 3)
        assert got[2] == (1.0, 1.0, 0, 0.0, 1.0, 5)
        assert got[3] == (0, 0.5, 7, 0.1, 1.2, 4)

    run_in_process(engine, check)


def test_unset_max_tokens_follows_openai_within_the_context():
    """Completions default to 16 tokens and chat to the rest of the context, both capped by the room left."""
    engine = FakeEngine()

    async def check(http: httpx.AsyncClient, _) -> None:
        long_prompt = "x" * 60  # 4 tokens of room in the fake's 64-token context
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/completions", {"prompt": long_prompt}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            assert (await http.post(path, json=body)).status_code == 200
        max_tokens = [p.max_tokens for _, p, _ in engine.received.values()]
        chat_prompt = len("<user>hi<assistant>")
        assert max_tokens == [16, 4, 64 - chat_prompt]

    run_in_process(engine, check)


# -- metrics -----------------------------------------------------------------------------------------------------


def test_metrics_are_the_engine_stats_and_count_requests_once():
    engine = FakeEngine()

    async def check(http: httpx.AsyncClient, _) -> None:
        answer = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "n": 2})
        assert answer.status_code == 200
        streamed = await http.post("/v1/completions", json={"prompt": "hey", "max_tokens": 2, "stream": True})
        assert sse_events(streamed.text)[-1] == "[DONE]"
        samples = metric_samples((await http.get("/metrics")).text)
        stats = engine.stats()
        label = f'model_name="{MODEL}"'
        assert samples[f"jaxserve:prompt_tokens_total{{{label}}}"] == stats.prompt_tokens == 5 + 3
        assert samples[f"jaxserve:generation_tokens_total{{{label}}}"] == stats.generation_tokens == 2 * 3 + 2
        success = f'jaxserve:request_success_total{{finished_reason="length",{label}}}'
        assert samples[success] == stats.finished("length") == 2
        expected = {"num_requests_running": stats.num_running_seqs, "num_requests_waiting": stats.num_waiting_seqs,
                    "kv_cache_usage_perc": stats.kv_cache_usage, "num_preemptions_total": stats.num_preemptions,
                    "prefix_cache_queries_total": stats.prefix_cache_queries,
                    "prefix_cache_hits_total": stats.prefix_cache_hits}
        for name, value in expected.items():
            assert samples[f"jaxserve:{name}{{{label}}}"] == value, name
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the fake's made-up values came through
        assert samples[f"jaxserve:time_to_first_token_seconds_count{{{label}}}"] == 2
        assert samples[f"jaxserve:e2e_request_latency_seconds_count{{{label}}}"] == 2
        # measured in the engine for streamed and whole answers alike: 2 gaps for 3 tokens (n=2 shares steps), 1 for 2
        assert samples[f"jaxserve:inter_token_latency_seconds_count{{{label}}}"] == 2 + 1

    run_in_process(engine, check)


def test_stat_logger_reads_only_the_stats_snapshot(caplog):
    from jaxserve.server.metrics import StatLogger

    snapshots = [None, SchedulerStats(),
                 SchedulerStats(num_running_seqs=3, num_waiting_seqs=2, kv_cache_usage=0.5, prefix_cache_queries=10,
                                prefix_cache_hits=4, prompt_tokens=100, generation_tokens=50)]
    stat_logger = StatLogger(lambda: snapshots[0])
    caplog.set_level("INFO", logger="jaxserve.server.metrics")
    for _ in range(3):
        stat_logger.log()
        snapshots.pop(0)
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert len(lines) == 1  # nothing while loading or idle
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 40.0%" in lines[0]


def test_spec_decode_metrics_and_log_line(caplog):
    from jaxserve.server.metrics import ServerMetrics, StatLogger

    stats = SchedulerStats(generation_tokens=50, spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40,
                           spec_decode_num_accepted_tokens=30, spec_decode_accepted_per_pos=(10, 9, 7, 4))
    text = ServerMetrics([lambda: stats], "m").exposition().decode()
    assert 'jaxserve:spec_decode_num_drafts_total{model_name="m"} 10.0' in text
    assert 'jaxserve:spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0' in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 4.0' in text
    stat_logger = StatLogger(lambda: stats)
    caplog.set_level("INFO", logger="jaxserve.server.metrics")
    stat_logger.log()
    assert any("Draft acceptance rate: 75.0%, Mean acceptance length: 4.00" in r.getMessage() for r in caplog.records)


def test_goodput_metrics_and_log_line(caplog):
    from jaxserve.server.metrics import ServerMetrics, StatLogger

    stats = SchedulerStats(generation_tokens=5, request_slo=(("ttft", 8, 6), ("tpot", 8, 7), ("both", 8, 5)))
    text = ServerMetrics([lambda: stats], "m").exposition().decode()
    assert 'jaxserve:request_slo_met_total{kind="both",model_name="m"} 5.0' in text
    assert 'jaxserve:request_slo_checked_total{kind="ttft",model_name="m"} 8.0' in text
    assert "# TYPE jaxserve:request_queue_time_seconds histogram" in text  # vLLM's queue time histogram
    caplog.set_level("INFO", logger="jaxserve.server.metrics")
    StatLogger(lambda: stats).log()
    assert any("Goodput: ttft 6/8 met, tpot 7/8 met, both 5/8 met" in r.getMessage() for r in caplog.records)

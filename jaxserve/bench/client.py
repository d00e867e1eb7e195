"""The streaming client of `jaxserve bench serve`, for any OpenAI-compatible server (jaxserve's, vLLM, llama.cpp).

Owns the client side of the measurement: open-loop arrivals (Poisson at `request_rate`, or gamma with
`burstiness`; `inf` sends everything at once), an optional `max_concurrency` gate, streamed requests over aiohttp
(its HTTP parser is C, so the client is not what a small machine's numbers measure), and per-request timing.
TTFT and latency start when the request is actually sent: time spent waiting on the concurrency gate is not
counted. The first chunk carrying output text counts as the first token; token counts come from the server's
`usage` (stream_options.include_usage), else from counting text chunks. A request fails, and is counted as
failed, on an HTTP error, an error event, a stream that ends before `[DONE]`, or `timeout_s` without an answer.

Pooled connections: a server closes a keep-alive connection after its own idle timeout (uvicorn's and llama.cpp's
are 5 s), and a request written onto one just as it closes finds the connection gone ("Can not write request
body", or the server disconnecting before any answer). The pool drops idle connections after `KEEPALIVE_S`, under
those timeouts, and a request that fails so on a reused connection before any answer is sent once more on a fresh
one (`RequestResult.retries`); on a fresh connection, or once an answer began, a failure stays a failure.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, AsyncIterable, Callable, Sequence

from jaxserve.bench.datasets import RequestRecord
from jaxserve.bench.metrics import RequestResult

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
LINE_LIMIT_BYTES = 1 << 22  # one SSE line (one chunk's JSON) may be this long
KEEPALIVE_S = 2.0  # idle pooled connections are closed after this (servers' own timeouts are commonly 5 s)


class Attempt:
    """What the connection pool told about one send (aiohttp's trace signals): whether it reused a connection."""

    def __init__(self) -> None:
        self.reused = False


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
                  tokenizer: Any = None, sampling: dict[str, float] | None = None) -> dict[str, Any]:
    """The JSON body for one streamed request. Completions send token ids unless text is asked for."""
    body: dict[str, Any] = {"model": model, "temperature": 0.0, **(sampling or {}), "stream": True,
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


def chunk_text(data: dict[str, Any], endpoint: str) -> str | None:
    """The output text a streamed chunk carries (None when it has no choices)."""
    choices = data.get("choices")
    if not choices:
        return None
    if endpoint == CHAT:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def read_events(lines: AsyncIterable[bytes], endpoint: str, result: RequestResult, sent: float,
                      clock: Callable[[], float]) -> None:
    """Reads one SSE stream into `result`: timing from `sent`, text, token counts, and the failure if any."""
    last = sent
    chunks_with_text = 0
    usage = None
    finished = False
    async for raw in lines:
        line = raw.decode("utf-8", errors="replace").strip() if isinstance(raw, bytes) else raw.strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            finished = True
            break
        data = json.loads(payload)
        if "error" in data:
            result.error = str(data["error"])[:300]
            return
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
    if not finished:
        result.error = "the stream ended before [DONE]"
    elif chunks_with_text == 0:
        result.error = "the stream carried no output text"
    else:
        result.success = True


async def send_request(session: Any, url: str, endpoint: str, body: dict[str, Any], prompt_len: int,
                       run_start: float, clock: Callable[[], float] = time.perf_counter,
                       fresh_session: Any = None) -> RequestResult:
    """Streams one request over `session` (an aiohttp.ClientSession); a failure is a result, never a raise. With
    `fresh_session` (one that opens a connection per request), a request whose reused connection closed before any
    answer is sent again there, once. Its times count from the first send."""
    result = RequestResult(success=False, prompt_len=prompt_len)
    sent = clock()
    result.send_time = sent - run_start
    for use in (session, fresh_session):
        attempt, answered = Attempt(), False
        try:
            async with use.post(url, json=body, trace_request_ctx=attempt) as response:
                answered = True
                if response.status != 200:
                    text = await response.text(errors="replace")
                    result.error = f"HTTP {response.status}: {text[:300]}"
                    return result
                await read_events(response.content, endpoint, result, sent, clock)
        except asyncio.TimeoutError:
            result.error = "TimeoutError: no whole answer within the request timeout"
        except Exception as err:  # noqa: BLE001 - a failed request is a result, not a crash
            if attempt.reused and not answered and fresh_session is not None and use is session and closed(err):
                result.retries += 1
                continue
            result.error = f"{type(err).__name__}: {err}"
        return result
    return result


def closed(err: Exception) -> bool:
    """Whether `err` says the connection closed under the request: writing it failed or no answer came."""
    import aiohttp

    return isinstance(err, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError))


def open_session(timeout_s: float = 3600.0, headers: dict[str, str] | None = None, fresh: bool = False) -> Any:
    """An aiohttp session with no connection limit and a whole-request timeout; its pool keeps idle connections
    `KEEPALIVE_S` and says when it reuses one (`Attempt`). `fresh`: a new connection for every request."""
    import aiohttp

    async def reused(session, context, params) -> None:
        if isinstance(context.trace_request_ctx, Attempt):
            context.trace_request_ctx.reused = True

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(reused)
    connector = aiohttp.TCPConnector(limit=0, force_close=True) if fresh else aiohttp.TCPConnector(
        limit=0, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers,
                                 connector=connector, read_bufsize=LINE_LIMIT_BYTES, trace_configs=[trace])


async def run_benchmark(base_url: str, endpoint: str, bodies: Sequence[dict[str, Any]], prompt_lens: Sequence[int],
                        request_rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                        disable_tqdm: bool = False, timeout_s: float = 3600.0,
                        headers: dict[str, str] | None = None, clock: Callable[[], float] = time.perf_counter,
                        session: Any = None) -> tuple[list[RequestResult], float]:
    """Sends every body on the arrival schedule; returns results (request order) and the run duration.

    `clock` (seconds) and `session` (anything with aiohttp's `post`) are for tests: a virtual clock and a fake
    server make the timing checks exact.
    """
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + endpoint
    intervals = arrival_intervals(len(bodies), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(bodies), desc="requests", disable=disable_tqdm, dynamic_ncols=True)
    own = session is None
    session = open_session(timeout_s, headers) if own else session
    fresh_session = open_session(timeout_s, headers, fresh=True) if own else None
    try:
        run_start = clock()

        async def one(index: int) -> RequestResult:
            args = (session, url, endpoint, bodies[index], prompt_lens[index], run_start, clock, fresh_session)
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
    finally:
        if own:
            await session.close()
            await fresh_session.close()
        progress.close()
    return list(results), duration


async def _get_json(url: str, headers: dict[str, str] | None, timeout_s: float) -> tuple[int, Any]:
    async with open_session(timeout_s, headers) as session:
        async with session.get(url) as response:
            return response.status, (await response.json(content_type=None) if response.status == 200 else None)


def wait_for_server(base_url: str, timeout_s: float = 600.0, process: Any = None) -> None:
    """Polls GET /health until 200; raises RuntimeError on timeout or if `process` (a Popen) exits first."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            status, _ = asyncio.run(_get_json(base_url.rstrip("/") + "/health", None, 5.0))
            if status == 200:
                return
            last_error = f"HTTP {status}"
        except Exception as err:  # noqa: BLE001 - not up yet
            last_error = type(err).__name__
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} was not healthy within {timeout_s:.0f}s (last: {last_error})")


def served_model(base_url: str, headers: dict[str, str] | None = None) -> str:
    """The first model id GET /v1/models lists; RuntimeError naming the URL when there is none."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        status, data = asyncio.run(_get_json(url, headers, 30.0))
        problem = f"HTTP {status}" if status != 200 else None
        if problem is None:
            return data["data"][0]["id"]
    except Exception as err:  # noqa: BLE001 - reported with the URL
        problem = f"{type(err).__name__}: {err}"
    raise RuntimeError(f"cannot read the served model from {url} ({problem}); pass --model")

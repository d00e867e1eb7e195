"""The router's FastAPI app: forwards OpenAI requests to a worker the policy picks, streamed or whole.

`POST /v1/completions` and `/v1/chat/completions` go to one healthy worker: the body (checked to be a JSON
object) and the `Authorization` header pass through unchanged, and so does the worker's answer (status, body,
content type; a worker's 400 stays a 400), with an `x-jaxserve-worker` header naming the worker. A request that
cannot connect is retried once on another worker (the worker is ejected). A worker that fails after taking a
request is not retried: a whole answer becomes a 502, a stream in flight ends with an error event and `[DONE]`
(the form jaxserve's own streams end with on a failure), never silently. A client that hangs up, streamed or
whole, closes the upstream request, so the worker aborts it. `GET /v1/models` comes from a healthy worker; `/health`
(200 while any worker is healthy) and `/metrics` are the router's own. Routing text: a completion's prompt (a
string, or token ids written out), a chat's messages as role and content lines (an image: a digest of its URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policies import Policy
from jaxserve.router.workers import WorkerPool
from jaxserve.server.api_server import add_api_error_handlers
from jaxserve.server.errors import APIError, bad_request, error_body
from jaxserve.server.http_utils import sse, unless_disconnected
from jaxserve.server.middleware import BodyLimitMiddleware

logger = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 5
PASSED_HEADERS = ("authorization", "content-type", "x-request-id")


def routing_text(body: dict[str, Any]) -> str:
    """What the prefix tree keys a request by."""
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        return "".join(f"{m.get('role', '')}\n{_content(m.get('content'))}\n" for m in messages
                       if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of prompts routes by its first (they all go to one worker)
    return prompt if isinstance(prompt, str) else json.dumps(prompt)[:-1] if isinstance(prompt, list) else ""


def _content(content: Any) -> str:
    if isinstance(content, list):  # OpenAI's content parts
        return "".join(_part(part) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _part(part: dict) -> str:
    """A content part's text; an image's: a digest of its URL, so different images key differently."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if part.get("type") == "image_url" and isinstance(url, str):
        return f"<image {hashlib.sha256(url.encode()).hexdigest()[:16]}>"
    text = part.get("text", "")
    return text if isinstance(text, str) else ""


def create_router_app(pool: WorkerPool, policy: Policy, client: httpx.AsyncClient,
                      max_body_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    metrics = RouterMetrics(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.check_all()  # start with what the workers say
        checks = asyncio.create_task(pool.run())
        try:
            yield
        finally:
            checks.cancel()
            await client.aclose()

    app = FastAPI(title="jaxserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pool = pool
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)

    add_api_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if pool.healthy():
            return Response(status_code=200)
        return JSONResponse(error_body("no worker is healthy", "service_unavailable_error"), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        tried: set[str] = set()
        while True:
            url = _pick(pool, lambda workers: workers[0].url, tried)
            try:
                answer = await client.get(url + "/v1/models", headers=_headers(request))
            except httpx.TransportError:
                pool.connect_failed(url)
                tried.add(url)
                continue
            return _whole(answer, url)

    async def forward(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise bad_request(f"malformed JSON body: {err}") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        text = routing_text(body)
        tried: set[str] = set()
        for attempt in range(2):
            url = _pick(pool, lambda workers: policy.choose([w.load() for w in workers], text), tried)
            upstream = client.build_request("POST", url + path, content=raw, headers=_headers(request))
            worker = pool.workers[url]
            worker.in_flight += 1
            try:  # headers come when a whole answer is done: a client that leaves meanwhile closes the request
                sent, answer = await unless_disconnected(request, client.send(upstream, stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                worker.in_flight -= 1
                logger.warning("could not connect to %s (%s)%s", url, type(err).__name__,
                               "; retrying on another worker" if attempt == 0 else "")
                pool.connect_failed(url)
                tried.add(url)
                if attempt == 0:
                    metrics.retries.labels(url).inc()
                continue
            except BaseException:
                worker.in_flight -= 1
                raise
            metrics.requests.labels(url).inc()
            if not sent:
                worker.in_flight -= 1
                return Response(status_code=499)  # nobody reads it: the client has gone
            if body.get("stream") is True and answer.status_code == 200:
                return StreamingResponse(_relay(answer, worker), status_code=200,
                                         media_type=answer.headers.get("content-type", "text/event-stream"),
                                         headers={"x-jaxserve-worker": url})
            try:
                answered, _ = await unless_disconnected(request, answer.aread())
            except httpx.HTTPError as err:
                raise APIError(502, f"the worker at {url} failed before answering: {type(err).__name__}",
                               code="worker_failed") from None
            finally:
                await answer.aclose()
                worker.in_flight -= 1
            return _whole(answer, url) if answered else Response(status_code=499)
        raise APIError(503, "no worker could be reached; retry later", code="no_worker",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    return app


async def _relay(answer: httpx.Response, worker) -> AsyncIterator[bytes]:
    """The worker's stream as it comes; a broken one ends with an error event and [DONE]."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError as err:
        logger.warning("the stream from %s broke: %s", worker.url, type(err).__name__)
        failure = error_body(f"the worker at {worker.url} failed mid-stream ({type(err).__name__})",
                             "server_error", code="worker_failed")
        yield ("\n\n" + sse(failure) + sse("[DONE]")).encode()
    finally:
        await answer.aclose()
        worker.in_flight -= 1


def _pick(pool: WorkerPool, choose, tried: set[str]) -> str:
    workers = pool.healthy(frozenset(tried))
    if not workers:
        raise APIError(503, "no worker is healthy; retry later", code="no_worker",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return choose(workers)


def _headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in PASSED_HEADERS if name in request.headers}


def _whole(answer: httpx.Response, url: str) -> Response:
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"), headers={"x-jaxserve-worker": url})


__all__ = ["create_router_app", "routing_text"]

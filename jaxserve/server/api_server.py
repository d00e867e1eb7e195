"""The FastAPI app: routes, error handlers, middlewares and lifespan, and `run_server` (uvicorn).

`create_app` takes an `AsyncEngine` (so tests can hand in one over a fake engine). The engine loads
in the background after the HTTP server starts; the served model names are known from the start, so
until the engine is ready `/health` and every model route answer 503 with Retry-After (a name the
server does not serve still gets 404). Every error is OpenAI's error JSON; nothing a client sends
yields a 5xx. If the model fails to load or the engine loop dies, `run_server` stops and returns 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.loading import DEFAULT_MODEL
from jaxserve.server.async_engine import AsyncEngine, EngineState
from jaxserve.server.errors import APIError, bad_request, error_body
from jaxserve.server.http_utils import read_json
from jaxserve.server.lora_modules import add_lora_routes, runtime_updating_allowed
from jaxserve.server.metrics import ServerMetrics, StatLogger
from jaxserve.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, BodyTooLarge
from jaxserve.server.protocol import DetokenizeRequest, TokenizeRequest, normalize_messages
from jaxserve.server.serving import ServingContext, now
from jaxserve.server.serving_chat import create_chat_completion
from jaxserve.server.serving_completion import create_completion
from jaxserve.server.serving_render import render_chat, render_completion
from jaxserve.server.serving_responses import create_response, stored_response_missing

logger = logging.getLogger(__name__)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclasses.dataclass
class ServerSettings:
    # the names clients may use; the first is reported in responses (vLLM's --served-model-name)
    served_model_names: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_MODEL])
    chat_template: str | None = None  # a Jinja template used instead of the tokenizer's for chat requests
    tool_call_parser: str | None = None  # tool_choice "auto": the model's tool-call format (None: refused)
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    log_stats_interval: float = 10.0  # seconds; 0 disables the periodic stats line
    engine_stop_timeout: float = 10.0  # seconds to wait for the engine thread at shutdown
    # LoRA adapters served by name (--lora-modules): (name, path, base model name or None)
    lora_modules: list[tuple[str, str, str | None]] = dataclasses.field(default_factory=list)


def create_app(async_engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    ctx = ServingContext(async_engine, settings.served_model_names, settings.chat_template, settings.tool_call_parser)
    for name, path, base_model_name in settings.lora_modules:
        ctx.adapters.add(name, path, base_model_name)
    replicas = async_engine.replicas
    metrics = ServerMetrics([replica.stats for replica in replicas], ctx.model_name)
    stat_loggers = [StatLogger(replica.stats, f"Replica {replica.replica}: " if len(replicas) > 1 else "")
                    for replica in replicas]
    for replica in replicas:
        replica.metrics = metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        stats_task = asyncio.create_task(_log_stats(stat_loggers, settings.log_stats_interval))
        try:
            yield
        finally:
            stats_task.cancel()
            logger.info("shutting down: aborting %d in-flight requests, stopping the engine",
                        async_engine.num_inflight_requests)
            if not await async_engine.shutdown(settings.engine_stop_timeout):
                logger.warning("the engine thread did not stop within %.0fs", settings.engine_stop_timeout)

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.metrics = metrics
    _add_error_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.state == EngineState.READY:
            return Response(status_code=200)
        return JSONResponse(error_body(async_engine.unavailable_reason(), "service_unavailable_error"),
                            status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict:
        llm_engine = ctx.ready_engine()
        root = llm_engine.engine_config.model or llm_engine.model.name
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": now(), "owned_by": "jaxserve", "root": root, "parent": None,
            "max_model_len": llm_engine.engine_config.max_model_len} for name in ctx.served_model_names] + [{
            "id": name, "object": "model", "created": now(), "owned_by": "jaxserve", "root": lora.lora_path,
            "parent": lora.base_model_name or ctx.model_name, "max_model_len": llm_engine.engine_config.max_model_len}
            for name, lora in ctx.adapters.requests.items()]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> list[dict]:
        return await render_completion(ctx, request)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(request: Request) -> dict:
        return await render_chat(ctx, request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(ctx, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        raise stored_response_missing(response_id)

    if runtime_updating_allowed():
        add_lora_routes(app, ctx)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request, TokenizeRequest)
        ctx.check_model(body.model)
        llm_engine = ctx.ready_engine()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages")
        if body.prompt is not None:
            tokens = await ctx.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            try:
                messages, images = normalize_messages(body.messages)
            except ValueError as err:
                raise bad_request(str(err), param="messages") from None
            tokens = await ctx.apply_chat_template(messages, body.add_generation_prompt is not False,
                                                   images=bool(images))
            if images:  # each image's placeholder expanded, as the engine counts it
                tokens = (await ctx.prepare_images(tokens, images))["prompt_token_ids"]
        return {"count": len(tokens), "max_model_len": llm_engine.engine_config.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_json(request, DetokenizeRequest)
        ctx.check_model(body.model)
        vocab_size = ctx.ready_engine().vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
        return {"prompt": ctx.decode(body.tokens)}

    return app


def add_api_error_handlers(app: FastAPI) -> None:
    """OpenAI's error JSON for an `APIError` raised by a route and for a body over the size limit (413)."""
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: Request, err: BodyTooLarge) -> JSONResponse:
        return APIError(413, str(err)).response()


def _add_error_handlers(app: FastAPI) -> None:
    add_api_error_handlers(app)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg"))
        return bad_request(message, param=loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return APIError(err.status_code, str(err.detail), headers=getattr(err, "headers", None)).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return APIError(500, f"internal server error: {type(err).__name__}: {err}").response()


async def _log_stats(stat_loggers: list[StatLogger], interval: float) -> None:
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        try:
            for stat_logger in stat_loggers:
                stat_logger.log()
        except Exception:  # noqa: BLE001 - a stats line must never take the server down
            logger.exception("stats logging failed")


def run_server(app: FastAPI, async_engine: AsyncEngine, host: str, port: int, shutdown_timeout: float = 30.0) -> int:
    """Serves until SIGTERM/SIGINT (graceful: stop accepting, let requests finish up to `shutdown_timeout`,
    then end the rest with an error answer) or a fatal engine error; returns the exit status: 0, or 1 if
    the model failed to load or the engine loop died."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            async_engine.drain(shutdown_timeout)
            await super().shutdown(sockets)

    # uvicorn's own timeout is only a backstop: drain() answers every request before it
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout + 5,
                            timeout_keep_alive=5, log_level="info")
    server = Server(config)

    def fatal_error(error: BaseException) -> None:
        what = "the model failed to load" if async_engine.state == EngineState.LOAD_FAILED else "the engine loop died"
        logger.error("exiting with status 1: %s (%r)", what, error)
        server.should_exit = True

    async_engine.on_fatal_error = fatal_error
    status = run_uvicorn(server)
    if status:
        return status
    if async_engine.state in (EngineState.LOAD_FAILED, EngineState.DEAD):
        return 1
    if not server.started:
        return 1
    return 0


def run_uvicorn(server) -> int:
    """Runs a `uvicorn.Server` until SIGTERM/SIGINT; 0, or uvicorn's exit status if it could not start."""
    # uvicorn re-raises the signal that stopped it once it is done; make that a no-op so a graceful stop exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit as exit:  # uvicorn exits this way when it cannot bind or start
        return exit.code if isinstance(exit.code, int) else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["ServerSettings", "create_app", "run_server", "run_uvicorn"]

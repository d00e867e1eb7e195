"""HTTP plumbing shared by the routes: bounded JSON body reading, validation errors in OpenAI's words,
server-sent events, and responses that notice a client hanging up.

Starlette only notices a vanished client when it next writes to it; these helpers listen for
`http.disconnect` the whole time, so an abandoned request is aborted at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Awaitable, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.server.errors import bad_request

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "function-")


async def read_json(request: Request, model: type[M]) -> M:
    """The body parsed into `model`; a 400 naming the problem for malformed JSON or bad fields."""
    body = await request.body()  # the size limit is enforced by BodyLimitMiddleware
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        message, param = describe_validation_error(err)
        raise bad_request(message, param=param) from None


def describe_validation_error(err: ValidationError) -> tuple[str, str | None]:
    """One readable message (and the offending field) from a pydantic error."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"malformed JSON body: {first['ctx'].get('error', first['msg']) if first.get('ctx') else first['msg']}", None
    loc = [str(part) for part in first["loc"] if not _is_type_tag(part)]
    if not loc:
        return f"the request body must be a JSON object ({first['msg']})", None
    field = ".".join(loc)
    if first["type"] == "missing":
        return f"{field} is required", loc[0]
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == loc[0]]
    messages = list(dict.fromkeys(e["msg"] for e in same_field))
    shown = _short_repr(first.get("input"))
    return f"{field}: {' or '.join(messages[:3])} (got {shown})", loc[0]


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part.startswith(_TYPE_TAGS) or "[" in part)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict, type(None))) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event carrying JSON (or the literal `[DONE]`), named `event` if given."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client hangs up (the body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Runs `work` until done or until the client hangs up (then `work` is cancelled): (completed, result)."""
    work_task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return True, work_task.result()
        logger.info("client disconnected; request aborted")
        return False, None
    finally:
        for task in (work_task, listener):
            task.cancel()
        for task in (work_task, listener):
            with contextlib.suppress(BaseException):
                await task


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (closing the generator, which aborts its requests) when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, content, headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                           **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
            if listener.done() and not streamer.done():
                logger.info("streaming client disconnected; request aborted")
        finally:
            for task in (streamer, listener):
                task.cancel()
            for task in (streamer, listener):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()

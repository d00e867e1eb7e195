"""`POST /v1/responses`: OpenAI's Responses API, stateless, served as the chat request it amounts to
(`responses_protocol.py`) and answered as a `response` object — an assistant `message` item with `output_text`, and
a `function_call` item per tool call — whole, or streamed as the Responses events: `response.created`,
`response.in_progress`, then per output item `response.output_item.added`, its text (`response.content_part.added`,
`response.output_text.delta` ..., `.done`) or arguments (`response.function_call_arguments.delta` ..., `.done`) and
`response.output_item.done`, ending with `response.completed` (or `response.incomplete` when cut at
`max_output_tokens`). Every event carries its `sequence_number`. Nothing is stored (`store` is false).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server.async_engine import RequestFailed, Submission
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.http_utils import EventStreamResponse, read_json, sse, unless_disconnected
from jaxserve.server.responses_protocol import ResponsesRequest
from jaxserve.server.serving import (ServingContext, data_parallel_rank, engine_failures, invalid, new_id,
                                     request_failed)
from jaxserve.server.serving_chat import prepare_chat
from jaxserve.server.tools import ToolPlan, ToolStream


async def create_response(ctx: ServingContext, raw_request: Request) -> Response:
    request = await read_json(raw_request, ResponsesRequest)
    try:
        chat_request = request.chat_request()
    except ValueError as err:
        raise invalid(err) from None
    chat = await prepare_chat(ctx, chat_request)
    response_id = new_id("resp", raw_request)
    submission = ctx.submit(response_id, [chat.submitted], chat.params, request.priority, chat.lora_request,
                            data_parallel_rank(raw_request))
    shell = ResponseShell(ctx.model_name, request, response_id, len(chat.prompt_ids))
    if request.stream:
        return EventStreamResponse(_stream(shell, submission, chat.tools))
    with engine_failures():
        completed, outputs = await unless_disconnected(raw_request, submission.final_outputs())
    if not completed:
        return Response(status_code=499)
    output = outputs[0]
    completion = output.outputs[0]
    items = _output_items(completion.text, chat.tools, _item_status(completion.finish_reason))
    return JSONResponse(shell.body(items, completion.finish_reason, len(completion.token_ids),
                                   output.num_cached_tokens))


def stored_response_missing(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} is not stored: this server stores no responses (store is false)",
                    param="response_id")


class ResponseShell:
    """The fields of a `response` object that do not depend on the output (the request's settings echoed)."""

    def __init__(self, model_name: str, request: ResponsesRequest, response_id: str, num_prompt_tokens: int):
        self.id = response_id
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.fields = {
            "model": model_name, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "tools": request.tools or [], "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "text": request.text if (request.text or {}).get("format") else {"format": {"type": "text"}},
            "metadata": request.metadata or {}, "user": request.user, "previous_response_id": None,
            "store": False, "background": False, "truncation": "disabled", "reasoning": None,
        }

    def body(self, items: list[dict], finish_reason: str | None, num_output_tokens: int | None = None,
             num_cached_tokens: int = 0, status: str | None = None) -> dict[str, Any]:
        """The response object; `status` defaults to what `finish_reason` says ("in_progress" while None)."""
        if status is None:
            status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
        usage = None
        if num_output_tokens is not None:
            usage = {"input_tokens": self.num_prompt_tokens,
                     "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.num_prompt_tokens + num_output_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": items, "usage": usage, **self.fields}


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status != "in_progress" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _output_items(text: str, tools: ToolPlan | None, status: str) -> list[dict]:
    """A finished answer's output items: its content as a message (if any or if it made no calls), then its calls."""
    content, calls = tools.extract(text) if tools is not None else (text, [])
    items = [_message_item(content or "", status)] if content or not calls else []
    return items + [_call_item(call.id, call.name, call.arguments, status) for call in calls]


class ResponseEvents:
    """Turns one streamed answer's chat deltas (content, tool calls: what `ToolStream` or plain text give) into
    Responses events, keeping the output items for the final response."""

    def __init__(self, shell: ResponseShell):
        self.shell = shell
        self.sequence_number = 0
        self.items: list[dict] = []
        self._message: dict | None = None  # the open message item (its text in `_text`)
        self._text = ""
        self._calls: dict[int, dict] = {}  # open function-call items by tool-call index

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(body, event=kind)

    def start(self) -> list[str]:
        body = self.shell.body([], None)
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def feed(self, delta: dict) -> list[str]:
        events = []
        if delta.get("content"):
            if self._message is None:
                self._message = _message_item("", "in_progress")
                events += self._add(self._message)
                events.append(self.event("response.content_part.added", item_id=self._message["id"],
                                         output_index=self._index(self._message), content_index=0,
                                         part=_text_part("")))
            self._text += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=self._message["id"],
                                     output_index=self._index(self._message), content_index=0,
                                     delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            function = call.get("function", {})
            item = self._calls.get(call["index"])
            if item is None:
                events += self._close_message("completed")
                item = self._calls[call["index"]] = _call_item(call["id"], function["name"], "", "in_progress")
                events += self._add(item)
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self._index(item), delta=function["arguments"]))
        return events

    def finish(self, finish_reason: str | None, num_output_tokens: int, num_cached_tokens: int) -> list[str]:
        status = _item_status(finish_reason)
        events = self._close_message(status)
        for item in self._calls.values():
            item["status"] = status
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=self._index(item), arguments=item["arguments"], name=item["name"]))
            events.append(self.event("response.output_item.done", output_index=self._index(item), item=item))
        self._calls.clear()
        body = self.shell.body(self.items, finish_reason, num_output_tokens, num_cached_tokens)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=body)]

    def fail(self, error: APIError) -> list[str]:
        body = self.shell.body(self.items, None, status="failed")
        body["error"] = {"code": error.code or error.type, "message": error.message}
        return [self.event("error", code=error.code or error.type, message=error.message, param=error.param),
                self.event("response.failed", response=body)]

    def _add(self, item: dict) -> list[str]:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=self._index(item), item=dict(item))]

    def _index(self, item: dict) -> int:
        return next(index for index, known in enumerate(self.items) if known is item)

    def _close_message(self, status: str) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        index = self._index(message)
        message.update(status=status, content=[_text_part(self._text)])
        return [self.event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                           text=self._text, logprobs=[]),
                self.event("response.content_part.done", item_id=message["id"], output_index=index,
                           content_index=0, part=_text_part(self._text)),
                self.event("response.output_item.done", output_index=index, item=message)]


async def _stream(shell: ResponseShell, submission: Submission, tools: ToolPlan | None) -> AsyncIterator[str]:
    events = ResponseEvents(shell)
    tool_stream = ToolStream(tools) if tools is not None else None
    num_tokens = 0
    try:
        for event in events.start():
            yield event
        async for _, output in submission.results():
            completion = output.outputs[0] if output.outputs else None
            if completion is None:
                continue
            num_tokens += len(completion.token_ids)
            deltas = tool_stream.feed(completion.text) if tool_stream else [{"content": completion.text}]
            if completion.finish_reason is not None and tool_stream is not None:
                deltas += tool_stream.finish()[0]
            for delta in deltas:
                for event in events.feed(delta):
                    yield event
            if completion.finish_reason is not None:
                for event in events.finish(completion.finish_reason, num_tokens, output.num_cached_tokens):
                    yield event
    except RequestFailed as err:
        for event in events.fail(request_failed(err)):
            yield event
    except ValueError as err:
        for event in events.fail(bad_request(str(err))):
            yield event

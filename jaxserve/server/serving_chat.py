"""`POST /v1/chat/completions`: messages through the model's chat template, OpenAI chat completions out,
whole or as server-sent `chat.completion.chunk`s (a role chunk first, then content deltas) ending
with `data: [DONE]`.
"""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.async_engine import RequestFailed, Submission
from jaxserve.server.errors import bad_request
from jaxserve.server.http_utils import EventStreamResponse, read_json, sse, unless_disconnected
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.serving import (DeltaTracker, ServingContext, engine_failures, invalid, new_id,
                                     now, sorted_top, request_failed, stop_reason, usage)


async def create_chat_completion(ctx: ServingContext, raw_request: Request) -> Response:
    request = await read_json(raw_request, ChatCompletionRequest)
    ctx.check_model(request.model)
    engine = ctx.ready_engine()
    try:
        request.check_supported()
        messages = request.chat_messages()
        max_tokens, max_tokens_field = request.requested_max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"{max_tokens_field} must be an integer >= 1, got {max_tokens}")
    except ValueError as err:
        raise invalid(err) from None
    add_generation_prompt = request.add_generation_prompt is not False
    prompt_ids = await ctx.apply_chat_template(messages, add_generation_prompt)
    try:
        if max_tokens is None:  # OpenAI: up to the context length
            max_tokens = max(1, engine.config.max_model_len - len(prompt_ids))
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = request.sampling_params(max_tokens, top_logprobs, engine.vocab_size)
    except ValueError as err:
        raise invalid(err) from None
    request_id = new_id("chatcmpl")
    submission = ctx.submit(request_id, [prompt_ids], params)
    if request.stream:
        return EventStreamResponse(_stream(ctx, request, request_id, submission, params.n))
    with engine_failures():
        completed, outputs = await unless_disconnected(raw_request, submission.final_outputs())
    if not completed:
        return Response(status_code=499)
    return JSONResponse(_full_response(ctx, request, request_id, outputs[0]))


def _full_response(ctx: ServingContext, request: ChatCompletionRequest, request_id: str,
                   output: RequestOutput) -> dict:
    choices = [{
        "index": completion.index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": _logprobs(ctx, completion, 0, request.top_logprobs or 0) if request.logprobs else None,
        "finish_reason": completion.finish_reason,
        "stop_reason": stop_reason(completion.stop_reason),
    } for completion in output.outputs]
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": ctx.model_name,
            "choices": choices, "usage": usage([output])}


async def _stream(ctx: ServingContext, request: ChatCompletionRequest, request_id: str, submission: Submission,
                  n: int) -> AsyncIterator[str]:
    created = now()
    include_usage = request.include_usage
    tracker = DeltaTracker()
    final: RequestOutput | None = None

    def chunk(choices: list[dict], usage_value=None) -> dict:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_value
        return body

    try:
        yield sse(chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for index in range(n)]))
        async for _, output in submission.results():
            if output.finished:
                final = output
            choices = []
            for completion in output.outputs:
                index = completion.index
                if index in tracker.finished:
                    continue
                text, first_token = tracker.delta(index, completion.text, completion.token_ids)
                wants_logprobs = request.logprobs and len(completion.token_ids) > first_token
                if not text and not completion.finish_reason and not wants_logprobs:
                    continue
                if completion.finish_reason:
                    tracker.finished.add(index)
                choices.append({
                    "index": index,
                    "delta": {"content": text} if text else {},
                    "logprobs": (_logprobs(ctx, completion, first_token, request.top_logprobs or 0)
                                 if request.logprobs else None),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": stop_reason(completion.stop_reason),
                })
            if choices:
                yield sse(chunk(choices))
        if include_usage and final is not None:
            yield sse(chunk([], usage([final])))
    except RequestFailed as err:
        yield sse(request_failed(err).body())
    except ValueError as err:
        yield sse(bad_request(str(err)).body())
    yield sse("[DONE]")


def _logprobs(ctx: ServingContext, completion: CompletionOutput, start: int, top_k: int) -> dict:
    """OpenAI's chat logprobs ({"content": [...]}) for the tokens from `start` on."""
    content = []
    entries = completion.logprobs or []
    for token_id, top in zip(completion.token_ids[start:], entries[start:]):
        text = ctx.token_string(token_id)
        content.append({
            "token": text, "logprob": top.get(token_id), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": ctx.token_string(t), "logprob": value,
                              "bytes": list(ctx.token_string(t).encode("utf-8"))}
                             for t, value in sorted_top(top, top_k)],
        })
    return {"content": content}

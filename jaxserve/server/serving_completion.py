"""`POST /v1/completions`: prompts (text or token ids, one or many) in, OpenAI text completions out,
whole or as server-sent `text_completion` chunks ending with `data: [DONE]`.

Choice `index` is `prompt_index * n + sample_index`, as in OpenAI's API.
"""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.async_engine import RequestFailed, Submission
from jaxserve.server.errors import bad_request
from jaxserve.server.http_utils import EventStreamResponse, read_json, sse, unless_disconnected
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.serving import (DeltaTracker, ServingContext, engine_failures, invalid, new_id,
                                     now, sorted_top, request_failed, stop_reason, usage)


async def create_completion(ctx: ServingContext, raw_request: Request) -> Response:
    request = await read_json(raw_request, CompletionRequest)
    ctx.check_model(request.model)
    engine = ctx.ready_engine()
    try:
        request.check_supported()
        prompts = request.prompts()
        token_lists = [await ctx.encode(p) if isinstance(p, str) else p for p in prompts]
        max_model_len = engine.config.max_model_len
        max_tokens = request.max_tokens
        if max_tokens is None:  # as vLLM: up to the context length
            max_tokens = max(1, min(max_model_len - len(ids) for ids in token_lists))
        params = request.sampling_params(max_tokens, request.logprobs, engine.vocab_size)
    except ValueError as err:
        raise invalid(err) from None
    request_id = new_id("cmpl")
    submission = ctx.submit(request_id, token_lists, params)
    echoes = [p if isinstance(p, str) else ctx.decode(p) for p in prompts] if request.echo else None
    if request.stream:
        return EventStreamResponse(_stream(ctx, request, request_id, submission, params.n, echoes))
    with engine_failures():
        completed, outputs = await unless_disconnected(raw_request, submission.final_outputs())
    if not completed:
        return Response(status_code=499)
    return JSONResponse(_full_response(ctx, request, request_id, outputs, params.n, echoes))


def _full_response(ctx: ServingContext, request: CompletionRequest, request_id: str, outputs: list[RequestOutput],
                   n: int, echoes: list[str] | None) -> dict:
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            text = completion.text
            offset = 0
            if echoes is not None:
                text = echoes[prompt_index] + text
                offset = len(echoes[prompt_index])
            choices.append({
                "index": prompt_index * n + completion.index,
                "text": text,
                "logprobs": (_logprobs(ctx, completion, 0, offset) if request.logprobs is not None else None),
                "finish_reason": completion.finish_reason,
                "stop_reason": stop_reason(completion.stop_reason),
            })
    choices.sort(key=lambda choice: choice["index"])
    return {"id": request_id, "object": "text_completion", "created": now(), "model": ctx.model_name,
            "choices": choices, "usage": usage(outputs)}


async def _stream(ctx: ServingContext, request: CompletionRequest, request_id: str, submission: Submission, n: int,
                  echoes: list[str] | None) -> AsyncIterator[str]:
    created = now()
    include_usage = request.include_usage
    tracker = DeltaTracker()
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict], usage_value=None) -> dict:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_value
        return body

    try:
        async for prompt_index, output in submission.results():
            if output.finished:
                finals[prompt_index] = output
            choices = []
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                if index in tracker.finished:
                    continue
                text, first_token = tracker.delta(index, completion.text, completion.token_ids)
                if echoes is not None and index not in offsets:
                    text = echoes[prompt_index] + text
                    offsets[index] = len(echoes[prompt_index])
                new_tokens = len(completion.token_ids) > first_token
                wants_logprobs = request.logprobs is not None and new_tokens
                if not text and not completion.finish_reason and not wants_logprobs:
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(ctx, completion, first_token, offsets.get(index, 0))
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) \
                        if logprobs["tokens"] else offsets.get(index, 0)
                if completion.finish_reason:
                    tracker.finished.add(index)
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": completion.finish_reason,
                                "stop_reason": stop_reason(completion.stop_reason)})
            if choices:
                yield sse(chunk(choices))
        if include_usage:
            yield sse(chunk([], usage([finals[i] for i in sorted(finals)])))
    except RequestFailed as err:
        yield sse(request_failed(err).body())
    except ValueError as err:  # cannot happen after validation, but never leave a stream open without an answer
        yield sse(bad_request(str(err)).body())
    yield sse("[DONE]")


def _logprobs(ctx: ServingContext, completion: CompletionOutput, start: int, text_offset: int) -> dict:
    """OpenAI's completions logprobs for the tokens from `start` on."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    entries = completion.logprobs or []
    for token_id, top in zip(completion.token_ids[start:], entries[start:]):
        text = ctx.token_string(token_id)
        tokens.append(text)
        token_logprobs.append(top.get(token_id))
        top_logprobs.append({ctx.token_string(t): value for t, value in sorted_top(top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}

"""`POST /v1/completions`: prompts (text or token ids, one or many) in, OpenAI text completions out,
whole (the engine's FINAL_ONLY output) or as server-sent `text_completion` chunks (its DELTA outputs,
so each step costs the new tokens only) ending with `data: [DONE]`.

Choice `index` is `prompt_index * n + sample_index`, as in OpenAI's API. With `echo` a choice's text starts with its
prompt, and with `logprobs` too its logprobs start with the prompt's tokens (the first with null logprob and top
logprobs), as OpenAI's legacy API and vLLM answer; `max_tokens: 0` with `echo` only scores the prompt. A stream
sends the prompt in each choice's first chunk. vLLM's extra `prompt_logprobs` adds each choice's prompt logprobs
in vLLM's format, and its `return_token_ids` each choice's `prompt_token_ids` (a stream: in the choice's first
chunk) and `token_ids`.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.server.async_engine import RequestFailed, Submission
from jaxserve.server.errors import bad_request
from jaxserve.server.http_utils import EventStreamResponse, read_json, sse, unless_disconnected
from jaxserve.server.protocol import OPENAI_MAX_TOKENS, CompletionRequest
from jaxserve.server.serving import (ServingContext, data_parallel_rank, engine_failures, invalid, new_id, now,
                                     request_failed, sorted_top, stop_reason, usage, usage_counts)


async def prepare_completion(ctx: ServingContext, request: CompletionRequest) -> tuple[list, list[list[int]],
                                                                                      SamplingParams, Any]:
    """Checks `request` and tokenizes its prompts: (prompts, their token ids, sampling params, LoRA request);
    APIError (4xx, 503) naming what is wrong."""
    lora_request = ctx.check_model(request.model)
    llm_engine = ctx.ready_engine()
    try:
        request.check_supported()
        prompts = request.prompts()
        token_lists = [await ctx.encode(p) if isinstance(p, str) else p for p in prompts]
        defaults = ctx.sampling_defaults()
        max_tokens = request.max_tokens_for([len(ids) for ids in token_lists], llm_engine.engine_config.max_model_len,
                                            defaults, OPENAI_MAX_TOKENS)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.sampling_params(max_tokens, request.logprobs, llm_engine.vocab_size, defaults, kind,
                                         request.engine_prompt_logprobs)
    except ValueError as err:
        raise invalid(err) from None
    await ctx.compile_grammar(params)
    await ctx.read_adapter(lora_request)
    return prompts, token_lists, params, lora_request


async def create_completion(ctx: ServingContext, raw_request: Request) -> Response:
    request = await read_json(raw_request, CompletionRequest)
    prompts, token_lists, params, lora_request = await prepare_completion(ctx, request)
    request_id = new_id("cmpl", raw_request)
    submission = ctx.submit(request_id, token_lists, params, request.priority, lora_request,
                            data_parallel_rank(raw_request))
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
        echoed = _echoed_logprobs(ctx, request, output)
        for completion in output.outputs:
            text = completion.text
            if echoes is not None:
                text = echoes[prompt_index] + text
            choice = {
                "index": prompt_index * n + completion.index,
                "text": text,
                "logprobs": _joined(echoed, ctx, completion) if request.logprobs is not None else None,
                "finish_reason": completion.finish_reason,
                "stop_reason": stop_reason(completion.stop_reason),
            }
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(output.prompt_logprobs, request.prompt_logprobs)
            if request.return_token_ids:
                choice["prompt_token_ids"] = output.prompt_token_ids
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
    choices.sort(key=lambda choice: choice["index"])
    body = {"id": request_id, "object": "text_completion", "created": now(), "model": ctx.model_name,
            "choices": choices, "usage": usage(outputs)}
    if outputs[0].kv_transfer_params is not None:  # a prefill worker's, for the decode worker (vLLM's field)
        body["kv_transfer_params"] = outputs[0].kv_transfer_params
    return body


async def _stream(ctx: ServingContext, request: CompletionRequest, request_id: str, submission: Submission, n: int,
                  echoes: list[str] | None) -> AsyncIterator[str]:
    """One chunk per batch of DELTA outputs: each completion's new text (after its echo, first time)."""
    created = now()
    include_usage = request.include_usage
    text_offsets: dict[int, int] = {}  # per choice: where its next token's text starts (echo included)
    num_tokens: dict[int, int] = {}  # per choice: output tokens so far
    prompt_tokens: dict[int, int] = {}  # per prompt
    cached_tokens: dict[int, int] = {}  # per prompt
    echoed: dict[int, dict | None] = {}  # per prompt: its tokens' logprobs (the first output of a prompt has them)

    def chunk(choices: list[dict], usage_value=None) -> dict:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_value
        return body

    try:
        async for prompt_index, output in submission.results():
            prompt_tokens[prompt_index] = len(output.prompt_token_ids)
            cached_tokens[prompt_index] = output.num_cached_tokens
            if prompt_index not in echoed:
                echoed[prompt_index] = _echoed_logprobs(ctx, request, output)
            choices = []
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                num_tokens[index] = num_tokens.get(index, 0) + len(completion.token_ids)
                text = completion.text
                logprobs = None
                first = index not in text_offsets
                if first:  # the choice's first chunk: its echo first
                    text = (echoes[prompt_index] if echoes is not None else "") + text
                    text_offsets[index] = 0
                    if request.logprobs is not None:
                        logprobs = _joined(echoed[prompt_index], ctx, completion)
                        text_offsets[index] = sum(len(token) for token in logprobs["tokens"])
                elif request.logprobs is not None:
                    logprobs = _logprobs(ctx, completion, text_offsets[index])
                    text_offsets[index] += sum(len(token) for token in logprobs["tokens"])
                if not text and not completion.finish_reason and not (logprobs and logprobs["tokens"]) and not (
                        request.return_token_ids and completion.token_ids):
                    continue
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": completion.finish_reason,
                          "stop_reason": stop_reason(completion.stop_reason)}
                if request.return_token_ids:
                    if first:
                        choice["prompt_token_ids"] = output.prompt_token_ids
                    choice["token_ids"] = completion.token_ids
                choices.append(choice)
            if choices:
                yield sse(chunk(choices))
        if include_usage:
            yield sse(chunk([], usage_counts(sum(prompt_tokens.values()), sum(num_tokens.values()),
                                               sum(cached_tokens.values()))))
    except RequestFailed as err:
        yield sse(request_failed(err).body())
    except ValueError as err:  # cannot happen after validation, but never leave a stream open without an answer
        yield sse(bad_request(str(err)).body())
    yield sse("[DONE]")


def _echoed_logprobs(ctx: ServingContext, request: CompletionRequest, output: RequestOutput) -> dict | None:
    """OpenAI's completions logprobs of an echoed prompt's tokens (echo with logprobs; else None): the first token
    has none, each later one its logprob and the top `logprobs` (itself too), text offsets from 0."""
    if not request.echo or request.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)  # none only if the request ended early
    for token_id, entry in zip(output.prompt_token_ids, entries):
        text = ctx.token_string(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry[token_id].logprob)
        top = {t: lp.logprob for t, lp in entry.items() if t == token_id or lp.rank <= request.logprobs}
        top_logprobs.append({ctx.token_string(t): value for t, value in sorted_top(top)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _joined(echoed: dict | None, ctx: ServingContext, completion: CompletionOutput) -> dict:
    """A choice's logprobs: its echoed prompt's (if any), then its completion's, offsets running on."""
    if echoed is None:
        return _logprobs(ctx, completion, 0)
    start = sum(len(token) for token in echoed["tokens"])
    generated = _logprobs(ctx, completion, start)
    return {key: echoed[key] + generated[key] for key in generated}


def _vllm_prompt_logprobs(entries: PromptLogprobs | None, k: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token (None first), {token id: {logprob, rank, decoded_token}} of
    that token and the top k."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for position, (token_id, lp) in enumerate(entry.items()) if position == 0 or lp.rank <= k}
        for entry in entries]


def _logprobs(ctx: ServingContext, completion: CompletionOutput, text_offset: int) -> dict:
    """OpenAI's completions logprobs for the completion's tokens (all, or a delta's), the first at `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, top in zip(completion.token_ids, completion.logprobs or []):
        text = ctx.token_string(token_id)
        tokens.append(text)
        token_logprobs.append(top.get(token_id))
        top_logprobs.append({ctx.token_string(t): value for t, value in sorted_top(top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}

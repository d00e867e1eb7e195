"""`POST /v1/chat/completions`: messages (and tools) through the chat template (--chat-template, else the model's),
OpenAI chat completions out, whole (the engine's FINAL_ONLY output) or as server-sent
`chat.completion.chunk`s (a role chunk first, then the engine's DELTA outputs as content or tool-call deltas)
ending with `data: [DONE]`. Tool calls are planned and parsed in `tools.py`. With vLLM's `return_token_ids` the
answer (a stream: its first chunk) has `prompt_token_ids` and each choice (chunk choice) its `token_ids`.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.server.async_engine import RequestFailed, Submission
from jaxserve.server.errors import bad_request
from jaxserve.lora.request import LoRARequest
from jaxserve.server.http_utils import EventStreamResponse, read_json, sse, unless_disconnected
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.tools import ToolPlan, ToolStream, plan_tools
from jaxserve.server.serving import (ServingContext, data_parallel_rank, engine_failures, invalid, new_id, now,
                                     request_failed, sorted_top, stop_reason, usage, usage_counts)


@dataclasses.dataclass(frozen=True)
class ChatGeneration:
    """A checked chat request ready to submit: its prompt, sampling params and tool plan."""

    prompt_ids: list[int]  # with each image's placeholder expanded
    params: SamplingParams
    tools: ToolPlan | None
    lora_request: LoRARequest | None = None  # the adapter `model` names (None: the base model)
    prompt: dict | None = None  # with images: the prepared prompt (`LLMEngine.prepare`) to submit

    @property
    def submitted(self) -> list[int] | dict:
        return self.prompt_ids if self.prompt is None else self.prompt


async def prepare_chat(ctx: ServingContext, request: ChatCompletionRequest) -> ChatGeneration:
    """Checks `request`, renders its prompt and compiles its grammar; APIError (4xx, 503) naming what is wrong."""
    lora_request = ctx.check_model(request.model)
    llm_engine = ctx.ready_engine()
    try:
        request.check_supported()
        messages, images = request.chat_messages()
        tools = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, ctx.tool_call_parser)
    except ValueError as err:
        raise invalid(err) from None
    add_generation_prompt = request.add_generation_prompt is not False
    prompt_ids = await ctx.apply_chat_template(messages, add_generation_prompt, tools.tools if tools else None,
                                               bool(images))
    prompt = await ctx.prepare_images(prompt_ids, images) if images else None
    if prompt is not None:
        prompt_ids = prompt["prompt_token_ids"]
    try:
        defaults = ctx.sampling_defaults()
        max_tokens = request.max_tokens_for([len(prompt_ids)], llm_engine.engine_config.max_model_len, defaults, None)
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.sampling_params(max_tokens, top_logprobs, llm_engine.vocab_size, defaults, kind)
        if tools is not None and tools.guided is not None:
            if params.guided_decoding is not None:
                raise ValueError(f"tool_choice {tools.mode!r} constrains the output already: drop the other "
                                 "output constraint")
            params = dataclasses.replace(params, guided_decoding=tools.guided)
    except ValueError as err:
        raise invalid(err) from None
    await ctx.compile_grammar(params)
    await ctx.read_adapter(lora_request)
    return ChatGeneration(prompt_ids, params, tools, lora_request, prompt)


async def create_chat_completion(ctx: ServingContext, raw_request: Request) -> Response:
    request = await read_json(raw_request, ChatCompletionRequest)
    chat = await prepare_chat(ctx, request)
    request_id = new_id("chatcmpl", raw_request)
    submission = ctx.submit(request_id, [chat.submitted], chat.params, request.priority, chat.lora_request,
                            data_parallel_rank(raw_request))
    if request.stream:
        return EventStreamResponse(_stream(ctx, request, request_id, submission, chat.params.n, chat.tools,
                                           chat.prompt_ids))
    with engine_failures():
        completed, outputs = await unless_disconnected(raw_request, submission.final_outputs())
    if not completed:
        return Response(status_code=499)
    return JSONResponse(_full_response(ctx, request, request_id, outputs[0], chat.tools))


def _message(completion: CompletionOutput, tools: ToolPlan | None) -> tuple[dict, str | None]:
    """The assistant message of a finished completion and its finish reason ("tool_calls" once it made some)."""
    if tools is None:
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    content, calls = tools.extract(completion.text)
    reason = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": [call.to_dict() for call in calls]}, reason


def _full_response(ctx: ServingContext, request: ChatCompletionRequest, request_id: str,
                   output: RequestOutput, tools: ToolPlan | None) -> dict:
    choices = []
    for completion in output.outputs:
        message, reason = _message(completion, tools)
        choice = {
            "index": completion.index,
            "message": message,
            "logprobs": _logprobs(ctx, completion, request.top_logprobs or 0) if request.logprobs else None,
            "finish_reason": reason,
            "stop_reason": stop_reason(completion.stop_reason),
        }
        if request.return_token_ids:
            choice["token_ids"] = completion.token_ids
        choices.append(choice)
    body = {"id": request_id, "object": "chat.completion", "created": now(), "model": ctx.model_name,
            "choices": choices, "usage": usage([output])}
    if request.return_token_ids:
        body["prompt_token_ids"] = output.prompt_token_ids
    if output.kv_transfer_params is not None:  # a prefill worker's, for the decode worker (vLLM's field)
        body["kv_transfer_params"] = output.kv_transfer_params
    return body


async def _stream(ctx: ServingContext, request: ChatCompletionRequest, request_id: str, submission: Submission,
                  n: int, tools: ToolPlan | None, prompt_ids: list[int]) -> AsyncIterator[str]:
    created = now()
    include_usage = request.include_usage
    num_cached = 0
    num_tokens = 0
    tool_streams = [ToolStream(tools) for _ in range(n)] if tools is not None else None

    def chunk(choices: list[dict], usage_value=None) -> dict:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_value
        return body

    try:
        first = chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for index in range(n)])
        if request.return_token_ids:
            first["prompt_token_ids"] = prompt_ids
        yield sse(first)
        async for _, output in submission.results():
            num_cached = output.num_cached_tokens
            choices = []
            for completion in output.outputs:
                num_tokens += len(completion.token_ids)
                wants_tokens = (request.logprobs or request.return_token_ids) and completion.token_ids
                deltas, reason = _deltas(completion, tool_streams[completion.index] if tool_streams else None)
                if not deltas and not completion.finish_reason and not wants_tokens:
                    continue
                for position, delta in enumerate(deltas or [{}]):
                    last = position == max(len(deltas), 1) - 1
                    choice = {
                        "index": completion.index,
                        "delta": delta,
                        "logprobs": (_logprobs(ctx, completion, request.top_logprobs or 0)
                                     if request.logprobs and position == 0 else None),
                        "finish_reason": reason if last else None,
                        "stop_reason": stop_reason(completion.stop_reason) if last else None,
                    }
                    if request.return_token_ids:
                        choice["token_ids"] = completion.token_ids if position == 0 else []
                    choices.append(choice)
            if choices:
                yield sse(chunk(choices))
        if include_usage:
            yield sse(chunk([], usage_counts(len(prompt_ids), num_tokens, num_cached)))
    except RequestFailed as err:
        yield sse(request_failed(err).body())
    except ValueError as err:
        yield sse(bad_request(str(err)).body())
    yield sse("[DONE]")


def _deltas(completion: CompletionOutput, tool_stream: ToolStream | None) -> tuple[list[dict], str | None]:
    """A streamed completion delta's chunk deltas (content, or tool calls under a tool plan) and finish reason."""
    if tool_stream is None:
        return ([{"content": completion.text}] if completion.text else []), completion.finish_reason
    deltas = tool_stream.feed(completion.text)
    if completion.finish_reason is None:
        return deltas, None
    last, called = tool_stream.finish()
    reason = "tool_calls" if called and completion.finish_reason == "stop" else completion.finish_reason
    return deltas + last, reason


def _logprobs(ctx: ServingContext, completion: CompletionOutput, top_k: int) -> dict:
    """OpenAI's chat logprobs ({"content": [...]}) for the completion's tokens (all, or a delta's)."""
    content = []
    for token_id, top in zip(completion.token_ids, completion.logprobs or []):
        text = ctx.token_string(token_id)
        content.append({
            "token": text, "logprob": top.get(token_id), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": ctx.token_string(t), "logprob": value,
                              "bytes": list(ctx.token_string(t).encode("utf-8"))}
                             for t, value in sorted_top(top, top_k)],
        })
    return {"content": content}

"""vLLM's render endpoints: `POST /v1/completions/render` and `/v1/chat/completions/render` answer with the token
ids a completion or chat request would be prompted with (the chat template, tools and images applied), without
running it. vllm-router asks for them to route by tokens (its `kv_aware` policy; it falls back to `/tokenize`), as
do other gateways built for vLLM. A completion renders to a list, one entry per prompt; a chat to one entry:
`{"request_id", "model", "token_ids", "features", "sampling_params"}` (`features`: null, images are in
`token_ids` as their expanded placeholders)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from starlette.requests import Request

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.http_utils import read_json
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.server.serving import ServingContext, new_id
from jaxserve.server.serving_chat import prepare_chat
from jaxserve.server.serving_completion import prepare_completion


def plain_fields(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters as JSON: the plain fields (numbers, strings, lists of them), enums by value."""
    fields = {}
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if isinstance(value, enum.Enum):
            value = value.value
        if value is None or isinstance(value, (bool, int, float, str)) or (
                isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in value)):
            fields[field.name] = list(value) if isinstance(value, tuple) else value
    return fields


def _rendered(request_id: str, model: str, token_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    return {"request_id": request_id, "model": model, "token_ids": list(token_ids), "features": None,
            "sampling_params": plain_fields(params)}


async def render_completion(ctx: ServingContext, raw_request: Request) -> list[dict[str, Any]]:
    request = await read_json(raw_request, CompletionRequest)
    _, token_lists, params, _ = await prepare_completion(ctx, request)
    model = request.model or ctx.model_name
    return [_rendered(new_id("cmpl", raw_request), model, ids, params) for ids in token_lists]


async def render_chat(ctx: ServingContext, raw_request: Request) -> dict[str, Any]:
    request = await read_json(raw_request, ChatCompletionRequest)
    chat = await prepare_chat(ctx, request)
    return _rendered(new_id("chatcmpl", raw_request), request.model or ctx.model_name, chat.prompt_ids, chat.params)

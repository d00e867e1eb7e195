"""The adapters a server serves by name (vLLM's `--lora-modules` and dynamic loading): each name a client may put in
`model`, its `LoRARequest`, and the base model it belongs to (`/v1/models`' `parent`).

`--lora-modules` takes `name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`.
Adapters get ids 1, 2, ... in the order they are added; `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` add and remove them at run time when `JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING` is true (as
vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
"""

from __future__ import annotations

import itertools
import json
import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from jaxserve.lora.request import LoRARequest
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.http_utils import read_json
from jaxserve.server.protocol import StrictModel

RUNTIME_UPDATING_ENV = "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


def parse_lora_module(value: str) -> tuple[str, str, str | None]:
    """A `--lora-modules` item as (name, path, base model name or None); ValueError naming the item."""
    value = value.strip()
    if value.startswith("{"):
        try:
            item = json.loads(value)
        except ValueError as error:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON ({error})") from None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"),
                                                                                                    str):
            raise ValueError(f"--lora-modules {value!r} needs string fields \"name\" and \"path\"")
        return item["name"], item["path"], item.get("base_model_name")
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r} must be name=path or a JSON object")
    return name, path, None


class ServedAdapters:
    """Adapter names -> their `LoRARequest` (the event loop's; no locking)."""

    def __init__(self, base_names: list[str]):
        self.base_names = base_names
        self.requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A new served adapter; ValueError if the name is taken (by an adapter or the base model)."""
        if name in self.requests or name in self.base_names:
            raise ValueError(f"the name {name!r} is already served" + (" (the base model)" if name in self.base_names
                                                                        else ""))
        request = LoRARequest(name, next(self._ids), path, base_model_name)
        self.requests[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        """Stops serving an adapter; KeyError if there is none of that name."""
        return self.requests.pop(name)


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, ctx) -> None:
    """`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies and answers) on `app`, over the
    `ServingContext` `ctx`: an adapter is read and checked before it is served (400 naming the problem)."""
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request, LoadLoRAAdapterRequest)
        adapters = ctx.adapters
        if body.lora_name in adapters.requests or body.lora_name in adapters.base_names:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        lora = adapters.add(body.lora_name, body.lora_path)
        try:
            await ctx.read_adapter(lora, param="lora_path")
        except APIError:  # a bad adapter (400) or an engine not ready (503): not served
            adapters.requests.pop(body.lora_name, None)
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request, UnloadLoRAAdapterRequest)
        try:
            lora = ctx.adapters.remove(body.lora_name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        ctx.forget_adapter(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

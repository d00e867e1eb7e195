"""`ServingContext`: what every OpenAI route needs — the engine, the served model names, tokenization and
chat templates, the model's sampling defaults, submitting with errors mapped to HTTP statuses — and the
shared pieces of OpenAI's response shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from starlette.requests import Request

from jaxserve.server.async_engine import (AsyncEngine, EngineUnavailable, RequestFailed, ServerOverloaded,
                                          Submission)
from jaxserve.chat import render_chat
from jaxserve.lora.request import LoRARequest
from jaxserve.server.errors import APIError, bad_request, param_of
from jaxserve.server.lora_modules import ServedAdapters

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.outputs import RequestOutput
    from jaxserve.sampling_params import SamplingParams

RETRY_AFTER_SECONDS = 1
LARGE_TEXT_CHARS = 20_000  # tokenize longer texts in a worker thread, off the event loop
SAMPLING_FIELDS = {"model", "prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "max_tokens", "max_completion_tokens",
                   "min_tokens", "stop", "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos", "stream",
                   "stream_options", "logit_bias", "best_of", "suffix", "tools", "response_format", "echo",
                   "tokens", "priority", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "structured_outputs", "tool_choice", "parallel_tool_calls", "prompt_logprobs", "return_token_ids",
                   "ttft_slo_ms", "tpot_slo_ms", "kv_transfer_params"}


class ServingContext:
    """The engine behind the routes, the names it is served under, the chat template override and the tool-call
    parser of `tool_choice: "auto"`."""

    def __init__(self, async_engine: AsyncEngine, served_model_names: Sequence[str],
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 adapters: ServedAdapters | None = None):
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.async_engine = async_engine
        self.served_model_names = list(served_model_names)
        self.chat_template = chat_template  # used instead of the tokenizer's for chat requests
        self.tool_call_parser = tool_call_parser  # None: "auto" tool choice is off
        self._token_strings: dict[int, str] = {}
        self.adapters = adapters or ServedAdapters(self.served_model_names)  # LoRA adapters served by name

    # -- model and engine -----------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The name responses report: the first served name (known before the engine loads)."""
        return self.served_model_names[0]

    def ready_engine(self) -> LLMEngine:
        try:
            return self.async_engine.ready_engine()
        except EngineUnavailable as err:
            raise unavailable(str(err)) from None

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a name this server does not serve."""
        if model is None or model in self.served_model_names:
            return None
        if model in self.adapters.requests:
            return self.adapters.requests[model]
        names = ", ".join(f"`{name}`" for name in [self.model_name, *self.adapters.requests])
        raise APIError(404, f"The model `{model}` does not exist; this server serves {names}",
                       param="model", code="model_not_found")

    def sampling_defaults(self) -> dict[str, Any]:
        """The model's generation-config defaults for the sampling fields a request leaves unset."""
        return self.ready_engine().default_sampling_params

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles a constrained request's grammar off the event loop (cached by its text, so `submit` finds it
        compiled); 400 with llguidance's message if it does not compile."""
        if params.guided_decoding is None:
            return
        try:
            await asyncio.to_thread(self.ready_engine().validate_guided_decoding, params)
        except ValueError as err:
            raise invalid(err) from None

    async def read_adapter(self, lora_request: LoRARequest | None, param: str = "model") -> None:
        """Reads and checks a request's adapter off the event loop, into every replica's host cache (so `submit`
        finds it read); 400 naming the problem (and `param`)."""
        if lora_request is None:
            return
        try:
            for llm_engine in self.replica_engines():
                await asyncio.to_thread(llm_engine.validate_lora, lora_request)
        except ValueError as err:
            raise bad_request(str(err), param=param) from None

    def forget_adapter(self, lora_request: LoRARequest) -> None:
        """Drops an unloaded adapter from every replica's host cache (requests running with it keep theirs)."""
        for llm_engine in self.replica_engines():
            if llm_engine.adapters is not None:
                llm_engine.adapters.remove(lora_request.lora_int_id)

    def replica_engines(self) -> list[LLMEngine]:
        """Every replica's engine (one without data parallelism); 503 while one is unavailable."""
        try:
            return [replica.ready_engine() for replica in self.async_engine.replicas]
        except EngineUnavailable as err:
            raise unavailable(str(err)) from None

    def submit(self, request_id: str, prompts: list[list[int] | dict], params: SamplingParams,
               priority: int = 0, lora_request: LoRARequest | None = None,
               data_parallel_rank: int | None = None) -> Submission:
        """Queues the prompts, on replica `data_parallel_rank` if given (a router's pick: vLLM's
        `X-data-parallel-rank`); 400 for invalid input (a bad adapter, a replica the server lacks), 503
        (+ Retry-After) when full or unavailable."""
        engine = self.async_engine
        if data_parallel_rank is not None:
            if not 0 <= data_parallel_rank < len(engine.replicas):
                raise bad_request(f"X-data-parallel-rank {data_parallel_rank} is not a replica of this server "
                                  f"(0..{len(engine.replicas) - 1})")
            engine = engine.replicas[data_parallel_rank]
        try:
            return engine.submit(request_id, prompts, params, priority, lora_request)
        except ValueError as err:
            raise invalid(err) from None
        except ServerOverloaded as err:
            raise unavailable(str(err)) from None
        except EngineUnavailable as err:
            raise unavailable(str(err)) from None

    # -- tokenization ---------------------------------------------------------------------------------------

    def tokenizer(self):
        tokenizer = self.ready_engine().tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids instead of text")
        return tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.tokenizer()
        if len(text) > LARGE_TEXT_CHARS:
            return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                  tools: list[dict] | None = None, images: bool = False) -> list[int]:
        """Prompt token ids through --chat-template, or else the tokenizer's own template (with `tools`); with
        `images`, their placeholders expanded in the rendered text (`LLMEngine.encode_chat`)."""
        tokenizer = self.tokenizer()
        if tokenizer.chat_template is None and self.chat_template is None:
            raise bad_request("this model has no chat template: use /v1/completions or start the server with "
                              "--chat-template", param="messages")
        args = (tokenizer, messages, add_generation_prompt, self.chat_template, tools,
                self.ready_engine().encode_chat if images else None)
        try:
            if sum(len(m.get("content") or "") for m in messages) > LARGE_TEXT_CHARS:
                return await asyncio.to_thread(render_chat, *args)
            return render_chat(*args)
        except ValueError as err:
            raise bad_request(str(err), param="messages") from None

    async def prepare_images(self, prompt_ids: list[int], images: list) -> dict:
        """The prompt with its images read (URLs fetched), checked and preprocessed, off the event loop
        (`LLMEngine.prepare`); 400 naming what is wrong."""
        llm_engine = self.ready_engine()
        try:
            return await asyncio.to_thread(llm_engine.prepare, {"prompt_token_ids": prompt_ids,
                                                                "multi_modal_data": {"image": images}})
        except ValueError as err:
            raise bad_request(str(err), param="messages") from None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer().decode(token_ids)

    def token_string(self, token_id: int) -> str:
        """The text of one token, as OpenAI's logprobs show it (cached)."""
        text = self._token_strings.get(token_id)
        if text is None:
            text = self.tokenizer().decode([token_id])
            if len(self._token_strings) < 200_000:
                self._token_strings[token_id] = text
        return text


def new_id(prefix: str, raw_request: Request) -> str:
    """The request's id: `{prefix}-{X-Request-Id header}` if the client sent one (as vLLM), else a random one."""
    return f"{prefix}-{raw_request.headers.get('x-request-id') or uuid.uuid4().hex}"


def data_parallel_rank(raw_request: Request) -> int | None:
    """vLLM's `X-data-parallel-rank` header: the replica a router pins the request to (None: the server picks)."""
    value = raw_request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"X-data-parallel-rank must be an integer, got {value!r}") from None


def now() -> int:
    return int(time.time())


def invalid(err: ValueError) -> APIError:
    message = str(err)
    return bad_request(message, param=param_of(message, SAMPLING_FIELDS))


def unavailable(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage of whole (final, not delta) outputs."""
    return usage_counts(sum(len(output.prompt_token_ids) for output in outputs),
                        sum(len(c.token_ids) for output in outputs for c in output.outputs),
                        sum(output.num_cached_tokens for output in outputs))


def usage_counts(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sorted_top(top: dict[int, float], limit: int | None = None) -> list[tuple[int, float]]:
    ranked = sorted(top.items(), key=lambda item: -item[1])
    return ranked if limit is None else ranked[:limit]


def request_failed(err: RequestFailed) -> APIError:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if err.status == 503 else None
    return APIError(err.status, str(err), code=err.code, headers=headers)


@contextlib.contextmanager
def engine_failures() -> Iterator[None]:
    """Maps a request the server had to end (engine crash: 500, shutdown: 503) to its HTTP error."""
    try:
        yield
    except RequestFailed as err:
        raise request_failed(err) from None


def stop_reason(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, str)) else str(value)

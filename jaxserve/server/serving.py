"""`ServingContext`: what every OpenAI route needs — the engine, the served model name, tokenization,
submitting with errors mapped to HTTP statuses, and the shared pieces of OpenAI's response shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator

from jaxserve.server.async_engine import (AsyncEngine, EngineUnavailable, RequestFailed, ServerOverloaded,
                                          Submission)
from jaxserve.chat import render_chat
from jaxserve.server.errors import APIError, bad_request, param_of

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
                   "tokens"}


class ServingContext:
    def __init__(self, engine: AsyncEngine, served_model_name: str | None = None):
        self.engine = engine
        self._served_model_name = served_model_name
        self._token_strings: dict[int, str] = {}

    # -- model and engine -----------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        if self._served_model_name:
            return self._served_model_name
        engine = self.engine.engine
        return engine.model.name if engine is not None else "jaxserve"

    def ready_engine(self) -> LLMEngine:
        try:
            return self.engine.ready_engine()
        except EngineUnavailable as err:
            raise unavailable(str(err)) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> Submission:
        """Queues the prompts; 400 for invalid input, 503 (+ Retry-After) when full or unavailable."""
        try:
            return self.engine.submit(request_id, prompts, params)
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

    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        tokenizer = self.tokenizer()
        if tokenizer.chat_template is None:
            raise bad_request("this model has no chat template: use /v1/completions", param="messages")
        try:
            if sum(len(m["content"]) for m in messages) > LARGE_TEXT_CHARS:
                return await asyncio.to_thread(render_chat, tokenizer, messages, add_generation_prompt)
            return render_chat(tokenizer, messages, add_generation_prompt)
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def invalid(err: ValueError) -> APIError:
    message = str(err)
    return bad_request(message, param=param_of(message, SAMPLING_FIELDS))


def unavailable(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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


class DeltaTracker:
    """What has been streamed per choice, to turn cumulative outputs into deltas."""

    def __init__(self):
        self.text_sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.finished: set[int] = set()

    def delta(self, choice: int, text: str, token_ids: list[int]) -> tuple[str, int]:
        """(new text, index of the first new token) since the last call for this choice."""
        text_start = self.text_sent.get(choice, 0)
        token_start = self.tokens_sent.get(choice, 0)
        self.text_sent[choice] = max(text_start, len(text))
        self.tokens_sent[choice] = len(token_ids)
        return text[text_start:], token_start


def stop_reason(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, str)) else str(value)

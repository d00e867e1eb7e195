"""Request models of the OpenAI-compatible API (pydantic, strict types) and their translation to `SamplingParams`.

Fields follow OpenAI's API, plus vLLM's extras in the body (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `priority`, `return_token_ids`, `ttft_slo_ms`, `tpot_slo_ms`, ...). Sampling fields a request leaves unset
take the model's generation-config defaults, as in vLLM. Types are strict: `"2"` is
not an integer and `true` is not a number. Unknown fields are ignored, as in vLLM, but fields that
ask for something this server cannot do (`logit_bias`, `suffix`, `best_of` > n) are refused rather than
silently dropped. Tools are planned in `tools.py`. Constrained decoding comes as OpenAI's `response_format` (`json_object`, `json_schema`)
or vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` / `structured_outputs`; a request
may name one constraint. Responses are plain dicts built by the
serving modules, in OpenAI's shapes.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict

from jaxserve.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

MAX_TEMPERATURE = 100.0
OPENAI_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (chat's is the rest of the context)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = False


class SamplingRequest(StrictModel):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int = 0  # lower is served earlier under --scheduling-policy priority
    ttft_slo_ms: float | None = None  # latency targets (default: the server's --ttft-slo-ms / --tpot-slo-ms)
    tpot_slo_ms: float | None = None
    return_token_ids: bool | None = False  # the prompt's and each choice's token ids in the answer
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (`engine/kv_connector.py`)
    # constrained decoding: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # accepted only in their no-op form
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raises ValueError for valid-looking fields this server does not implement or for inconsistent ones."""
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of is not supported (it must equal n)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The client's output-length limit (None if unset) and the field it came from."""
        raise NotImplementedError

    @property
    def least_max_tokens(self) -> int:
        """The smallest output-length limit the request may set."""
        return 1

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The request's output constraint, from whichever field names it; ValueError for two, or a malformed one."""
        found = []
        if self.response_format is not None:
            kind = self.response_format.get("type", "text")
            if kind == "json_object":
                found.append(("response_format", GuidedDecodingParams(json_object=True)))
            elif kind == "json_schema":
                spec = self.response_format.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                     "\"schema\": {...}}}")
                found.append(("response_format", GuidedDecodingParams(json=spec["schema"])))
            elif kind != "text":
                raise ValueError(f"response_format type {kind!r} is not supported ('text', 'json_object', "
                                 "'json_schema')")
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                found.append((field, GuidedDecodingParams(**{key: getattr(self, field)})))
        if self.structured_outputs is not None:
            known = {"json", "regex", "choice", "grammar", "json_object"}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise ValueError(f"structured_outputs has unsupported key {unknown[0]!r} (supported: {sorted(known)})")
            found.append(("structured_outputs", GuidedDecodingParams(**self.structured_outputs)))
        if len(found) > 1:
            raise ValueError(f"only one output constraint per request, got {[field for field, _ in found]}")
        return found[0][1] if found else None

    def max_tokens_for(self, prompt_lengths: list[int], max_model_len: int, defaults: Mapping[str, Any],
                       openai_default: int | None) -> int:
        """The request's limit if it sets one (checked against the context later); else, as vLLM, the smallest
        of the room left in the context, the model's generation-config default and OpenAI's default (if any)."""
        requested, field = self.requested_max_tokens()
        if requested is not None:
            if requested < self.least_max_tokens:
                raise ValueError(f"{field} must be an integer >= {self.least_max_tokens}, got {requested}")
            return requested
        room = max(1, max_model_len - max(prompt_lengths))
        return min(limit for limit in (room, defaults.get("max_tokens"), openai_default) if limit is not None)

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int,
                        defaults: Mapping[str, Any] | None = None,
                        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams; fields the request leaves unset take the model's generation-config
        `defaults`, else the neutral value. Raises ValueError naming the field for values out of range."""
        defaults = defaults or {}

        def pick(field: str, neutral: Any) -> Any:
            value = getattr(self, field)
            return value if value is not None else defaults.get(field, neutral)

        top_k = pick("top_k", 0)
        if top_k >= vocab_size:
            top_k = 0  # keeping the whole vocabulary is the same as no top-k
        return SamplingParams(
            n=self.n if self.n is not None else 1,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=top_k,
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty if self.presence_penalty is not None else 0.0,
            frequency_penalty=self.frequency_penalty if self.frequency_penalty is not None else 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens if self.min_tokens is not None else 0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens if self.skip_special_tokens is not None else True,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            output_kind=output_kind,
            guided_decoding=self.guided_decoding(),
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params is not None else None,
        )


class CompletionRequest(SamplingRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by `prompts()`
    max_tokens: int | None = None  # unset: OpenAI's 16 (OPENAI_MAX_TOKENS), within the context
    logprobs: int | None = None
    echo: bool | None = False  # the prompt before the completion (text, and with logprobs its tokens' logprobs)
    prompt_logprobs: int | None = None  # vLLM's extra: each choice's "prompt_logprobs" in vLLM's format
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true (use echo with logprobs)")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    @property
    def least_max_tokens(self) -> int:
        """0 with echo: the prompt is only scored (OpenAI's legacy API and vLLM)."""
        return 0 if self.echo else 1

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs: the top-k that echo with logprobs and the vLLM extra need."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings and token-id lists; raises ValueError if `prompt` has another shape."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(item, str) for item in prompt):
                return list(prompt)
            if all(_is_int(item) for item in prompt):
                return [list(prompt)]
            if all(isinstance(item, list) and all(_is_int(t) for t in item) for item in prompt):
                return [list(item) for item in prompt]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


class ChatCompletionRequest(SamplingRequest):
    messages: Any  # list of {"role", "content"}, checked by `chat_messages()`
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """`max_completion_tokens` (OpenAI's current name) or `max_tokens`, and which field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def chat_messages(self) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages as the template reads them, and their images (`normalize_messages`)."""
        return normalize_messages(self.messages)


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def normalize_messages(messages: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages as the chat template reads them (OpenAI's list-of-text-parts contents joined; contents with
    images as text and image parts) and their images in order (`chat.split_images`); ValueError if ill-formed."""
    from jaxserve.chat import split_images, validate_messages

    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    normalized = []
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("tool_calls"):
            message = {**message, "tool_calls": _template_tool_calls(message["tool_calls"], index)}
        normalized.append(message)
    normalized, images = split_images(normalized)
    validate_messages(normalized)
    kept = ("role", "content", "tool_calls", "tool_call_id", "name")
    # an assistant turn that only called tools renders with empty content (templates concatenate it as text)
    return [{key: m[key] for key in kept if key in m} | {"content": m["content"] or ""} for m in normalized], images


def _template_tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's OpenAI tool calls as chat templates read them: arguments as an object, not text."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    rendered = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{index}].tool_calls entries need a function with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"messages[{index}].tool_calls arguments are not JSON: {err}") from None
        rendered.append({**call, "function": {**function, "arguments": arguments}})
    return rendered


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

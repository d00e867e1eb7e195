"""`SamplingParams`: vLLM's per-request sampling options, names and meanings, validated on construction."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

MAX_LOGPROBS = 20  # top-k logprobs returned per token at most (vLLM's default max_logprobs)


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclasses.dataclass
class GuidedDecodingParams:
    """Constrained decoding (vLLM's names): exactly one of a JSON schema (`json`, a dict or its text), any JSON
    object (`json_object=True`), a `regex`, a `choice` of strings, or a `grammar` (Lark, as llguidance reads it;
    GBNF is converted). The output is guaranteed to match it, unless max_tokens or a stop cuts it first."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(kinds) != 1:
            raise ValueError(f"guided decoding takes exactly one of json, regex, choice, grammar, json_object; got "
                             f"{kinds or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"guided choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"guided {name} must be a string, got {type(value).__name__}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"guided json must be a JSON schema (an object or its text), got {type(self.json).__name__}")


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise `ValueError` naming the field.

    temperature: 0 = greedy. top_p in (0, 1]. top_k: 0 or -1 = off. min_p in [0, 1].
    repetition_penalty > 0 (1 = off, applies to prompt and output tokens); presence/frequency
    penalties in [-2, 2] (output tokens). seed: same seed -> same output, whatever the batch.
    guided_decoding: constrain the output to a JSON schema, regex, choice or grammar.
    stop: strings ending generation (excluded from the text). Stop strings, stop_token_ids and EOS
    are not checked before min_tokens outputs. logprobs: top-k logprobs per token. prompt_logprobs: the
    prompt's own logprobs (each prompt token's and the top k, `RequestOutput.prompt_logprobs`), computed in the
    prefill. max_tokens=0 generates nothing: the request only scores its prompt. output_kind:
    whether outputs are cumulative, deltas, or only the final one. ttft_slo_ms / tpot_slo_ms: the request's
    latency targets (time to first token; mean time per output token after it), in milliseconds, overriding the
    engine's --ttft-slo-ms / --tpot-slo-ms; counted for goodput under any policy, scheduled by under "slo".
    extra_args: vLLM's, for what an integration passes through (`kv_transfer_params`: prefill/decode
    disaggregation, `engine/kv_connector.py`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: GuidedDecodingParams | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field} {message}, got {getattr(self, field)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            fail("max_tokens", "must be an integer >= 0 (0: score the prompt only)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            fail("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            fail("guided_decoding", "must be a GuidedDecodingParams")
        for field in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                fail(field, "must be a number of milliseconds > 0")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            fail("extra_args", "must be a dict")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

"""What generation returns: vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`, plus per-request timing metrics.

Every output is a snapshot: its lists and metrics are copies that the engine never touches again,
so another thread may read them while the engine keeps stepping.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's: one token's log-probability at a position, its 1-based rank in that position's distribution (None
    where unknown) and its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token, then one dict per token


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One of the `n` completions of a request: everything so far, or (`RequestOutputKind.DELTA`) what is new
    since the request's previous output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: {token_id: logprob} of the top-k plus the sampled one
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when the request was first admitted
    # SamplingParams(prompt_logprobs=k): per prompt token, {token_id: Logprob} of that token and the top k given the
    # tokens before it (None for the first); set once the whole prompt is scored (a DELTA output: only the first)
    prompt_logprobs: PromptLogprobs | None = None
    # prefill/decode disaggregation (`engine/kv_connector.py`): where a prefill worker left the prompt's KV for the
    # decode worker (set on the final output of a request that asked `do_remote_decode` and ended by length)
    kv_transfer_params: dict | None = None

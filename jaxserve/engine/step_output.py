"""What a dispatched step hands back to the host loop: `InFlightStep` (its calls' results, still on the device, or
samplers waiting for token masks) and, once read, one `SampledToken` per output token."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxserve.engine.sequence import Sequence
from jaxserve.layers.sampler import SampleResult


@dataclasses.dataclass
class SampledToken:
    """The token a step sampled for one sequence, with its logprob and top logprobs when the sequence asked."""

    seq: Sequence
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # the top-k (k = params.logprobs) plus the sampled token
    accepted_draft: bool = False  # a draft a verify step accepted: its KV is in the cache (the step's last
    # token for the sequence is the one it sampled)


@dataclasses.dataclass
class PendingSample:
    """A forward whose sampler waits for constrained rows' token masks (`guided`: (row, sequence)), which need the
    previous step's tokens: the forward runs on the device while the host reads them (`ModelRunner.sample_pending`)."""

    logits: jax.Array
    slots: np.ndarray
    output_index: np.ndarray
    counted: np.ndarray
    guided: list[tuple[int, Sequence]]


@dataclasses.dataclass
class InFlightStep:
    """A dispatched plan: for each call, the (row, sequence) pairs whose sample is an output token, and the
    call's sampled tokens, still on the device."""

    calls: list[tuple[list[tuple[int, Sequence]], SampleResult | PendingSample]]
    num_draft: np.ndarray | None = None  # a verify call's (the last call): each row's drafts
    # prefill calls followed by a scoring step: their scored rows (row, sequence, prompt tokens), chunk starts, scores
    scores: list[tuple[list[tuple[int, Sequence, range]], np.ndarray, Any]] = dataclasses.field(default_factory=list)


def sampled_token(seq: Sequence, result: SampleResult, row) -> SampledToken:
    """A row's token with the logprobs its sequence asked for (`row`: an index, or (row, position) of a verify
    call's result)."""
    token = int(result.tokens[row])
    k = seq.params.logprobs
    top = {int(i): float(v) for i, v in zip(result.top_ids[row][:k], result.top_logprobs[row][:k])}
    logprob = float(result.logprobs[row])
    top[token] = logprob
    return SampledToken(seq, token, logprob, top)

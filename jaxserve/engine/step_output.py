"""What a dispatched step hands back to the host loop: `InFlightStep` (its calls' results, still on the device, or
samplers waiting for token masks) and, once read, one `SampledToken` per output token, by sequence id."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the host core reads this module without jax
    import jax

    from jaxserve.engine.sequence import Sequence
    from jaxserve.layers.sampler import SampleResult


class RowSequence(NamedTuple):
    """A call's row whose sample is an output token: its sequence and the top logprobs it asked for (None: none)."""

    row: int
    seq_id: int
    num_logprobs: int | None


@dataclasses.dataclass
class SampledToken:
    """The token a step sampled for one sequence, with its logprob and top logprobs when the sequence asked."""

    seq_id: int
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # the top-k (k = params.logprobs) plus the sampled token
    accepted_draft: bool = False  # a draft a verify step accepted: its KV is in the cache (the step's last
    # token for the sequence is the one it sampled)


class AppendedToken(NamedTuple):
    """A token `Scheduler.update_from_output` appended to its sequence: the sequence's output tokens with it, and
    whether it ended the sequence as an EOS or stop token (such a token has no text)."""

    seq: Sequence
    sample: SampledToken
    num_output_tokens: int
    stopped: bool


@dataclasses.dataclass
class PendingSample:
    """A forward whose sampler waits for its constrained rows' token masks, which need the previous step's tokens:
    the forward runs on the device while the host reads them (`ModelRunner.sample_pending`)."""

    logits: jax.Array
    slots: np.ndarray
    output_index: np.ndarray
    counted: np.ndarray
    guided: list[RowSequence]


@dataclasses.dataclass
class InFlightStep:
    """A dispatched plan: for each call, the rows whose sample is an output token, and the call's sampled tokens,
    still on the device."""

    calls: list[tuple[list[RowSequence], SampleResult | PendingSample]]
    num_draft: np.ndarray | None = None  # a verify call's (the last call): each row's drafts
    # prefill calls followed by a scoring step: their scored rows (row, seq id, top-k, prompt tokens), chunk starts
    # and scores
    scores: list[tuple[list[tuple[int, int, int, range]], np.ndarray, Any]] = dataclasses.field(default_factory=list)

    def pending(self) -> list[PendingSample]:
        """Its samplers still waiting for token masks."""
        return [result for _, result in self.calls if isinstance(result, PendingSample)]


def sampled_token(row: RowSequence, result: SampleResult, index) -> SampledToken:
    """A row's token with the logprobs its sequence asked for (`index`: the row, or (row, position) of a verify
    call's result)."""
    token = int(result.tokens[index])
    k = row.num_logprobs
    if k is None:
        return SampledToken(row.seq_id, token)
    top = {int(i): float(v) for i, v in zip(result.top_ids[index][:k], result.top_logprobs[index][:k])}
    logprob = float(result.logprobs[index])
    top[token] = logprob
    return SampledToken(row.seq_id, token, logprob, top)

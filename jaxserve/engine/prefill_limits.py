"""`PrefillLimits`: vLLM's chunked-prefill limits over one step's prefill work, under every scheduling policy.

- `long_prefill_token_threshold` (T > 0): no chunk has more than T tokens (taken as the largest prefill bucket
  within T, so no chunk is padded past it), and a sequence with more than T tokens left to compute is "long".
- `max_num_partial_prefills` (N > 1): at most N sequences get a prefill chunk in a step, each at most an equal
  share of the budget (`max_num_batched_tokens` over the prefills the step can take, as vLLM counts them);
  `max_long_partial_prefills` (L): a long waiting sequence is admitted only while fewer than L long ones are
  prefilling, so short prompts go past long ones. N = 1, the default, leaves the budget whole: each prefill takes
  what it can of what is left, and any number may share a step.
- A step's own threshold (the slo policy's when none is set, `SloPolicy.long_prefills`) is T for that step, with
  the policy's test of a short sequence: a sequence with more than T tokens left is long unless it is short, the
  step's long prefills share T tokens, and a short one's chunk is not capped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence as SequenceType

from jaxserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from jaxserve.engine.config import EngineConfig


class PrefillLimits:
    """The limits for one step; `candidates` is its prefill work in order (running prefills have a slot)."""

    def __init__(self, config: EngineConfig, candidates: SequenceType[Sequence], step_threshold: int | None = None,
                 short: Callable[[Sequence], bool] | None = None):
        self.threshold = threshold = config.long_prefill_token_threshold if step_threshold is None else step_threshold
        buckets = config.prefill_buckets
        within = [bucket for bucket in buckets if bucket <= threshold]
        self.cap = (max(within) if within else threshold) if threshold else config.max_num_batched_tokens
        self.long_tokens = math.inf if step_threshold is None else self.cap  # what long prefills may take together
        self.short = short
        self.budget = config.max_num_batched_tokens
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.num_long = sum(1 for seq in candidates if seq.slot is not None and self.is_long(seq))
        self.num_taken = 0
        self._share = None
        if self.max_partial > 1:
            count, longs = 0, self.num_long
            for seq in candidates:
                if count >= self.max_partial:
                    break
                if seq.slot is None and self.is_long(seq):
                    if longs >= self.max_long:
                        continue
                    longs += 1
                count += 1
            self._share = max(buckets[0], config.max_num_batched_tokens // max(1, count))

    def is_long(self, seq: Sequence) -> bool:
        return 0 < self.threshold < len(seq) - seq.num_computed_tokens and not (self.short and self.short(seq))

    def allows(self, seq: Sequence, admit: bool) -> bool:
        """Whether `seq` may have a chunk this step (`admit`: it is waiting)."""
        if self.max_partial == 1:
            return True
        if self.num_taken >= self.max_partial:
            return False
        return not (admit and self.is_long(seq) and self.num_long >= self.max_long)

    def chunk_cap(self, seq: Sequence) -> float:
        """The most tokens `seq`'s chunk may have (a long one: what the step's long prefills have left)."""
        if self.is_long(seq):
            return min(self.cap, self.long_tokens)
        return self.budget if self.short is not None else self.cap

    def share(self, available: float) -> float:
        """What one prefill may take of `available` tokens."""
        return available if self._share is None else min(available, self._share)

    def took(self, long: bool, admitted: bool, num_tokens: int) -> None:
        """A prefill got its chunk of `num_tokens` (`long`: it was long; `admitted`: newly admitted)."""
        self.num_taken += 1
        self.num_long += long and admitted
        if long:
            self.long_tokens -= num_tokens

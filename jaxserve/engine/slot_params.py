"""`SlotSamplingParams`: every decode slot's sampling parameters as numpy columns, written at admission.

The runner keeps a device copy of the columns (`table()`), sent again only after an admission changed them
(`changed`), so a sampler call sends just its rows' slots and output indices.
"""

from __future__ import annotations

import numpy as np

from jaxserve.layers.sampler import SamplingBatch
from jaxserve.sampling_params import SamplingParams


class SlotSamplingParams:
    """Each slot's sampling parameters as numpy columns, written at admission, gathered per step in O(batch)."""

    def __init__(self, slots: int):
        self.temperature = np.zeros(slots, np.float32)
        self.top_p = np.ones(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.min_p = np.zeros(slots, np.float32)
        self.repetition_penalty = np.ones(slots, np.float32)
        self.presence_penalty = np.zeros(slots, np.float32)
        self.frequency_penalty = np.zeros(slots, np.float32)
        self.seed = np.zeros(slots, np.uint32)
        self.min_tokens = np.zeros(slots, np.int32)
        self.wants_logprobs = np.zeros(slots, bool)
        self.plain = np.ones(slots, bool)  # greedy, no penalties, logprobs or grammar: the argmax is its token
        self.changed = True  # since the device copy was last sent

    def set(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.temperature[slot] = params.temperature
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        self.min_p[slot] = params.min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.seed[slot] = seed
        self.min_tokens[slot] = params.min_tokens
        self.wants_logprobs[slot] = params.logprobs is not None
        self.plain[slot] = (params.temperature == 0 and not params.uses_penalties and params.logprobs is None
                            and params.guided_decoding is None)
        self.changed = True

    def table(self) -> SamplingBatch:
        """Every slot's parameters (`[slots]` columns; output_index is per row and filled in by the sampler)."""
        self.changed = False
        return self.batch(np.arange(len(self.temperature)), np.zeros(len(self.temperature), np.int32))

    def batch(self, slots: np.ndarray, output_index: np.ndarray) -> SamplingBatch:
        return SamplingBatch(
            temperature=self.temperature[slots], top_p=self.top_p[slots], top_k=self.top_k[slots],
            min_p=self.min_p[slots], repetition_penalty=self.repetition_penalty[slots],
            presence_penalty=self.presence_penalty[slots], frequency_penalty=self.frequency_penalty[slots],
            seed=self.seed[slots], output_index=output_index, min_tokens=self.min_tokens[slots],
            wants_logprobs=self.wants_logprobs[slots])

    def is_plain_greedy(self, slots: np.ndarray, output_index: np.ndarray, rows: int) -> bool:
        """True when the first `rows` rows are plain greedy slots past their min_tokens: the forward's argmax is
        every row's token and the sampler need not run (penalty statistics are read only by other rows)."""
        slots, output_index = slots[:rows], output_index[:rows]
        return bool(self.plain[slots].all()) and not (output_index < self.min_tokens[slots]).any()

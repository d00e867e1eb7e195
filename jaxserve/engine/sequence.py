"""`Sequence`: the host-side state of one completion being generated (tokens, pages, slot, stop checks)."""

from __future__ import annotations

import enum
import itertools

from jaxserve.multimodal.inputs import MultiModalPrompt
from jaxserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_admission_counter = itertools.count()
_seq_ids = itertools.count()


class Sequence:
    """Token ids (prompt + output) and how many of them have KV in the cache (in the pages the scheduler's page
    managers hold for it: `PageManager.page_table`).

    `num_computed_tokens` tokens have K/V there; the next step feeds the rest (a prefill
    chunk) or, once only the last sampled token is left, one decode token. Under async scheduling the
    device may be `num_pending` tokens ahead of `token_ids`: sampled by dispatched steps whose results the
    host has not read yet. The device's view of the sequence is then `num_tokens` long.
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, arrival_time: float, priority: int = 0):
        self.seq_id = next(_seq_ids)  # unique in the process, unlike request ids, which may be reused
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_output_tokens = params.max_tokens if params.max_tokens is not None else 1 << 62
        self.seed = seed
        self.arrival_time = arrival_time
        self.priority = priority
        # latency targets in seconds (None: none), and when its first output token was read (`engine/slo.py`)
        self.ttft_slo: float | None = None
        self.tpot_slo: float | None = None
        self.first_token_time: float | None = None
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens sampled on the device that token_ids does not hold yet
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the last admission
        self.num_prompt_cached_tokens = -1  # ... at the first admission (what usage reports); -1 before it
        self.num_scored = 0  # prompt_logprobs: prompt tokens 1..num_scored are scored by dispatched prefills
        self.slot: int | None = None
        # LoRA: its adapter (`lora.cache.LoadedAdapter`; None: the base model) and, while running, its device slot
        self.lora = None
        self.lora_slot: int | None = None
        self.num_lookahead = 0  # speculative decoding: draft tokens the scheduler made room for this step
        self.rope_by_length = False  # its tokens rotate by a length past the rope's threshold (`layers/rotary.py`)
        self.grammar = None  # constrained decoding: the sequence's llguidance matcher, advanced token by token
        self.mm: MultiModalPrompt | None = None  # its prompt's images (None: text)
        self.received = None  # a decode worker's `ReceivedKV`: its prompt's KV pulled, for its next admission
        self._prompt_keys: list[int] | None = None  # the prompt's prefix-cache keys where images make them differ
        self.admission_order = -1
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}#{self.index}, {self.status.value}, {len(self)} tokens)"

    @property
    def prefix_root(self) -> bytes:
        """The parent key of its first prefix-cache page: b"" for the base model, its adapter's own otherwise."""
        return b"" if self.lora is None else self.lora.prefix_root

    def set_images(self, mm: MultiModalPrompt) -> None:
        self.mm = mm
        self._prompt_keys = mm.key_token_ids(self.token_ids[:self.num_prompt_tokens])

    def chunk_tokens(self, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` from `start` a prefill chunk may take: fewer when it would split an image that is
        prefilled whole (`MultiModalPrompt.chunk_stop`)."""
        return num_tokens if self.mm is None else self.mm.chunk_stop(start, start + num_tokens) - start

    def key_tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids `start .. stop` as the prefix cache keys and matches them: an image's placeholder tokens as
        keys of the image (`MultiModalPrompt.key_token_ids`), so pages holding different images never match."""
        if self._prompt_keys is None or start >= self.num_prompt_tokens:
            return tuple(self.token_ids[start:stop])
        return tuple(self._prompt_keys[start:stop]) + tuple(self.token_ids[max(start, self.num_prompt_tokens):stop])

    @property
    def key_token_ids(self) -> list[int]:
        """Every token as `key_tokens` gives it (O(length): for a lookup, not per step)."""
        return list(self.token_ids) if self._prompt_keys is None else list(self.key_tokens(0, len(self.token_ids)))

    @property
    def num_tokens(self) -> int:
        """Tokens the device's view of the sequence has: the host's plus the pending ones."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last sampled token still lacks K/V (a prompt, or a recompute)."""
        num_tokens = len(self.token_ids) + self.num_pending
        return self.num_computed_tokens < num_tokens - 1 or num_tokens == self.num_prompt_tokens

    def at_length_limit(self, max_model_len: int, with_pending: bool = False) -> bool:
        """True once the sequence has every token it may have (max_tokens, or max_model_len in all). With
        `with_pending`, tokens sampled on the device that the host has not read yet count too."""
        length = len(self.token_ids) + (self.num_pending if with_pending else 0)
        return length >= max_model_len or length - self.num_prompt_tokens >= self.max_output_tokens

    @property
    def scores_prompt(self) -> bool:
        """True while the sequence's prefill still has prompt tokens to score (prompt_logprobs, computed by a
        request's first completion): it then computes its whole prompt, never taking cached prefix pages."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and self.num_scored < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def mark_admitted(self) -> None:
        self.status = SequenceStatus.RUNNING
        if self.num_prompt_cached_tokens < 0:
            self.num_prompt_cached_tokens = min(self.num_cached_tokens, self.num_prompt_tokens)
        self.admission_order = next(_admission_counter)

    def rotates_by_length(self, rule: tuple[str, int] | None) -> bool:
        """Whether, admitted now, it rotates by a length past the rope's threshold (`rule`: the model's
        `rope_length_rule`, `layers/rotary.py`): its prompt's (dynamic NTK) or its whole length (LongRoPE)."""
        if rule is None:
            return False
        return (len(self) if rule[0] == "sequence" else self.num_prompt_tokens) > rule[1]

    def outgrows_rope(self, rule: tuple[str, int] | None) -> bool:
        """LongRoPE: whether its next decode would take it, computed rotated short, past the threshold."""
        return rule is not None and rule[0] == "sequence" and not self.rope_by_length and self.num_tokens > rule[1]

    def cut_output(self, num_output_tokens: int) -> int:
        """Drops the output tokens past its first `num_output_tokens` (a stop string found late ends there) and
        their logprobs; returns how many were dropped. The caller finishes the sequence next."""
        extra = self.num_output_tokens - num_output_tokens
        if extra <= 0:
            return 0
        if self.logprobs is not None:  # those of the dropped tokens that have theirs
            first = self.num_prompt_tokens + num_output_tokens
            for token, top in zip(self.token_ids[first:], self.logprobs[num_output_tokens:]):
                self.cumulative_logprob -= top[token]
            del self.logprobs[num_output_tokens:]
        del self.token_ids[-extra:]
        return extra

"""`InputBatch`: the runner's persistent per-slot batch (vLLM's `InputBatch`). For every decode slot it holds the
sequence there as the runner knows it from the scheduler's plain outputs (its tokens as far as a step has read
them, prompt length and page table in each KV cache group, on the host), its sampling parameters as columns
(`SlotSamplingParams`, with a device copy, `sampling_table`), and the device state the jitted steps read and
donate: each slot's latest token and page tables (`SlotState`) and its penalty statistics (`PenaltyState`).

`apply(scheduler_output)` takes one `SchedulerOutput` as a diff: sequences that left, then those admitted (their
rows written whole), then what scheduled running sequences gained. The step inputs are built from these rows
(`engine/step_inputs.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.engine.allocator import Allocator
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.scheduler_output import NewSequence, SchedulerOutput
from jaxserve.engine.steps import BatchFields, SlotState
from jaxserve.layers.sampler import PenaltyState, SamplingBatch
from jaxserve.multimodal.inputs import MultiModalPrompt
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


class InputBatch:
    """Host rows and device state of every slot; `sharding`: where the device state lives (replicated)."""

    def __init__(self, config: EngineConfig, vocab_size: int, sharding, allocator: Allocator, groups: int = 1,
                 mrope: bool = False):
        slots = config.max_num_seqs
        self.slot_of: dict[int, int] = {}  # seq id -> its slot
        self.seq_ids = np.full(slots, -1, np.int64)
        self.token_ids: list[list[int]] = [[] for _ in range(slots)]  # what the host has read of each sequence
        self.num_prompt_tokens = np.zeros(slots, np.int32)
        # each KV cache group's page tables (`engine/kv_plan.py`); group 0's hold num_pages pages
        self.page_tables = np.zeros((groups, slots, config.pages_per_seq), np.int32)
        self.num_pages = np.zeros(slots, np.int32)
        self.num_logprobs = np.full(slots, -1, np.int32)  # -1: the sequence asked for none
        self.num_prompt_logprobs = np.zeros(slots, np.int32)
        self.guided = np.zeros(slots, bool)  # constrained decoding: the sampler waits for a token mask
        # LoRA: each slot's adapter slot in the device stack (-1: the base model); None without enable_lora
        self.lora_slots = np.full(slots, -1, np.int32) if config.enable_lora else None
        # state checkpoints (a hybrid model under prefix caching): the steps read and save them (the runner's plan)
        self.state_checkpoints = False
        # images: each slot's prompt images (None: text), and under M-RoPE the shift of its positions after its prompt
        self.mm: list[MultiModalPrompt | None] = [None] * slots
        self.mrope = mrope
        self.rope_deltas = np.zeros(slots, np.int32)
        self.sampling = SlotSamplingParams(slots)
        self.slot_state = SlotState.empty(slots, config.pages_per_seq, sharding, allocator, groups)
        self.penalties = PenaltyState(prompt_mask=allocator.full((slots, vocab_size), bool, sharding),
                                      output_counts=allocator.full((slots, vocab_size), jnp.int32, sharding),
                                      min_tokens_ban=allocator.full((slots, vocab_size), bool, sharding))
        self.sampling_table = None  # the device copy of `sampling`'s columns (the runner sends it)

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Applies a scheduler output's diff to the rows: left, admitted, then what running sequences gained."""
        for seq_id in scheduler_output.left_seq_ids:
            slot = self.slot_of.pop(seq_id, None)
            if slot is not None and self.seq_ids[slot] == seq_id:
                self.seq_ids[slot] = -1
                self.token_ids[slot] = []
                self.mm[slot] = None
        for new in scheduler_output.new_seqs:
            self._add(new)
        for cached in scheduler_output.cached_seqs:
            slot = self.slot_of[cached.seq_id]
            self.token_ids[slot] += cached.new_token_ids
            if cached.page_ids or cached.first_page != self.num_pages[slot]:  # most steps: a token, no page
                self._set_pages(slot, cached.first_page, cached.page_ids)
            for group, change in enumerate(cached.window_tables, 1):
                if change is not None:
                    self._set_table(group, slot, *change)

    def _add(self, new: NewSequence) -> None:
        slot, params = new.slot, new.params
        self.slot_of[new.seq_id] = slot
        self.seq_ids[slot] = new.seq_id
        self.token_ids[slot] = list(new.token_ids)
        self.num_prompt_tokens[slot] = new.num_prompt_tokens
        self._set_pages(slot, 0, new.page_ids)
        for group, table in enumerate(new.window_tables, 1):
            self._set_table(group, slot, *table)
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[slot] = params.prompt_logprobs or 0
        self.guided[slot] = params.guided_decoding is not None
        if self.lora_slots is not None:
            self.lora_slots[slot] = new.lora_slot
        self.mm[slot] = new.mm
        self.rope_deltas[slot] = new.mm.mrope_delta if new.mm is not None else 0
        self.sampling.set(slot, params, new.seed)

    def _set_pages(self, slot: int, first: int, page_ids: tuple[int, ...]) -> None:
        self.num_pages[slot] = self._set_table(0, slot, first, page_ids)

    def _set_table(self, group: int, slot: int, first: int, page_ids: tuple[int, ...]) -> int:
        """A group's table of `slot` from index `first` on (scratch pages after); returns its length."""
        end = first + len(page_ids)
        self.page_tables[group, slot, first:end] = page_ids
        self.page_tables[group, slot, end:] = 0
        return end

    @property
    def fields(self) -> BatchFields:
        """The optional inputs this runner's batches have."""
        return BatchFields(groups=self.page_tables.shape[0], lora=self.lora_slots is not None,
                           checkpoints=self.state_checkpoints, mrope=self.mrope)

    def mrope_positions(self, slot: int, start: int, num_tokens: int) -> np.ndarray:
        """M-RoPE positions `[3, num_tokens]` of the slot's tokens from `start`: its prompt's own (`MultiModalPrompt`),
        then position + delta; a text prompt's are its positions."""
        positions = np.broadcast_to(np.arange(start, start + num_tokens, dtype=np.int32) + self.rope_deltas[slot],
                                    (3, num_tokens)).copy()
        mm = self.mm[slot]
        if mm is not None and mm.mrope_positions is not None and start < mm.mrope_positions.shape[1]:
            known = mm.mrope_positions[:, start:start + num_tokens]
            positions[:, :known.shape[1]] = known
        return positions

    def logprobs_of(self, slot: int) -> int | None:
        """The top logprobs a slot's sequence asked for (None: no logprobs)."""
        k = int(self.num_logprobs[slot])
        return None if k < 0 else k

"""`SchedulerOutput`: what the scheduler hands the runner for one step, as plain data (ids, token ids, page ids,
sampling parameters, counts; no engine objects), after vLLM v1's `NewRequestData` / `CachedRequestData`.

The runner keeps a persistent per-slot batch (`engine/input_batch.py`) and applies each output to it as a diff:
sequences that left their slots since the last step (finished or preempted), sequences admitted into a slot (every
token the host has, their page table, their sampling parameters), and for each running sequence scheduled again the
pages it got or lost since it was last scheduled and, where the step reads them, the tokens the host read. Then
come the step's work items: pages to restore from the KV tiers, prefill chunks and decodes by sequence id.

`Plan` and `PrefillChunk` are the same step as the scheduler builds it, over its sequences, before it is handed on.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

from jaxserve.engine.kv_connector import Receive
from jaxserve.engine.kv_tiers import TierPage
from jaxserve.engine.sequence import Sequence
from jaxserve.lora.slots import LoadedAdapter
from jaxserve.multimodal.inputs import MultiModalPrompt
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramDrafter


class NewSequence(NamedTuple):
    """A sequence admitted into `slot` this step (or re-admitted after preemption: its outputs so far included)."""

    seq_id: int
    request_id: str
    slot: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    page_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    # each sliding-window KV cache group's table, (0, page ids) (scratch: released); () without such groups
    window_tables: tuple[tuple[int, tuple[int, ...]], ...] = ()
    lora_slot: int = -1  # LoRA: its adapter's slot in the device stack (-1: the base model)
    mm: MultiModalPrompt | None = None  # its prompt's images (None: text)


class CachedSequence(NamedTuple):
    """A running sequence's changes since it was last scheduled: tokens the host read, and its page table from index
    `first_page` on (pages added, or trimmed and added again)."""

    seq_id: int
    new_token_ids: tuple[int, ...]
    first_page: int
    page_ids: tuple[int, ...]
    # each sliding-window KV cache group's table from an index on, (first, page ids), or None: unchanged
    window_tables: tuple[tuple[int, tuple[int, ...]] | None, ...] = ()


class ScheduledChunk(NamedTuple):
    """`num_tokens` of a sequence's tokens from `start` get their KV; a final chunk reaches its last token, so its
    sample is the next output token. `scored`: the prompt tokens it scores for prompt_logprobs (position p predicts
    token p + 1)."""

    seq_id: int
    start: int
    num_tokens: int
    is_final: bool
    scored: range
    state_source: int = -1  # a hybrid model's prefix hit: the state checkpoint it starts from (-1: none)
    state_saves: tuple[tuple[int, int], ...] = ()  # (position, checkpoint) where it saves its state


class ScheduledDecode(NamedTuple):
    """One decode token: the sequence's latest token (at `position`, perhaps still on the device) gets its KV and the
    next one is sampled. Under speculative decoding, `num_draft` drafts are verified with it: n-gram proposals in
    `draft_token_ids`, or that many a draft model proposes on the device (`draft_token_ids` empty)."""

    seq_id: int
    position: int
    num_draft: int = 0
    draft_token_ids: tuple[int, ...] = ()
    state_save: int = -1  # a hybrid model under prefix caching: the checkpoint its state goes to (-1: none)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    left_seq_ids: tuple[int, ...]  # left their slots since the last output (finished or preempted)
    new_seqs: tuple[NewSequence, ...]
    cached_seqs: tuple[CachedSequence, ...]
    prefills: tuple[ScheduledChunk, ...]
    decodes: tuple[ScheduledDecode, ...]
    # KV tiers: pages to copy into the pool before the step's forwards, (device page, tier page)
    restores: tuple[tuple[int, TierPage], ...] = ()
    # LoRA: adapters to write into device slots before the step's forwards, (slot, adapter)
    lora_loads: tuple[tuple[int, LoadedAdapter], ...] = ()
    encoder_frees: tuple[str, ...] = ()  # images whose embeddings the runner drops (`EncoderCacheManager`)
    receives: tuple[Receive, ...] = ()  # prefill/decode disaggregation: pulled pages to write before the forwards

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Sent(NamedTuple):
    """What the runner has of a sequence in a slot (the scheduler's record of it): its first `num_tokens` tokens,
    and its page table's first `num_pages` pages as they were when sent, of which the first `num_kept_pages` are
    still the sequence's (a trim lowers it)."""

    num_tokens: int
    num_pages: int
    num_kept_pages: int


def new_sequence(seq: Sequence, page_table: list[int], window_tables: tuple = ()) -> tuple[NewSequence, Sent]:
    """`seq` as admitted, with its page table and its window groups' tables (`PageManager.tables`), and what the
    runner has of it from now on."""
    new = NewSequence(seq.seq_id, seq.request_id, seq.slot, tuple(seq.token_ids), seq.num_prompt_tokens,
                      tuple(page_table), seq.params, seq.seed, window_tables,
                      -1 if seq.lora_slot is None else seq.lora_slot, seq.mm)
    return new, Sent(len(seq.token_ids), len(page_table), len(page_table))


def cached_sequence(seq: Sequence, sent: Sent, with_tokens: bool, page_table: list[int],
                    window_tables: tuple = ()) -> tuple[CachedSequence, Sent] | None:
    """What the runner lacks of a running `seq` that it has `sent` of (None: nothing), and what it has then: its
    pages always, the tokens the host read only `with_tokens` (a step that reads them: a prefill chunk, or a
    verify's latest tokens; a plain decode reads its input token on the device, so its row's tokens may lag until
    then). `page_table`: its pages now; `window_tables`: what changed in its window groups' tables
    (`PageManager.tables`)."""
    num_pages = len(page_table)
    pages_changed, first_page = _table_diff(num_pages, sent.num_pages, sent.num_kept_pages)
    window_changed = bool(window_tables) and any(change is not None for change in window_tables)
    tokens_changed = with_tokens and sent.num_tokens != len(seq.token_ids)
    if not (pages_changed or window_changed or tokens_changed):
        return None
    tokens = tuple(seq.token_ids[sent.num_tokens:]) if tokens_changed else ()
    cached = CachedSequence(seq.seq_id, tokens, first_page, tuple(page_table[first_page:]),
                            window_tables if window_changed else ())
    return cached, Sent(sent.num_tokens + len(tokens), num_pages, num_pages)


def scheduler_output(plan: "Plan", left: tuple[int, ...], decodes: tuple[ScheduledDecode, ...],
                     sent: dict[int, Sent], tables: Callable) -> tuple[SchedulerOutput, dict[int, Sent]]:
    """`plan` as plain data for the runner, with `left` (the sequences that left their slots) and the step's
    `decodes` (`scheduled_decodes`), given what the runner has of each sequence (`sent`, the scheduler's record);
    and that record's new entries. `tables(seq, new)`: its page table and its window groups' changes
    (`PageManager.tables`)."""
    updates: dict[int, Sent] = {}
    new = []
    for seq in plan.admitted:
        admission, updates[seq.seq_id] = new_sequence(seq, *tables(seq, True))
        new.append(admission)
    cached = []
    for seqs, with_tokens in (([chunk.seq for chunk in plan.prefills if chunk.seq.seq_id not in updates], True),
                              (plan.decodes, any(decode.num_draft for decode in decodes))):
        for seq in seqs:
            change = cached_sequence(seq, sent[seq.seq_id], with_tokens, *tables(seq, False))
            if change is not None:
                cached.append(change[0])
                updates[seq.seq_id] = change[1]
    chunks = tuple(ScheduledChunk(c.seq.seq_id, c.start, c.num_tokens, c.is_final, c.scored, c.state_source,
                                  c.state_saves) for c in plan.prefills)
    return SchedulerOutput(left, tuple(new), tuple(cached), chunks, decodes, tuple(plan.restores),
                           tuple(plan.lora_loads), plan.encoder_frees, tuple(plan.receives)), updates


def _table_diff(num_pages: int, sent_pages: int, kept_pages: int) -> tuple[bool, int]:
    """Whether a page table changed since it was sent (pages added, or trimmed), and the index it changed from."""
    changed = kept_pages < sent_pages or sent_pages != num_pages
    return changed, (min(kept_pages, sent_pages) if changed else num_pages)


def scheduled_decodes(seqs: list[Sequence], spec: SpeculativeConfig | None,
                      drafter: NgramDrafter | None = None) -> tuple[ScheduledDecode, ...]:
    """The step's decodes; with drafts to verify when some row has room for them (`num_lookahead`) and none is
    constrained (the verify sampler applies no token mask): the n-gram `drafter`'s proposals from each sequence's
    tokens (speculative steps are synchronous, so the host has them all), or a draft model's count."""
    if spec is None or not any(seq.num_lookahead for seq in seqs) or any(seq.grammar is not None for seq in seqs):
        return tuple(ScheduledDecode(seq.seq_id, len(seq.token_ids) + seq.num_pending - 1) for seq in seqs)
    if spec.method != "ngram":
        return tuple(ScheduledDecode(seq.seq_id, seq.num_tokens - 1, seq.num_lookahead) for seq in seqs)
    drafts = [drafter.propose(seq.seq_id, seq.token_ids, seq.num_lookahead) if seq.num_lookahead else ()
              for seq in seqs]
    if not any(drafts):
        return tuple(ScheduledDecode(seq.seq_id, seq.num_tokens - 1) for seq in seqs)
    return tuple(ScheduledDecode(seq.seq_id, seq.num_tokens - 1, len(draft), draft)
                 for seq, draft in zip(seqs, drafts))


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    num_tokens: int
    state_source: int = -1
    state_saves: tuple[tuple[int, int], ...] = ()

    @property
    def is_final(self) -> bool:
        """True when the chunk reaches the sequence's last token, so its sample is the next output token."""
        return self.start + self.num_tokens == len(self.seq)

    @property
    def scored(self) -> range:
        """The prompt tokens this chunk scores for prompt_logprobs (empty: none): position p predicts token p + 1,
        so the chunk's last position predicts the next chunk's first token."""
        seq = self.seq
        if not seq.scores_prompt:
            return range(0)
        return range(seq.num_scored + 1, min(self.start + self.num_tokens, seq.num_prompt_tokens - 1) + 1)


@dataclasses.dataclass
class Plan:
    """A step as the scheduler builds it, over its sequences (handed on as a plain `SchedulerOutput`)."""

    prefills: list[PrefillChunk]
    decodes: list[Sequence]
    admitted: list[Sequence]
    restores: list[tuple[int, TierPage]] = dataclasses.field(default_factory=list)  # (device page, tier page)
    receives: list[Receive] = dataclasses.field(default_factory=list)  # pulled pages (`kv_connector.py`)
    lora_loads: list[tuple[int, LoadedAdapter]] = dataclasses.field(default_factory=list)  # (slot, adapter)
    encoder_frees: tuple[str, ...] = ()

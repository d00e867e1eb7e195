"""Host-side step inputs: a scheduler plan's chunks and decodes as padded numpy arrays of the compiled shapes, each
call's device inputs one pytree (`engine/steps.py`) next to what only the host reads (its sequences).

Prefill chunks sharing a length bucket are packed `PREFILL_ROWS` to a call (a call that holds a chunk scoring its
prompt tokens runs the scoring prefill); decodes form one batch padded to a batch bucket. Rows past the real ones are empty (zero tokens, page table of scratch
pages), so they write only to the scratch page and their outputs are ignored.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxserve.engine.config import PREFILL_ROWS, EngineConfig
from jaxserve.engine.scheduler import PrefillChunk
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.steps import DecodeBatch, PrefillBatch, VerifyBatch


def bucket_for(size: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class PrefillInputs:
    """One prefill call: `rows` chunks of up to `tokens` tokens each."""

    chunks: list[PrefillChunk]
    batch: PrefillBatch
    output_index: np.ndarray  # int32 [rows]: output tokens each row's sequence has so far
    scored: list[tuple[int, Sequence, range]]  # (row, sequence, the prompt tokens the row scores) for prompt_logprobs


@dataclasses.dataclass
class DecodeInputs:
    """One decode call: the last token of each of `rows` sequences (padded to a batch bucket)."""

    seqs: list[Sequence]
    batch: DecodeBatch
    output_index: np.ndarray  # int32 [rows]: the output index of the token each row samples


def prefill_groups(chunks: list[PrefillChunk], config: EngineConfig) -> list[tuple[int, list[PrefillChunk]]]:
    """(token bucket, chunks) per prefill call: chunks sharing a bucket are packed PREFILL_ROWS at a time."""
    by_bucket: dict[int, list[PrefillChunk]] = {}
    for chunk in chunks:
        by_bucket.setdefault(bucket_for(chunk.num_tokens, config.prefill_buckets), []).append(chunk)
    groups = []
    for tokens, members in by_bucket.items():
        if (PREFILL_ROWS, tokens) not in config.prefill_shapes:
            groups += [(tokens, [chunk]) for chunk in members]
            continue
        while len(members) >= PREFILL_ROWS - 1:  # three share a call too: one empty row beats a second call
            groups.append((tokens, members[:PREFILL_ROWS]))
            members = members[PREFILL_ROWS:]
        groups += [(tokens, [chunk]) for chunk in members]
    return groups


def prefill_inputs(tokens: int, chunks: list[PrefillChunk], pages_per_seq: int) -> PrefillInputs:
    rows = 1 if len(chunks) == 1 else PREFILL_ROWS
    batch = empty_prefill(rows, tokens, pages_per_seq)
    inputs = PrefillInputs(chunks, batch, np.zeros(rows, np.int32), [])
    for row, chunk in enumerate(chunks):
        seq = chunk.seq
        batch.slots[row] = seq.slot
        batch.token_ids[row, :chunk.num_tokens] = seq.token_ids[chunk.start:chunk.start + chunk.num_tokens]
        batch.starts[row] = chunk.start
        batch.num_tokens[row] = chunk.num_tokens
        batch.page_tables[row, :len(seq.page_table)] = seq.page_table
        inputs.output_index[row] = seq.num_output_tokens
        batch.is_final[row] = chunk.is_final
        if not chunk.is_final:
            batch.next_tokens[row] = seq.token_ids[chunk.start + chunk.num_tokens]
        if chunk.scored:
            inputs.scored.append((row, seq, chunk.scored))
    return inputs


def empty_prefill(rows: int, tokens: int, pages_per_seq: int) -> PrefillBatch:
    """A prefill call of empty rows (zero tokens: they write only to the scratch page)."""
    zeros = functools.partial(np.zeros, rows, np.int32)
    return PrefillBatch(token_ids=np.zeros((rows, tokens), np.int32), starts=zeros(), num_tokens=zeros(),
                        page_tables=np.zeros((rows, pages_per_seq), np.int32), slots=zeros(),
                        is_final=np.zeros(rows, bool), next_tokens=zeros())


def decode_inputs(seqs: list[Sequence], config: EngineConfig) -> DecodeInputs:
    """O(rows) host work: the device holds every slot's page table and latest token."""
    rows = bucket_for(len(seqs), config.decode_batch_buckets)
    page_size = config.page_size
    columns = np.zeros((rows, 4), np.int32)  # slot, position, page, output index (of the token the row samples)
    if seqs:
        columns[:len(seqs)] = [(seq.slot, (last := seq.num_tokens - 1), seq.page_table[last // page_size],
                                last + 1 - seq.num_prompt_tokens) for seq in seqs]
    slots, positions, pages, output_index = columns.T.copy()
    active = np.zeros(rows, bool)
    active[:len(seqs)] = True
    return DecodeInputs(seqs, DecodeBatch(slots, positions, pages, active), output_index)


@dataclasses.dataclass
class VerifyInputs:
    """One verify call (speculative decoding): each of `rows` sequences' latest token and up to K drafts."""

    seqs: list[Sequence]
    batch: VerifyBatch  # its draft_tokens: the n-gram proposals; zeros for a draft model's (made on the device)
    last_tokens: np.ndarray  # int32 [rows, 2]: each row's two latest tokens (what a draft model feeds first)
    output_index: np.ndarray  # int32 [rows]


def verify_inputs(seqs: list[Sequence], drafts: list[list[int]] | None, config: EngineConfig,
                  k: int) -> VerifyInputs:
    """O(rows * K) host work. `drafts`: the n-gram proposals (None: a draft model proposes on the device, up to
    each sequence's lookahead). Needs the sequences' tokens on the host (speculative steps are synchronous)."""
    rows = bucket_for(len(seqs), config.decode_batch_buckets)
    page_size = config.page_size
    batch = VerifyBatch(slots=np.zeros(rows, np.int32), positions=np.zeros(rows, np.int32),
                        draft_tokens=np.zeros((rows, k), np.int32), num_draft=np.zeros(rows, np.int32),
                        pages=np.zeros((rows, k + 1), np.int32), active=np.zeros(rows, bool))
    inputs = VerifyInputs(seqs, batch, np.zeros((rows, 2), np.int32), np.zeros(rows, np.int32))
    for row, seq in enumerate(seqs):
        position = len(seq.token_ids) - 1
        batch.slots[row] = seq.slot
        batch.positions[row] = position
        if drafts is None:
            batch.num_draft[row] = seq.num_lookahead
        else:
            draft = drafts[row][:seq.num_lookahead]
            batch.draft_tokens[row, :len(draft)] = draft
            batch.num_draft[row] = len(draft)
        for i in range(k + 1):
            index = (position + i) // page_size
            if index < len(seq.page_table):
                batch.pages[row, i] = seq.page_table[index]
        inputs.last_tokens[row] = seq.token_ids[-2:]
        inputs.output_index[row] = seq.num_output_tokens
    batch.active[:len(seqs)] = True
    return inputs

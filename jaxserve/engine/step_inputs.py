"""Host-side step inputs: a scheduler plan's chunks and decodes, read off the runner's per-slot rows
(`InputBatch`), as padded numpy arrays of the compiled shapes; each call's device inputs one pytree
(`engine/steps.py`) next to what only the host reads (each row's sequence id and logprobs count).

Prefill chunks sharing a length bucket are packed `PREFILL_ROWS` to a call (a call that holds a chunk scoring its
prompt tokens runs the scoring prefill); decodes form one batch padded to a batch bucket. Rows past the real ones are empty (zero tokens, page table of scratch
pages), so they write only to the scratch page and their outputs are ignored.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxserve.engine.buckets import bucket_for
from jaxserve.engine.config import PREFILL_ROWS, EngineConfig
from jaxserve.engine.input_batch import InputBatch
from jaxserve.engine.scheduler_output import ScheduledChunk, ScheduledDecode
from jaxserve.engine.step_output import RowSequence
from jaxserve.engine.steps import BatchFields, DecodeBatch, PrefillBatch, VerifyBatch
from jaxserve.layers.gated_deltanet import CHUNK_TOKENS, save_blocks


@dataclasses.dataclass
class PrefillInputs:
    """One prefill call: `rows` chunks of up to `tokens` tokens each."""

    chunks: list[ScheduledChunk]
    batch: PrefillBatch
    output_index: np.ndarray  # int32 [rows]: output tokens each row's sequence has so far
    sampled: list[RowSequence]  # the rows of final chunks: their sample is an output token
    guided: list[RowSequence]  # those of them that are constrained
    scored: list[tuple[int, int, int, range]]  # prompt_logprobs: (row, seq id, top-k, the prompt tokens it scores)


@dataclasses.dataclass
class DecodeInputs:
    """One decode call: the last token of each of `rows` sequences (padded to a batch bucket)."""

    rows: list[RowSequence]
    guided: list[RowSequence]
    batch: DecodeBatch
    output_index: np.ndarray  # int32 [rows]: the output index of the token each row samples


def prefill_groups(chunks: tuple[ScheduledChunk, ...],
                   config: EngineConfig) -> list[tuple[int, list[ScheduledChunk]]]:
    """(token bucket, chunks) per prefill call: chunks sharing a bucket are packed PREFILL_ROWS at a time."""
    by_bucket: dict[int, list[ScheduledChunk]] = {}
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


def prefill_inputs(rows_of: InputBatch, tokens: int, chunks: list[ScheduledChunk],
                   rope_by_sequence: bool = False) -> PrefillInputs:
    """One prefill call of `chunks`; `rope_by_sequence`: the tokens rotate by the sequence's length (LongRoPE),
    else by the prompt's (`layers/rotary.py`)."""
    rows = 1 if len(chunks) == 1 else PREFILL_ROWS
    batch = empty_prefill(rows, tokens, rows_of.page_tables.shape[2], rows_of.fields)
    inputs = PrefillInputs(chunks, batch, np.zeros(rows, np.int32), [], [], [])
    for row, chunk in enumerate(chunks):
        slot = rows_of.slot_of[chunk.seq_id]
        token_ids = rows_of.token_ids[slot]
        batch.slots[row] = slot
        batch.token_ids[row, :chunk.num_tokens] = token_ids[chunk.start:chunk.start + chunk.num_tokens]
        batch.starts[row] = chunk.start
        batch.num_tokens[row] = chunk.num_tokens
        batch.page_tables[:, row] = rows_of.page_tables[:, slot]
        inputs.output_index[row] = len(token_ids) - rows_of.num_prompt_tokens[slot]
        batch.is_final[row] = chunk.is_final
        batch.rope_lens[row] = len(token_ids) if rope_by_sequence else rows_of.num_prompt_tokens[slot]
        if batch.lora_slots is not None:
            batch.lora_slots[row] = rows_of.lora_slots[slot]
        if batch.mrope_positions is not None:
            batch.mrope_positions[:, row, :chunk.num_tokens] = rows_of.mrope_positions(slot, chunk.start,
                                                                                      chunk.num_tokens)
        if batch.state_saves is not None:
            batch.state_sources[row] = chunk.state_source
            for end, checkpoint in chunk.state_saves:  # the chunk of the chunked form ending there
                batch.state_saves[row, (end - chunk.start + chunk.start % CHUNK_TOKENS) // CHUNK_TOKENS - 1] = checkpoint
        if chunk.is_final:
            inputs.sampled.append(RowSequence(row, chunk.seq_id, rows_of.logprobs_of(slot)))
            if rows_of.guided[slot]:
                inputs.guided.append(inputs.sampled[-1])
        else:
            batch.next_tokens[row] = token_ids[chunk.start + chunk.num_tokens]
        if chunk.scored:
            inputs.scored.append((row, chunk.seq_id, int(rows_of.num_prompt_logprobs[slot]), chunk.scored))
    return inputs


def empty_prefill(rows: int, tokens: int, pages_per_seq: int, fields: BatchFields = BatchFields()) -> PrefillBatch:
    """A prefill call of empty rows (zero tokens: they write only to the scratch page), with `fields`: page tables
    for each KV cache group, each row's adapter slot (-1: none), the state checkpoints each row reads and saves
    (-1: none), its tokens' M-RoPE positions."""
    zeros = functools.partial(np.zeros, rows, np.int32)
    checkpoints = fields.checkpoints
    return PrefillBatch(token_ids=np.zeros((rows, tokens), np.int32), starts=zeros(), num_tokens=zeros(),
                        page_tables=np.zeros((fields.groups, rows, pages_per_seq), np.int32), slots=zeros(),
                        is_final=np.zeros(rows, bool), next_tokens=zeros(), rope_lens=zeros(),
                        lora_slots=np.full(rows, -1, np.int32) if fields.lora else None,
                        state_sources=np.full(rows, -1, np.int32) if checkpoints else None,
                        state_saves=np.full((rows, save_blocks(tokens)), -1, np.int32) if checkpoints else None,
                        mrope_positions=np.zeros((3, rows, tokens), np.int32) if fields.mrope else None)


def with_images(batch: PrefillBatch, hidden_size: int, dtype, bidirectional: bool = False) -> PrefillBatch:
    """`batch` with room for image embeddings (none marked yet), and with `bidirectional` each query's last visible
    key (its position until an image says otherwise): the prefill variant an image model compiles."""
    rows, tokens = batch.token_ids.shape
    limits = batch.starts[:, None] + np.arange(tokens, dtype=np.int32)[None, :] if bidirectional else None
    return batch.replace(mm_embeds=np.zeros((rows, tokens, hidden_size), dtype),
                         mm_mask=np.zeros((rows, tokens), bool), query_limits=limits)


def empty_decode(rows: int, fields: BatchFields = BatchFields()) -> DecodeBatch:
    """A decode call of `rows` inactive rows (they write only to the scratch page), with `fields` (see
    `empty_prefill`; a decode row saves its state into one checkpoint, and shifts its M-RoPE positions by one
    delta)."""
    return DecodeBatch(slots=np.zeros(rows, np.int32), positions=np.zeros(rows, np.int32),
                       pages=np.zeros((fields.groups, rows), np.int32), active=np.zeros(rows, bool),
                       lora_slots=np.full(rows, -1, np.int32) if fields.lora else None,
                       state_saves=np.full(rows, -1, np.int32) if fields.checkpoints else None,
                       rope_deltas=np.zeros(rows, np.int32) if fields.mrope else None)


def decode_inputs(rows_of: InputBatch, decodes: tuple[ScheduledDecode, ...], config: EngineConfig) -> DecodeInputs:
    """O(rows) host work: the device holds every slot's page table and latest token."""
    count = len(decodes)
    batch = empty_decode(bucket_for(count, config.decode_batch_buckets), rows_of.fields)
    slot_of = rows_of.slot_of
    seq_ids = [decode.seq_id for decode in decodes]
    slots, positions = batch.slots, batch.positions
    slots[:count] = [slot_of[seq_id] for seq_id in seq_ids]
    positions[:count] = [decode.position for decode in decodes]
    live = slots[:count]
    batch.pages[:, :count] = rows_of.page_tables[:, live, positions[:count] // config.page_size]
    batch.active[:count] = True
    output_index = np.zeros(len(slots), np.int32)
    output_index[:count] = positions[:count] + 1 - rows_of.num_prompt_tokens[live]
    sampled = [RowSequence(row, seq_id, None if k < 0 else k)
               for row, (seq_id, k) in enumerate(zip(seq_ids, rows_of.num_logprobs[live].tolist()))]
    guided = [sampled[row] for row in np.flatnonzero(rows_of.guided[live]).tolist()]
    if batch.lora_slots is not None:
        batch.lora_slots[:count] = rows_of.lora_slots[live]
    if batch.state_saves is not None:
        batch.state_saves[:count] = [decode.state_save for decode in decodes]
    if batch.rope_deltas is not None:
        batch.rope_deltas[:count] = rows_of.rope_deltas[live]
    return DecodeInputs(sampled, guided, batch, output_index)


@dataclasses.dataclass
class VerifyInputs:
    """One verify call (speculative decoding): each of `rows` sequences' latest token and up to K drafts."""

    rows: list[RowSequence]
    batch: VerifyBatch  # its draft_tokens: the n-gram proposals; zeros for a draft model's (made on the device)
    last_tokens: np.ndarray  # int32 [rows, 2]: each row's two latest tokens (what a draft model feeds first)
    output_index: np.ndarray  # int32 [rows]


def empty_verify(rows: int, k: int, fields: BatchFields = BatchFields()) -> VerifyBatch:
    """A verify call of `rows` inactive rows with room for `k` drafts each (see `empty_decode`)."""
    return VerifyBatch(slots=np.zeros(rows, np.int32), positions=np.zeros(rows, np.int32),
                       draft_tokens=np.zeros((rows, k), np.int32), num_draft=np.zeros(rows, np.int32),
                       pages=np.zeros((fields.groups, rows, k + 1), np.int32), active=np.zeros(rows, bool),
                       lora_slots=np.full(rows, -1, np.int32) if fields.lora else None,
                       state_saves=np.full(rows, -1, np.int32) if fields.checkpoints else None,
                       rope_deltas=np.zeros(rows, np.int32) if fields.mrope else None)


def verify_inputs(rows_of: InputBatch, decodes: tuple[ScheduledDecode, ...], config: EngineConfig,
                  k: int) -> VerifyInputs:
    """O(rows * K) host work: each row's latest token and its drafts (n-gram proposals, or as many as a draft model
    is to propose on the device). Speculative steps are synchronous: the rows hold every token."""
    rows = bucket_for(len(decodes), config.decode_batch_buckets)
    page_size = config.page_size
    batch = empty_verify(rows, k, rows_of.fields)
    inputs = VerifyInputs([], batch, np.zeros((rows, 2), np.int32), np.zeros(rows, np.int32))
    for row, decode in enumerate(decodes):
        slot = rows_of.slot_of[decode.seq_id]
        position, num_pages = decode.position, rows_of.num_pages[slot]
        batch.slots[row] = slot
        batch.positions[row] = position
        batch.num_draft[row] = decode.num_draft
        if batch.lora_slots is not None:
            batch.lora_slots[row] = rows_of.lora_slots[slot]
        batch.draft_tokens[row, :len(decode.draft_token_ids)] = decode.draft_token_ids
        if batch.state_saves is not None:
            batch.state_saves[row] = decode.state_save
        if batch.rope_deltas is not None:
            batch.rope_deltas[row] = rows_of.rope_deltas[slot]
        for i in range(k + 1):
            index = (position + i) // page_size
            if index < num_pages:
                batch.pages[:, row, i] = rows_of.page_tables[:, slot, index]
        inputs.last_tokens[row] = rows_of.token_ids[slot][-2:]
        inputs.output_index[row] = position + 1 - rows_of.num_prompt_tokens[slot]
        inputs.rows.append(RowSequence(row, decode.seq_id, rows_of.logprobs_of(slot)))
    batch.active[:len(decodes)] = True
    return inputs

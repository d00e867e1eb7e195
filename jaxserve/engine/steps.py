"""The engine's device steps as pure functions, jitted by `ModelRunner`: each takes its state arrays, then one
pytree of inputs (the dataclasses below), and returns `(outputs, new_state)`, the new state a tuple in the order
its owner stores it (`engine/step_registry.py`).

* `SlotState`: what the device keeps per decode slot between steps: the slot's latest sampled token and its
  page table in each KV cache group (`engine/kv_plan.py`). A decode step reads its input tokens from it, so step t+1 can run before the host has seen
  step t's tokens (async scheduling), and its page tables, so the host sends only each row's current page.
* `prefill_step` / `decode_step`: the model's forward over chunks or one token per row, writing K/V into
  the (donated) page pool and the rows' argmax and page tables into the slot state; they return a `Forward`
  (the logits, their argmax, and for the engine's prefill the last layer's output) and the new pool and slot state.
* `prompt_scores_step`: the LM head over a prefill's last-layer output and each position's score of its next
  token (prompt_logprobs), run after the prefill calls that hold a chunk asking for it.
* `verify_step` / `verify_sample_step` (speculative decoding): the forward over each row's latest token and
  its K drafts, and the acceptance of the drafts (greedy in the forward, the sampler's otherwise).
* `sample_step`: the full sampler on a forward's logits, with each slot's sampling parameters from a device
  table, counting each sampled token for the penalties and writing it into the slot state (over the
  forward's argmax).
* `reset_penalties_step` / `ban_step`: a newly admitted slot's penalty statistics and min_tokens bans.
* `send_table_step`: every slot's sampling parameters from the host to the device (after admissions).
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from jaxserve.engine.allocator import Allocator
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.prompt_logprobs import score_next_tokens
from jaxserve.layers.sampler import PenaltyState, SampleResult, SamplingBatch, argmax, sample
from jaxserve.models import forward, head_logits
from jaxserve.spec_decode.verify import draft_positions, verify_greedy, verify_sample


SCORE_POSITIONS = 256  # prompt positions whose logits `prompt_scores_step` holds at once


@flax.struct.dataclass
class SlotState:
    tokens: jax.Array  # int32 [slots]: the latest token sampled for the slot's sequence
    page_tables: jax.Array  # int32 [groups, slots, pages_per_seq]: each KV cache group's
    # int32 [slots]: which of its state rows holds the slot's state (a hybrid model under speculative decoding,
    # `layers/state_slots.py`: slot s's row j is `s + j * slots`; a verify step sets it to the accepted drafts)
    state_buffers: jax.Array

    @classmethod
    def empty(cls, slots: int, pages_per_seq: int, sharding, allocator: Allocator, groups: int = 1
              ) -> "SlotState":
        return cls(tokens=allocator.full((slots,), jnp.int32, sharding),
                   page_tables=allocator.full((groups, slots, pages_per_seq), jnp.int32, sharding),
                   state_buffers=allocator.full((slots,), jnp.int32, sharding))


@flax.struct.dataclass
class Forward:
    """A forward's outputs: its logits, their argmax (a verify step's: a `SampleResult` with `num_accepted`), a
    prefill's last-layer output `[rows, T, hidden]` (`prompt_scores_step`'s input; None otherwise) and, with
    `aux_layers`, those layers' inputs `[rows, T, n * hidden]` (a speculative head's: `spec_decode/head_steps.py`)."""

    logits: jax.Array
    greedy: jax.Array | SampleResult
    hidden: jax.Array | None = None
    aux: jax.Array | None = None


# The steps' inputs: numpy arrays on the host, sent (replicated) with the call.

@dataclasses.dataclass(frozen=True)
class BatchFields:
    """The optional inputs every batch of one runner has: page tables of `groups` KV cache groups, each row's LoRA
    slot, its state checkpoints, its M-RoPE positions."""

    groups: int = 1
    lora: bool = False
    checkpoints: bool = False
    mrope: bool = False



@flax.struct.dataclass
class PrefillBatch:
    """`rows` chunks of up to `tokens` tokens each (empty rows: zero tokens, scratch pages)."""

    token_ids: jax.Array  # int32 [rows, tokens]
    starts: jax.Array  # int32 [rows]: position of each chunk's first token
    num_tokens: jax.Array  # int32 [rows]: real tokens per row (0: empty row)
    page_tables: jax.Array  # int32 [groups, rows, pages_per_seq]: each KV cache group's
    slots: jax.Array  # int32 [rows]
    is_final: jax.Array  # bool [rows]: the chunk ends its sequence's tokens, so its sample is an output token
    next_tokens: jax.Array  # int32 [rows]: the token after a chunk that is not final (what its slot feeds next)
    rope_lens: jax.Array  # int32 [rows]: the rope length each row's tokens have at least (`layers/rotary.py`)
    lora_slots: jax.Array | None = None  # LoRA: int32 [rows], each row's adapter slot (-1: the base model)
    # state checkpoints (a hybrid model under prefix caching): int32 [rows], the checkpoint each row starts from,
    # and int32 [rows, save_blocks(tokens)], those its chunks' states go to (-1: none; `AttentionMetadata`)
    state_sources: jax.Array | None = None
    state_saves: jax.Array | None = None
    mrope_positions: jax.Array | None = None  # M-RoPE: int32 [3, rows, tokens] (`AttentionMetadata`)
    # images: the embeddings [rows, tokens, hidden] of the tokens `mm_mask` (bool [rows, tokens]) marks
    mm_embeds: jax.Array | None = None
    mm_mask: jax.Array | None = None
    query_limits: jax.Array | None = None  # int32 [rows, tokens]: images seen both ways (`AttentionMetadata`)


@flax.struct.dataclass
class DecodeBatch:
    """The latest token of each of `rows` sequences (padded to a batch bucket)."""

    slots: jax.Array  # int32 [rows]
    positions: jax.Array  # int32 [rows]: where each row's input token (its slot's latest, on the device) goes
    pages: jax.Array  # int32 [groups, rows]: the page holding that position in each KV cache group (the device
    # keeps the rest of the tables)
    active: jax.Array  # bool [rows]
    lora_slots: jax.Array | None = None  # LoRA: int32 [rows], each row's adapter slot (-1: the base model)
    state_saves: jax.Array | None = None  # state checkpoints: int32 [rows], where each row's new state goes (-1: none)
    rope_deltas: jax.Array | None = None  # M-RoPE: int32 [rows], each row's position shift (on all three axes)


@flax.struct.dataclass
class VerifyBatch:
    """Each of `rows` sequences' latest token and up to K drafts (speculative decoding)."""

    slots: jax.Array  # int32 [rows]
    positions: jax.Array  # int32 [rows]: the position of each row's latest token
    draft_tokens: jax.Array  # int32 [rows, K]: n-gram proposals from the host, or a draft model's on the device
    num_draft: jax.Array  # int32 [rows]: drafts each row may have (its lookahead, or its n-gram proposal's length)
    pages: jax.Array  # int32 [groups, rows, K + 1]: the page of each position p..p+K in each KV cache group (0 past
    # the sequence's pages)
    active: jax.Array  # bool [rows]
    lora_slots: jax.Array | None = None  # LoRA: int32 [rows], each row's adapter slot (-1: the base model)
    state_saves: jax.Array | None = None  # state checkpoints: int32 [rows], where the state after each row's first
    # token goes (-1: none)
    rope_deltas: jax.Array | None = None  # M-RoPE: int32 [rows], each row's position shift (on all three axes)


@flax.struct.dataclass
class SamplerInputs:
    """A forward's logits `[rows, vocab]` and, per row, its slot, output index, whether its token counts (an output
    token of a live row) and its constrained-decoding bitmask row (all ones: unconstrained)."""

    logits: jax.Array
    slots: jax.Array
    output_index: jax.Array
    counted: jax.Array
    bitmask: jax.Array


@flax.struct.dataclass
class VerifySamplerInputs:
    """A verify step's logits `[rows, K+1, vocab]`, its drafts and their distributions (None: deterministic)."""

    logits: jax.Array
    draft_tokens: jax.Array
    num_draft: jax.Array
    draft_probs: jax.Array | None
    slots: jax.Array
    output_index: jax.Array
    counted: jax.Array


@flax.struct.dataclass
class ScoreInputs:
    """A prefill call's last-layer output and the chunk tokens it scores (`prompt_scores_step`)."""

    hidden: jax.Array
    token_ids: jax.Array
    num_tokens: jax.Array
    next_tokens: jax.Array


@flax.struct.dataclass
class ResetInputs:
    """A newly admitted slot and its tokens so far (`[bucket]`, padded)."""

    slot: jax.Array
    token_ids: jax.Array
    num_prompt_tokens: jax.Array
    num_tokens: jax.Array


@flax.struct.dataclass
class BanInputs:
    slot: jax.Array
    ban_ids: jax.Array  # int32 [BAN_IDS_CHUNK], -1: none


def _rows_to_slots(slot_state: SlotState, slots, keep):
    """`slots` where `keep`, else an index past the slot arrays (dropped by scatters with mode="drop")."""
    return jnp.where(keep, slots, slot_state.tokens.shape[0])


NO_STATE_ROW = 2**30  # past every state pool: a row that is not live reads a clipped row and writes nothing


def _state_rows(slot_state: SlotState, slots, keep, buffer=None):
    """Each row's state row: its slot's current one (or its `buffer [B]`-th), where `keep`, else past every pool."""
    buffer = slot_state.state_buffers[slots] if buffer is None else buffer
    return jnp.where(keep, slots + buffer * slot_state.tokens.shape[0], NO_STATE_ROW)


def _shifted(positions, rope_deltas):
    """M-RoPE positions `[3, B, T]` of tokens after their prompt: `positions [B, T]` + each row's delta, on all three
    axes (None without M-RoPE)."""
    if rope_deltas is None:
        return None
    return jnp.broadcast_to((positions + rope_deltas[:, None])[None], (3, *positions.shape))


def _metadata(page_tables, slot_mapping, layer_groups, **fields) -> AttentionMetadata:
    """A step's attention metadata from each KV cache group's page tables `[groups, B, P]` and KV slots
    `[groups, B, T]`: group 0's for every layer, or with several groups each layer's own (`for_layer`)."""
    if layer_groups is None:
        return AttentionMetadata(page_tables=page_tables[0], slot_mapping=slot_mapping[0], **fields)
    return AttentionMetadata(page_tables=page_tables[0], slot_mapping=slot_mapping[0],
                             group_page_tables=page_tables, group_slot_mapping=slot_mapping,
                             layer_groups=layer_groups, **fields)


def prefill_step(config, tp, backend, dtype, page_size, params, kv_cache, slot_state: SlotState, batch: PrefillBatch,
                 with_hidden: bool = False, layer_groups: tuple[int, ...] | None = None,
                 aux_layers: tuple[int, ...] = ()):
    """Chunks of `rows` sequences at once: `token_ids [rows, T]`, chunk i starting at position `starts[i]`. Each
    row's page tables become its slot's, and so does the token its sequence feeds next: a final chunk's argmax,
    else the token after the chunk (`next_tokens`; a recompute may leave its last known token to a decode).
    `with_hidden` returns the last layer's output too (`Forward.hidden`, `prompt_scores_step`'s input).
    `layer_groups`: each layer's KV cache group, when there are several (`engine/kv_plan.py`)."""
    rows, chunk = batch.token_ids.shape
    num_tokens, page_tables = batch.num_tokens, batch.page_tables
    positions = batch.starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    valid = jnp.arange(chunk)[None, :] < num_tokens[:, None]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[2] - 1)
    pages = jnp.take_along_axis(page_tables, jnp.broadcast_to(page_index, (page_tables.shape[0], rows, chunk)), 2)
    slot_mapping = jnp.where(valid, pages * page_size + positions % page_size, 0)
    live = _rows_to_slots(slot_state, batch.slots, num_tokens > 0)
    meta = _metadata(page_tables, slot_mapping, layer_groups, positions=positions,
                     context_lens=jnp.where(num_tokens > 0, batch.starts + num_tokens, 0), query_lens=num_tokens,
                     rope_lens=jnp.maximum(batch.rope_lens[:, None], positions + 1),
                     state_slots=_state_rows(slot_state, batch.slots, num_tokens > 0),
                     state_sources=batch.state_sources, state_saves=batch.state_saves,
                     mrope_positions=batch.mrope_positions, query_limits=batch.query_limits)
    outputs, kv_cache = forward(params, config, backend, batch.token_ids, kv_cache, meta,
                                logits_indices=jnp.maximum(num_tokens - 1, 0), dtype=dtype, tp=tp, with_hidden=True,
                                lora_slots=batch.lora_slots, aux_layers=aux_layers, mm_embeds=batch.mm_embeds,
                                mm_mask=batch.mm_mask)
    (logits, hidden), aux = outputs if aux_layers else (outputs, None)
    greedy = argmax(logits)
    slot_state = slot_state.replace(
        tokens=slot_state.tokens.at[live].set(jnp.where(batch.is_final, greedy, batch.next_tokens), mode="drop"),
        page_tables=slot_state.page_tables.at[:, live].set(page_tables, mode="drop"))
    return Forward(logits, greedy, hidden.astype(dtype) if with_hidden else None, aux), (kv_cache, slot_state)


def prompt_scores_step(config, tp, dtype, params, inputs: ScoreInputs):
    """The `PromptScores` of a prefill call's every position (`hidden`: its last-layer output): each scores the
    chunk's next token, its last position `next_tokens`, the next chunk's first (a final chunk's last position
    predicts an output token: that score is unused). Positions are scored `SCORE_POSITIONS` at a time, so the
    float32 logits held at once stay `SCORE_POSITIONS x vocab` whatever the prefill's size. No state."""
    token_ids = inputs.token_ids
    rows, tokens = token_ids.shape
    shifted = jnp.concatenate([token_ids[:, 1:], jnp.zeros_like(token_ids[:, :1])], axis=1)
    last = jnp.arange(tokens)[None, :] == (inputs.num_tokens - 1)[:, None]
    next_ids = jnp.where(last, inputs.next_tokens[:, None], shifted)
    size = min(rows * tokens, SCORE_POSITIONS)  # token buckets are powers of two, so it divides rows * tokens
    hidden = inputs.hidden.reshape(-1, 1, size, inputs.hidden.shape[-1])

    def score(chunk):
        chunk_hidden, chunk_ids = chunk
        return score_next_tokens(head_logits(params, config, chunk_hidden, dtype, tp), chunk_ids)
    scores = jax.lax.map(score, (hidden, next_ids.reshape(-1, 1, size)))
    return jax.tree.map(lambda leaf: leaf.reshape(rows, tokens, *leaf.shape[3:]), scores), ()


def decode_step(config, tp, backend, dtype, page_size, params, kv_cache, slot_state: SlotState, batch: DecodeBatch,
                layer_groups: tuple[int, ...] | None = None, aux_layers: tuple[int, ...] = ()):
    """One token per row: row i feeds its slot's latest token at `positions[i]`; `pages[:, i]` is the page holding
    that position in each KV cache group, written into the slot's page tables first. The argmax becomes each active
    slot's token."""
    slots, positions, pages, active = batch.slots, batch.positions, batch.pages, batch.active
    rows = slots.shape[0]
    page_index = jnp.minimum(positions // page_size, slot_state.page_tables.shape[2] - 1)
    live = _rows_to_slots(slot_state, slots, active)
    page_tables = slot_state.page_tables.at[:, live, page_index].set(pages, mode="drop")
    slot_mapping = jnp.where(active, pages * page_size + positions % page_size, 0)[:, :, None]
    token_ids = slot_state.tokens[slots]
    meta = _metadata(page_tables[:, slots], slot_mapping, layer_groups, positions=positions[:, None],
                     context_lens=jnp.where(active, positions + 1, 0), query_lens=jnp.ones((rows,), jnp.int32),
                     state_slots=_state_rows(slot_state, slots, active),
                     state_saves=None if batch.state_saves is None else batch.state_saves[:, None],
                     mrope_positions=_shifted(positions[:, None], batch.rope_deltas))
    outputs, kv_cache = forward(params, config, backend, token_ids[:, None], kv_cache, meta,
                                logits_indices=jnp.zeros((rows,), jnp.int32), dtype=dtype, tp=tp,
                                lora_slots=batch.lora_slots, aux_layers=aux_layers)
    logits, aux = outputs if aux_layers else (outputs, None)
    greedy = argmax(logits)
    slot_state = slot_state.replace(tokens=slot_state.tokens.at[live].set(greedy, mode="drop"),
                                    page_tables=page_tables)
    return Forward(logits, greedy, aux=aux), (kv_cache, slot_state)


def verify_step(config, tp, backend, dtype, page_size, params, kv_cache, slot_state: SlotState, batch: VerifyBatch,
                layer_groups: tuple[int, ...] | None = None, aux_layers: tuple[int, ...] = ()):
    """Row i feeds its slot's latest token at `positions[i]` and its `num_draft[i]` drafts after it (`draft_tokens
    [rows, K]`, `pages [groups, rows, K+1]` the pages of those K+1 positions); the logits of all K+1 positions come
    back with the greedy acceptance (`SampleResult` with `num_accepted`), and each active slot's latest token
    becomes the argmax after its accepted drafts."""
    slots, positions, draft_tokens, num_draft, active = (batch.slots, batch.positions, batch.draft_tokens,
                                                         batch.num_draft, batch.active)
    rows, k = draft_tokens.shape
    valid = active[:, None] & (jnp.arange(k + 1)[None, :] <= num_draft[:, None])
    placed = [draft_positions(tables, page_size, slots, positions, pages, valid)
              for tables, pages in zip(slot_state.page_tables, batch.pages)]
    positions2d = placed[0][0]
    slot_mapping = jnp.stack([mapping for _, mapping, _ in placed])
    page_tables = jnp.stack([tables for _, _, tables in placed])
    token_ids = jnp.concatenate([slot_state.tokens[slots][:, None], draft_tokens], axis=1)
    meta = _metadata(page_tables[:, slots], slot_mapping, layer_groups, positions=positions2d,
                     context_lens=jnp.where(active, positions + 1 + num_draft, 0),
                     query_lens=jnp.where(active, 1 + num_draft, 0), state_slots=_state_rows(slot_state, slots, active),
                     state_writes=_state_rows(slot_state, slots[:, None], active[:, None],
                                              jnp.arange(k + 1, dtype=jnp.int32)[None, :]),
                     state_saves=None if batch.state_saves is None else batch.state_saves[:, None],
                     mrope_positions=_shifted(positions2d, batch.rope_deltas))
    outputs, kv_cache = forward(params, config, backend, token_ids, kv_cache, meta, dtype=dtype, tp=tp,
                                lora_slots=batch.lora_slots, aux_layers=aux_layers)
    logits, aux = outputs if aux_layers else (outputs, None)
    greedy = argmax(logits)
    num_accepted = verify_greedy(greedy, draft_tokens, num_draft)
    last = jnp.take_along_axis(greedy, num_accepted[:, None], axis=1)[:, 0]
    live = _rows_to_slots(slot_state, slots, active)
    slot_state = SlotState(tokens=slot_state.tokens.at[live].set(last, mode="drop"), page_tables=page_tables,
                           state_buffers=slot_state.state_buffers.at[live].set(num_accepted, mode="drop"))
    return Forward(logits, SampleResult(greedy, None, None, None, num_accepted), aux=aux), (kv_cache, slot_state)


def verify_sample_step(penalties: PenaltyState, slot_state: SlotState, table: SamplingBatch,
                       inputs: VerifySamplerInputs):
    """`sample_step` for a verify step's logits `[rows, K+1, vocab]`: accepts drafts by rejection sampling
    (`draft_probs` None: deterministic drafts), counts every output token for the penalties, and makes each
    counted row's last token its slot's latest."""
    slots = inputs.slots
    sampling = jax.tree.map(lambda column: column[slots], table).replace(output_index=inputs.output_index)
    result = verify_sample(inputs.logits, inputs.draft_tokens, inputs.num_draft, inputs.draft_probs, sampling,
                           penalties.prompt_mask[slots], penalties.output_counts[slots],
                           penalties.min_tokens_ban[slots])
    positions = result.tokens.shape[1]
    is_output = inputs.counted[:, None] & (jnp.arange(positions)[None, :] <= result.num_accepted[:, None])
    counts = penalties.output_counts.at[jnp.broadcast_to(slots[:, None], result.tokens.shape), result.tokens].add(
        is_output.astype(jnp.int32))
    last = jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0]
    live = _rows_to_slots(slot_state, slots, inputs.counted)
    slot_state = slot_state.replace(tokens=slot_state.tokens.at[live].set(last, mode="drop"),
                                    state_buffers=slot_state.state_buffers.at[live].set(result.num_accepted,
                                                                                        mode="drop"))
    return result, (penalties.replace(output_counts=counts), slot_state)


def sample_step(penalties: PenaltyState, slot_state: SlotState, table: SamplingBatch, inputs: SamplerInputs):
    """The full sampler on a forward's logits, each row with its slot's parameters from `table` (`[slots]`
    columns) and its constrained-decoding `bitmask` row; rows with `counted` add their token to the slot's output
    counts and make it the slot's latest."""
    slots, counted = inputs.slots, inputs.counted
    sampling = jax.tree.map(lambda column: column[slots], table).replace(output_index=inputs.output_index)
    result = sample(inputs.logits, sampling, penalties, slots, inputs.bitmask)
    counts = penalties.output_counts.at[slots, result.tokens].add(counted.astype(jnp.int32))
    tokens = slot_state.tokens.at[_rows_to_slots(slot_state, slots, counted)].set(result.tokens, mode="drop")
    return result, (penalties.replace(output_counts=counts), slot_state.replace(tokens=tokens))


def send_table_step(table: SamplingBatch):
    """Every slot's sampling parameters, host columns -> device copy (its new state: the device table)."""
    return None, (table,)


def reset_penalties_step(vocab_size, penalties: PenaltyState, inputs: ResetInputs):
    """A newly admitted slot's statistics: its prompt tokens, its output so far (after a preemption), no bans."""
    token_ids, slot = inputs.token_ids, inputs.slot
    index = jnp.arange(token_ids.shape[0])
    prompt_ids = jnp.where(index < inputs.num_prompt_tokens, token_ids, vocab_size)  # out of range: dropped
    output_ids = jnp.where((index >= inputs.num_prompt_tokens) & (index < inputs.num_tokens), token_ids, vocab_size)
    prompt_row = jnp.zeros((vocab_size,), bool).at[prompt_ids].set(True, mode="drop")
    count_row = jnp.zeros((vocab_size,), jnp.int32).at[output_ids].add(1, mode="drop")
    return None, (PenaltyState(prompt_mask=penalties.prompt_mask.at[slot].set(prompt_row),
                               output_counts=penalties.output_counts.at[slot].set(count_row),
                               min_tokens_ban=penalties.min_tokens_ban.at[slot].set(False)),)


def ban_step(vocab_size, penalties: PenaltyState, inputs: BanInputs):
    """Bans `ban_ids` (-1: none) for the slot until it has min_tokens outputs."""
    banned = jnp.where(inputs.ban_ids >= 0, inputs.ban_ids, vocab_size)
    return None, (penalties.replace(
        min_tokens_ban=penalties.min_tokens_ban.at[inputs.slot, banned].set(True, mode="drop")),)

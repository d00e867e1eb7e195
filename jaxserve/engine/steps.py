"""The engine's device steps as pure functions (state and inputs in, new state out), jitted by `ModelRunner`.

* `SlotState`: what the device keeps per decode slot between steps: the slot's latest sampled token and its
  page table. A decode step reads its input tokens from it, so step t+1 can run before the host has seen
  step t's tokens (async scheduling), and its page tables, so the host sends only each row's current page.
* `prefill_step` / `decode_step`: the model's forward over chunks or one token per row, writing K/V into
  the (donated) page pool and the rows' argmax and page tables into the slot state; they return the
  logits, their argmax, the new pool and the new slot state (the engine's prefill also the last layer's output).
* `prompt_scores_step`: the LM head over a prefill's last-layer output and each position's score of its next
  token (prompt_logprobs), run after the prefill calls that hold a chunk asking for it.
* `verify_step` / `verify_sample_step` (speculative decoding): the forward over each row's latest token and
  its K drafts, and the acceptance of the drafts (greedy in the forward, the sampler's otherwise).
* `sample_step`: the full sampler on a forward's logits, with each slot's sampling parameters from a device
  table, counting each sampled token for the penalties and writing it into the slot state (over the
  forward's argmax).
* `reset_penalties_step` / `ban_step`: a newly admitted slot's penalty statistics and min_tokens bans.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.prompt_logprobs import score_next_tokens
from jaxserve.layers.sampler import PenaltyState, SampleResult, SamplingBatch, argmax, sample
from jaxserve.models import forward, head_logits
from jaxserve.spec_decode.verify import verify_greedy, verify_sample


@flax.struct.dataclass
class SlotState:
    tokens: jax.Array  # int32 [slots]: the latest token sampled for the slot's sequence
    page_tables: jax.Array  # int32 [slots, pages_per_seq]

    @classmethod
    def empty(cls, slots: int, pages_per_seq: int, sharding) -> "SlotState":
        return cls(tokens=jnp.zeros((slots,), jnp.int32, device=sharding),
                   page_tables=jnp.zeros((slots, pages_per_seq), jnp.int32, device=sharding))


def _rows_to_slots(slot_state: SlotState, slots, keep):
    """`slots` where `keep`, else an index past the slot arrays (dropped by scatters with mode="drop")."""
    return jnp.where(keep, slots, slot_state.tokens.shape[0])


def prefill_step(config, tp, backend, dtype, page_size, params, kv_cache, slot_state: SlotState, token_ids, starts,
                 num_tokens, page_tables, slots, is_final, next_tokens, with_hidden: bool = False):
    """Chunks of `rows` sequences at once: `token_ids [rows, T]`, chunk i starting at position `starts[i]`. Each
    row's page table becomes its slot's, and so does the token its sequence feeds next: a final chunk's argmax,
    else the token after the chunk (`next_tokens`; a recompute may leave its last known token to a decode).
    `with_hidden` adds a fifth output, the last layer's output `[rows, T, hidden]` (`prompt_scores_step`'s input)."""
    rows, chunk = token_ids.shape
    positions = starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    valid = jnp.arange(chunk)[None, :] < num_tokens[:, None]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, page_index, axis=1)
    slot_mapping = jnp.where(valid, pages * page_size + positions % page_size, 0)
    meta = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, page_tables=page_tables,
                             context_lens=jnp.where(num_tokens > 0, starts + num_tokens, 0), query_lens=num_tokens)
    (logits, hidden), kv_cache = forward(params, config, backend, token_ids, kv_cache, meta,
                                         logits_indices=jnp.maximum(num_tokens - 1, 0), dtype=dtype, tp=tp,
                                         with_hidden=True)
    greedy = argmax(logits)
    live = _rows_to_slots(slot_state, slots, num_tokens > 0)
    slot_state = SlotState(
        tokens=slot_state.tokens.at[live].set(jnp.where(is_final, greedy, next_tokens), mode="drop"),
        page_tables=slot_state.page_tables.at[live].set(page_tables, mode="drop"))
    if with_hidden:
        return logits, greedy, kv_cache, slot_state, hidden.astype(dtype)
    return logits, greedy, kv_cache, slot_state


def prompt_scores_step(config, tp, dtype, params, hidden, token_ids, num_tokens, next_tokens):
    """The `PromptScores` of a prefill call's every position (`hidden`: its last-layer output): each scores the
    chunk's next token, its last position `next_tokens`, the next chunk's first (a final chunk's last position
    predicts an output token: that score is unused)."""
    shifted = jnp.concatenate([token_ids[:, 1:], jnp.zeros_like(token_ids[:, :1])], axis=1)
    last = jnp.arange(token_ids.shape[1])[None, :] == (num_tokens - 1)[:, None]
    logits = head_logits(params, config, hidden, dtype, tp)
    return score_next_tokens(logits, jnp.where(last, next_tokens[:, None], shifted))


def decode_step(config, tp, backend, dtype, page_size, params, kv_cache, slot_state: SlotState, slots, positions,
                pages, active):
    """One token per row: row i feeds its slot's latest token at `positions[i]`; `pages[i]` is the page holding
    that position, written into the slot's page table first. The argmax becomes each active slot's token."""
    rows = slots.shape[0]
    page_index = jnp.minimum(positions // page_size, slot_state.page_tables.shape[1] - 1)
    live = _rows_to_slots(slot_state, slots, active)
    page_tables = slot_state.page_tables.at[live, page_index].set(pages, mode="drop")
    row_tables = page_tables[slots]
    token_ids = slot_state.tokens[slots]
    slot_mapping = jnp.where(active, pages * page_size + positions % page_size, 0)
    meta = AttentionMetadata(positions=positions[:, None], slot_mapping=slot_mapping[:, None], page_tables=row_tables,
                             context_lens=jnp.where(active, positions + 1, 0),
                             query_lens=jnp.ones((rows,), jnp.int32))
    logits, kv_cache = forward(params, config, backend, token_ids[:, None], kv_cache, meta,
                               logits_indices=jnp.zeros((rows,), jnp.int32), dtype=dtype, tp=tp)
    greedy = argmax(logits)
    slot_state = SlotState(tokens=slot_state.tokens.at[live].set(greedy, mode="drop"), page_tables=page_tables)
    return logits, greedy, kv_cache, slot_state


def draft_positions(slot_state: SlotState, page_size, slots, positions, pages, valid):
    """Rows' positions `positions[:, None] + i` (i < pages.shape[1]) and their flat KV slots, with `pages[r, i]`
    (the page of row r's position i) written into the slots' page tables where `valid`: the part of a verify
    step (or a draft model's proposal) that places K+1 tokens per row in the paged cache."""
    rows, width = pages.shape
    positions = positions[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    page_index = jnp.minimum(positions // page_size, slot_state.page_tables.shape[1] - 1)
    live = jnp.where(valid, slots[:, None], slot_state.tokens.shape[0])
    page_tables = slot_state.page_tables.at[live, page_index].set(pages, mode="drop")
    slot_mapping = jnp.where(valid, pages * page_size + positions % page_size, 0)
    return positions, slot_mapping, page_tables


def verify_step(config, tp, backend, dtype, page_size, params, kv_cache, slot_state: SlotState, slots, positions,
                draft_tokens, num_draft, pages, active):
    """Row i feeds its slot's latest token at `positions[i]` and its `num_draft[i]` drafts after it (`draft_tokens
    [rows, K]`, `pages [rows, K+1]` the pages of those K+1 positions); the logits of all K+1 positions come back
    with the greedy acceptance (`SampleResult` with `num_accepted`), and each active slot's latest token becomes
    the argmax after its accepted drafts."""
    rows, k = draft_tokens.shape
    valid = active[:, None] & (jnp.arange(k + 1)[None, :] <= num_draft[:, None])
    positions2d, slot_mapping, page_tables = draft_positions(slot_state, page_size, slots, positions, pages, valid)
    token_ids = jnp.concatenate([slot_state.tokens[slots][:, None], draft_tokens], axis=1)
    meta = AttentionMetadata(positions=positions2d, slot_mapping=slot_mapping, page_tables=page_tables[slots],
                             context_lens=jnp.where(active, positions + 1 + num_draft, 0),
                             query_lens=jnp.where(active, 1 + num_draft, 0))
    logits, kv_cache = forward(params, config, backend, token_ids, kv_cache, meta, dtype=dtype, tp=tp)
    greedy = argmax(logits)
    num_accepted = verify_greedy(greedy, draft_tokens, num_draft)
    last = jnp.take_along_axis(greedy, num_accepted[:, None], axis=1)[:, 0]
    live = _rows_to_slots(slot_state, slots, active)
    slot_state = SlotState(tokens=slot_state.tokens.at[live].set(last, mode="drop"), page_tables=page_tables)
    return logits, SampleResult(greedy, None, None, None, num_accepted), kv_cache, slot_state


def verify_sample_step(penalties: PenaltyState, slot_state: SlotState, table: SamplingBatch, logits, draft_tokens,
                       num_draft, draft_probs, slots, output_index, counted):
    """`sample_step` for a verify step's logits `[rows, K+1, vocab]`: accepts drafts by rejection sampling
    (`draft_probs` None: deterministic drafts), counts every output token for the penalties, and makes each
    counted row's last token its slot's latest."""
    sampling = jax.tree.map(lambda column: column[slots], table).replace(output_index=output_index)
    result = verify_sample(logits, draft_tokens, num_draft, draft_probs, sampling, penalties.prompt_mask[slots],
                           penalties.output_counts[slots], penalties.min_tokens_ban[slots])
    positions = result.tokens.shape[1]
    is_output = counted[:, None] & (jnp.arange(positions)[None, :] <= result.num_accepted[:, None])
    counts = penalties.output_counts.at[jnp.broadcast_to(slots[:, None], result.tokens.shape), result.tokens].add(
        is_output.astype(jnp.int32))
    last = jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0]
    tokens = slot_state.tokens.at[_rows_to_slots(slot_state, slots, counted)].set(last, mode="drop")
    return result, penalties.replace(output_counts=counts), slot_state.replace(tokens=tokens)


def sample_step(penalties: PenaltyState, slot_state: SlotState, table: SamplingBatch, logits, slots, output_index,
                counted, bitmask):
    """The full sampler on a forward's logits, each row with its slot's parameters from `table` (`[slots]`
    columns) and its constrained-decoding `bitmask` row (all ones: unconstrained); rows with `counted` add their
    token to the slot's output counts and make it the slot's latest."""
    sampling = jax.tree.map(lambda column: column[slots], table).replace(output_index=output_index)
    result = sample(logits, sampling, penalties, slots, bitmask)
    counts = penalties.output_counts.at[slots, result.tokens].add(counted.astype(jnp.int32))
    tokens = slot_state.tokens.at[_rows_to_slots(slot_state, slots, counted)].set(result.tokens, mode="drop")
    return result, penalties.replace(output_counts=counts), slot_state.replace(tokens=tokens)


def reset_penalties_step(vocab_size, penalties: PenaltyState, slot, token_ids, num_prompt_tokens, num_tokens):
    """A newly admitted slot's statistics: its prompt tokens, its output so far (after a preemption), no bans."""
    index = jnp.arange(token_ids.shape[0])
    prompt_ids = jnp.where(index < num_prompt_tokens, token_ids, vocab_size)  # out of range: dropped
    output_ids = jnp.where((index >= num_prompt_tokens) & (index < num_tokens), token_ids, vocab_size)
    prompt_row = jnp.zeros((vocab_size,), bool).at[prompt_ids].set(True, mode="drop")
    count_row = jnp.zeros((vocab_size,), jnp.int32).at[output_ids].add(1, mode="drop")
    return PenaltyState(prompt_mask=penalties.prompt_mask.at[slot].set(prompt_row),
                        output_counts=penalties.output_counts.at[slot].set(count_row),
                        min_tokens_ban=penalties.min_tokens_ban.at[slot].set(False))


def ban_step(vocab_size, penalties: PenaltyState, slot, ban_ids):
    """Bans `ban_ids` (-1: none) for the slot until it has min_tokens outputs."""
    banned = jnp.where(ban_ids >= 0, ban_ids, vocab_size)
    return penalties.replace(min_tokens_ban=penalties.min_tokens_ban.at[slot, banned].set(True, mode="drop"))

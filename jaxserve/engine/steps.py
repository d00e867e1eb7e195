"""The engine's device steps as pure functions (state and inputs in, new state out), jitted by `ModelRunner`.

* `prefill_step` / `decode_step`: the model's forward over chunks or one token per row, writing K/V into
  the (donated) page pool; they return the logits, their argmax, and the new pool.
* `sample_step`: the full sampler on a forward's logits, counting each sampled token for the penalties.
* `reset_penalties_step` / `ban_step`: a newly admitted slot's penalty statistics and min_tokens bans.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.sampler import PenaltyState, SamplingBatch, argmax, sample
from jaxserve.models import forward


def prefill_step(config, tp, backend, dtype, page_size, params, kv_cache, token_ids, starts, num_tokens, page_tables):
    """Chunks of `rows` sequences at once: `token_ids [rows, T]`, chunk i starting at position `starts[i]`."""
    rows, chunk = token_ids.shape
    positions = starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    valid = jnp.arange(chunk)[None, :] < num_tokens[:, None]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, page_index, axis=1)
    slot_mapping = jnp.where(valid, pages * page_size + positions % page_size, 0)
    meta = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, page_tables=page_tables,
                             context_lens=jnp.where(num_tokens > 0, starts + num_tokens, 0), query_lens=num_tokens)
    logits, kv_cache = forward(params, config, backend, token_ids, kv_cache, meta,
                               logits_indices=jnp.maximum(num_tokens - 1, 0), dtype=dtype, tp=tp)
    return logits, argmax(logits), kv_cache


def decode_step(config, tp, backend, dtype, page_size, params, kv_cache, token_ids, positions, page_tables, active):
    rows = token_ids.shape[0]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    page = jnp.take_along_axis(page_tables, page_index[:, None], axis=1)[:, 0]
    slot_mapping = jnp.where(active, page * page_size + positions % page_size, 0)
    meta = AttentionMetadata(positions=positions[:, None], slot_mapping=slot_mapping[:, None], page_tables=page_tables,
                             context_lens=jnp.where(active, positions + 1, 0),
                             query_lens=jnp.ones((rows,), jnp.int32))
    logits, kv_cache = forward(params, config, backend, token_ids[:, None], kv_cache, meta,
                               logits_indices=jnp.zeros((rows,), jnp.int32), dtype=dtype, tp=tp)
    return logits, argmax(logits), kv_cache


def sample_step(penalties: PenaltyState, logits, slots, sampling: SamplingBatch, counted):
    """The full sampler on a forward's logits; rows with `counted` add their token to the slot's output counts."""
    result = sample(logits, sampling, penalties, slots)
    counts = penalties.output_counts.at[slots, result.tokens].add(counted.astype(jnp.int32))
    return result, penalties.replace(output_counts=counts)


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

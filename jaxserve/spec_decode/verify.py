"""Acceptance of proposed tokens, on the device: K drafts per row against the target's logits at K+1 positions.

* Greedy rows: the longest prefix of drafts equal to the target's argmax, then the target's argmax at the first
  mismatch (or after the last draft): token for token what decoding without speculation gives.
* Sampled rows: the rejection sampling of Leviathan et al. / Chen et al. Draft i is accepted with probability
  min(1, p_i(d) / q_i(d)), p the target's sampling distribution (penalties, temperature, min-p, top-k/top-p) and
  q the proposer's (one-hot for n-gram proposals); at the first rejection the token is drawn from the
  normalized residual max(0, p - q), and after K acceptances from p itself. The output distribution is p's.

Position i's penalty statistics count drafts 1..i as generated (they are, whenever position i is reached), and its
min_tokens ban and random numbers use output index `output_index + i`, so a row's draws depend on its seed and
output index alone, as without speculation; the draw at a row's last position uses the very number the plain
sampler would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.layers.sampler import (SampleResult, SamplingBatch, apply_penalties, argmax, inverse_cdf, row_uniforms,
                                     sampling_logits, token_logprobs)

ACCEPT_STREAM = 1  # `row_uniforms` stream of the acceptance tests (stream 0 is the plain sampler's draw)


def draft_positions(page_tables, page_size, slots, positions, pages, valid):
    """Rows' positions `positions[:, None] + i` (i < pages.shape[1]) and their flat KV slots, with `pages[r, i]`
    (the page of row r's position i) written into the slots' `page_tables [slots, pages_per_seq]` where `valid`:
    how a verify step (or a draft model's proposal) places K+1 tokens per row in the paged cache."""
    rows, width = pages.shape
    positions = positions[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    live = jnp.where(valid, slots[:, None], page_tables.shape[0])
    page_tables = page_tables.at[live, page_index].set(pages, mode="drop")
    slot_mapping = jnp.where(valid, pages * page_size + positions % page_size, 0)
    return positions, slot_mapping, page_tables


def accepted_prefix(accept: jax.Array, num_draft: jax.Array) -> jax.Array:
    """Per row, how many leading drafts are accepted: `accept [rows, K]` bools, rows with `num_draft` drafts."""
    k = accept.shape[1]
    accept = accept & (jnp.arange(k)[None, :] < num_draft[:, None])
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def verify_greedy(greedy: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array) -> jax.Array:
    """Accepted drafts per row when every row is greedy: `greedy [rows, K+1]` is the target's argmax."""
    return accepted_prefix(draft_tokens == greedy[:, :-1], num_draft)


def _positions(batch: SamplingBatch, positions: int) -> SamplingBatch:
    """`batch` repeated for each of a row's positions (row-major), with output index `output_index + i`."""
    flat = jax.tree.map(lambda column: jnp.repeat(column, positions, axis=0), batch)
    index = batch.output_index[:, None] + jnp.arange(positions, dtype=jnp.int32)[None, :]
    return flat.replace(output_index=index.reshape(-1))


def verify_sample(logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array, draft_probs: jax.Array | None,
                  batch: SamplingBatch, prompt_mask: jax.Array, output_counts: jax.Array,
                  min_tokens_ban: jax.Array) -> SampleResult:
    """Accepts drafts and picks each row's next token. `logits [rows, K+1, vocab]` (float32) is the target's,
    `draft_probs [rows, K, vocab]` the proposer's distributions (None: the drafts are deterministic, q one-hot);
    the penalty statistics are each row's `[rows, vocab]`."""
    rows, positions, vocab = logits.shape
    k = positions - 1
    flat_batch = _positions(batch, positions)
    drafted = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.int32) * (
        jnp.arange(k)[None, :] < num_draft[:, None])[..., None].astype(jnp.int32)
    uses_counts = jnp.any((batch.repetition_penalty != 1) | (batch.presence_penalty != 0)
                          | (batch.frequency_penalty != 0))
    counts = jax.lax.cond(  # position i counts drafts 1..i; skipped when no row's penalties read the counts
        uses_counts,
        lambda: (output_counts[:, None, :] + jnp.concatenate(
            [jnp.zeros((rows, 1, vocab), jnp.int32), jnp.cumsum(drafted, axis=1)], axis=1)).reshape(-1, vocab),
        lambda: jnp.repeat(output_counts, positions, axis=0))
    flat_logits = logits.reshape(-1, vocab)
    penalized = apply_penalties(flat_logits, flat_batch, jnp.repeat(prompt_mask, positions, axis=0), counts,
                                jnp.repeat(min_tokens_ban, positions, axis=0))
    greedy = argmax(penalized).reshape(rows, positions)
    target = sampling_logits(penalized, flat_batch)
    probs = jax.nn.softmax(target, axis=-1).reshape(rows, positions, vocab)
    u_accept = row_uniforms(flat_batch.seed, flat_batch.output_index, ACCEPT_STREAM).reshape(rows, positions)
    u_draw = row_uniforms(flat_batch.seed, flat_batch.output_index).reshape(rows, positions)

    p_draft = jnp.take_along_axis(probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = (1.0 if draft_probs is None
               else jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0])
    is_greedy = batch.temperature == 0
    accept = jnp.where(is_greedy[:, None], draft_tokens == greedy[:, :k], u_accept[:, :k] * q_draft < p_draft)
    num_accepted = accepted_prefix(accept, num_draft)

    row = jnp.arange(rows)
    p_last = probs[row, num_accepted]
    last_draft = jnp.minimum(num_accepted, k - 1)
    q_last = (jax.nn.one_hot(draft_tokens[row, last_draft], vocab, dtype=jnp.float32) if draft_probs is None
              else draft_probs[row, last_draft])
    residual = jnp.maximum(p_last - q_last, 0.0)
    rejected = (num_accepted < num_draft) & (jnp.sum(residual, axis=-1) > 0)  # p == q leaves nothing: draw from p
    drawn = inverse_cdf(jnp.where(rejected[:, None], residual, p_last), u_draw[row, num_accepted])
    last = jnp.where(is_greedy, greedy[row, num_accepted], drawn)
    padded_drafts = jnp.concatenate([draft_tokens, jnp.zeros((rows, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(positions)[None, :] < num_accepted[:, None], padded_drafts, last[:, None])
    logprobs, top_ids, top_logprobs = token_logprobs(flat_logits, tokens.reshape(-1), jnp.any(batch.wants_logprobs))
    return SampleResult(tokens, logprobs.reshape(rows, positions), top_ids.reshape(rows, positions, -1),
                        top_logprobs.reshape(rows, positions, -1), num_accepted)

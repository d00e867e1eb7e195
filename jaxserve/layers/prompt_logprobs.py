"""Prompt scoring on the device: each position's log-probability of the token after it, that token's rank and the
top MAX_LOGPROBS, under the model's own distribution (raw logits: no penalties, temperature or masks), as vLLM's
`prompt_logprobs` reports them."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.sampling_params import MAX_LOGPROBS


@flax.struct.dataclass
class PromptScores:
    """`[rows, T]` per position of a prefill chunk (the token after the chunk's last position is the next chunk's
    first); the top entries gain a `[..., MAX_LOGPROBS]` axis, best first."""

    logprobs: jax.Array  # float32: log-probability of the next token
    ranks: jax.Array  # int32: its 1-based rank (tokens at least as likely, itself included, as vLLM counts)
    top_ids: jax.Array  # int32
    top_logprobs: jax.Array  # float32


def score_next_tokens(logits: jax.Array, next_ids: jax.Array) -> PromptScores:
    """`logits [rows, T, vocab]` (float32) and `next_ids [rows, T]`, the token each position predicts."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, next_ids[..., None], axis=-1)[..., 0]
    ranks = jnp.sum(logprobs >= chosen[..., None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return PromptScores(chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)

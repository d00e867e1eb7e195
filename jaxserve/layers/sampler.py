"""On-device sampling: penalties, temperature, min-p, top-k, top-p, seeded draws and logprobs, for a batch of rows.

Everything here runs on device, jitted on its own after the model's forward (which also returns the
argmax, all a plain greedy batch needs). Each row carries its own parameters; rows with temperature 0
take the argmax. The costly optional parts (a sort over the vocabulary for top-k/top-p, top-k logprobs)
sit behind `lax.cond`.
A row's random key is derived from its request's seed and its output index alone, so a seeded
request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.sampling_params import MAX_LOGPROBS

NEG_INF = -jnp.inf


@flax.struct.dataclass
class SamplingBatch:
    """Per-row sampling parameters, `[rows]` each (built on the host from `SamplingParams`)."""

    temperature: jax.Array  # float32; 0 = greedy
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32; 0 = off
    min_p: jax.Array  # float32
    repetition_penalty: jax.Array  # float32
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    seed: jax.Array  # uint32
    output_index: jax.Array  # int32: how many tokens this row's sequence has generated so far
    min_tokens: jax.Array  # int32
    wants_logprobs: jax.Array  # bool


@flax.struct.dataclass
class PenaltyState:
    """Per-slot token statistics the penalties need, `[slots, vocab]`, kept on device and donated each step."""

    prompt_mask: jax.Array  # bool: token occurs in the prompt (repetition penalty)
    output_counts: jax.Array  # int32: occurrences in the output (all three penalties)
    min_tokens_ban: jax.Array  # bool: tokens banned until min_tokens outputs (EOS and stop_token_ids)


@flax.struct.dataclass
class SampleResult:
    tokens: jax.Array  # int32 [rows]
    logprobs: jax.Array  # float32 [rows]: logprob of the sampled token under the model's distribution
    top_ids: jax.Array  # int32 [rows, MAX_LOGPROBS]
    top_logprobs: jax.Array  # float32 [rows, MAX_LOGPROBS]
    # a verify step's (speculative decoding): tokens and the logprob fields gain a position axis ([rows, K + 1]),
    # and row i's output tokens are tokens[i, :num_accepted[i] + 1]
    num_accepted: jax.Array | None = None  # int32 [rows]


def apply_penalties(logits, batch: SamplingBatch, prompt_mask, output_counts, min_tokens_ban):
    """vLLM's penalties: repetition (prompt + output), presence and frequency (output), min_tokens bans; the
    statistics are each row's own `[rows, vocab]` (`PenaltyState` gathered at the rows' slots)."""
    seen = prompt_mask | (output_counts > 0)
    rep = batch.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency_penalty[:, None] * output_counts
    logits = logits - batch.presence_penalty[:, None] * (output_counts > 0)
    too_short = (batch.output_index < batch.min_tokens)[:, None]
    return jnp.where(too_short & min_tokens_ban, NEG_INF, logits)


def _truncate_top_k_top_p(logits, top_k, top_p):
    """Masks tokens outside each row's top-k and nucleus (top-p); one descending sort per row."""
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(vocab)[None, :]
    sorted_logits = jnp.where(ranks < k[:, None], sorted_logits, NEG_INF)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # the rank check matters even with top_p = 1: the cumulative mass may round to just below 1 past rank k
    keep = ((mass_before < top_p[:, None]) | (ranks == 0)) & (ranks < k[:, None])
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, NEG_INF)


def argmax(logits: jax.Array) -> jax.Array:
    """First index of each row's maximum, as two plain reductions (faster than jnp.argmax on XLA:CPU)."""
    vocab = logits.shape[-1]
    is_max = logits == jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # a NaN row matches nothing; keep the index in range


SAMPLE_BLOCK = 256  # vocabulary block of the two-level inverse-CDF search


def inverse_cdf(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Per row, the index where the cumulative `weights` (>= 0, unnormalized) first exceed `uniform * total`.

    Two levels (block sums, then one block) because a cumulative sum over the whole vocabulary is
    slow on XLA:CPU.
    """
    rows, vocab = weights.shape
    padded = jnp.pad(weights, ((0, 0), (0, -vocab % SAMPLE_BLOCK)))
    blocks = padded.reshape(rows, -1, SAMPLE_BLOCK)
    block_cdf = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)
    target = uniform * block_cdf[:, -1]
    block = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), block_cdf.shape[1] - 1)
    before = jnp.where(block > 0, jnp.take_along_axis(block_cdf, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner_cdf = jnp.cumsum(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0], axis=-1)
    offset = jnp.minimum(jnp.sum(inner_cdf <= (target - before)[:, None], axis=-1), SAMPLE_BLOCK - 1)
    index = jnp.minimum(block * SAMPLE_BLOCK + offset, vocab - 1).astype(jnp.int32)
    # float rounding may stop on a zero-weight (masked) token; fall back to the heaviest one
    landed = jnp.take_along_axis(weights, index[:, None], axis=-1)[:, 0] > 0
    return jnp.where(landed, index, argmax(weights))


def sampling_logits(logits, batch: SamplingBatch):
    """Temperature, min-p and top-k/top-p applied to (penalized) logits: the distribution a row draws from."""
    temperature = jnp.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
    logits = logits / temperature
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    logits = jnp.where(weights >= batch.min_p[:, None], logits, NEG_INF)  # min-p relative to the top token
    needs_sort = jnp.any((batch.top_k > 0) | (batch.top_p < 1))
    return jax.lax.cond(needs_sort, _truncate_top_k_top_p, lambda l, k, p: l, logits, batch.top_k, batch.top_p)


def row_uniforms(seeds, output_index, stream: int = 0):
    """One uniform number per row from the row's seed and output index alone (`stream` > 0: an independent
    draw for the same token, as speculative decoding's acceptance test needs)."""
    def one(seed, index):
        key = jax.random.fold_in(jax.random.key(seed), index)
        return jax.random.uniform(jax.random.fold_in(key, stream) if stream else key, (), jnp.float32)

    return jax.vmap(one)(seeds, output_index)


def _draw(logits, batch: SamplingBatch):
    """An inverse-CDF draw from `sampling_logits` with one uniform number from each row's own key.

    One random number per row, not one per vocabulary entry as Gumbel-max needs: threefry over the
    whole vocabulary is costly on CPU.
    """
    logits = sampling_logits(logits, batch)
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return inverse_cdf(weights, row_uniforms(batch.seed, batch.output_index))


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's packed bitmask (`[rows, ceil(vocab / 32)]` int32, bit t % 32 of word t // 32: token t
    allowed) has a 0 bit: constrained decoding's mask. An all-ones mask changes nothing."""
    token = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    allowed = (jnp.right_shift(bitmask[:, token // 32], token % 32) & 1).astype(bool)
    return jnp.where(allowed, logits, NEG_INF)


def sample(logits: jax.Array, batch: SamplingBatch, penalties: PenaltyState, slots: jax.Array,
           bitmask: jax.Array | None = None) -> SampleResult:
    """Samples one token per row of float32 `logits [rows, vocab]`; row i uses penalty slot `slots[i]` and, with
    `bitmask`, only the tokens its mask allows (logprobs stay the model's own distribution)."""
    raw_logits = logits
    if bitmask is not None:
        logits = apply_token_bitmask(logits, bitmask)
    logits = apply_penalties(logits, batch, penalties.prompt_mask[slots], penalties.output_counts[slots],
                             penalties.min_tokens_ban[slots])
    tokens = jnp.where(batch.temperature == 0, argmax(logits), _draw(logits, batch))

    sampled, top_ids, top_values = token_logprobs(raw_logits, tokens, jnp.any(batch.wants_logprobs))
    return SampleResult(tokens, sampled, top_ids, top_values)


def token_logprobs(raw_logits, tokens, wanted):
    """`tokens`' logprobs and the top MAX_LOGPROBS under the model's own distribution (before penalties and
    temperature), for `raw_logits [rows, vocab]`; zeros unless `wanted` (a traced bool), which skips the work."""
    def with_logprobs(raw):
        logprobs = jax.nn.log_softmax(raw, axis=-1)
        values, ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        return sampled, ids.astype(jnp.int32), values

    def without_logprobs(raw):
        rows = raw.shape[0]
        return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))

    return jax.lax.cond(wanted, with_logprobs, without_logprobs, raw_logits)

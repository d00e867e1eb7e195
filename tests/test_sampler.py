"""The on-device sampler as a pure function: distribution, truncations, penalties, greedy-only variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.input_batch import SlotSamplingParams
from jaxserve.layers.sampler import PenaltyState, argmax, inverse_cdf, sample
from jaxserve.sampling_params import SamplingParams

VOCAB = 600  # not a multiple of the inverse-CDF block, to cover the padded tail


def run(logits_row, params: SamplingParams, draws: int, penalties=None, output_index=None):
    slots = SlotSamplingParams(draws)
    for row in range(draws):
        slots.set(row, params, seed=row)
    batch = slots.batch(np.arange(draws), np.zeros(draws, np.int32) if output_index is None else output_index)
    penalties = penalties or PenaltyState(jnp.zeros((draws, VOCAB), bool), jnp.zeros((draws, VOCAB), jnp.int32),
                                          jnp.zeros((draws, VOCAB), bool))
    logits = jnp.tile(jnp.asarray(logits_row, jnp.float32), (draws, 1))
    return np.asarray(jax.jit(sample)(logits, batch, penalties, jnp.arange(draws, dtype=jnp.int32)).tokens)


@pytest.fixture(scope="module")
def logits_row():
    row = np.full(VOCAB, -30.0, np.float32)
    row[[3, 10, 257, 599]] = np.log([0.4, 0.3, 0.2, 0.1])
    return row


def test_draws_follow_the_distribution(logits_row):
    tokens = run(logits_row, SamplingParams(temperature=1.0), 4000)
    freq = {t: np.mean(tokens == t) for t in (3, 10, 257, 599)}
    assert freq == pytest.approx({3: 0.4, 10: 0.3, 257: 0.2, 599: 0.1}, abs=0.03)
    assert set(np.unique(tokens)) <= {3, 10, 257, 599}


def test_truncations_keep_only_allowed_tokens(logits_row):
    assert set(np.unique(run(logits_row, SamplingParams(top_k=2), 500))) == {3, 10}
    assert set(np.unique(run(logits_row, SamplingParams(top_p=0.65), 500))) == {3, 10}
    assert set(np.unique(run(logits_row, SamplingParams(min_p=0.6), 500))) == {3, 10}  # 0.3 >= 0.6 * 0.4
    assert set(np.unique(run(logits_row, SamplingParams(temperature=0.0), 50))) == {3}


def test_penalties_and_min_tokens_ban(logits_row):
    draws = 4
    counts = jnp.zeros((draws, VOCAB), jnp.int32).at[:, 3].set(5)
    penalties = PenaltyState(jnp.zeros((draws, VOCAB), bool), counts, jnp.zeros((draws, VOCAB), bool))
    greedy = run(logits_row, SamplingParams(temperature=0, frequency_penalty=1.0), draws, penalties)
    assert set(greedy) == {10}  # token 3 pushed down by 5 occurrences
    ban = PenaltyState(jnp.zeros((draws, VOCAB), bool), jnp.zeros((draws, VOCAB), jnp.int32),
                       jnp.zeros((draws, VOCAB), bool).at[:, 3].set(True))
    banned = run(logits_row, SamplingParams(temperature=0, min_tokens=2), draws, ban)
    assert set(banned) == {10}
    allowed = run(logits_row, SamplingParams(temperature=0, min_tokens=2), draws, ban,
                  output_index=np.full(draws, 2, np.int32))
    assert set(allowed) == {3}


def test_inverse_cdf_never_lands_on_zero_weight():
    weights = jnp.zeros((3, VOCAB)).at[:, 599].set(1.0).at[1, 0].set(1e-30)
    index = inverse_cdf(weights, jnp.array([0.0, 0.999999, 1.0]))
    assert np.all(np.asarray(weights)[np.arange(3), np.asarray(index)] > 0)


def test_greedy_sampler_matches_the_plain_argmax(logits_row):
    """Plain batches take the forward's `argmax`; greedy rows through the full sampler must agree with it."""
    slots = SlotSamplingParams(2)
    batch = slots.batch(np.arange(2), np.zeros(2, np.int32))
    penalties = PenaltyState(jnp.zeros((2, VOCAB), bool), jnp.zeros((2, VOCAB), jnp.int32), jnp.zeros((2, VOCAB), bool))
    logits = jax.random.normal(jax.random.key(0), (2, VOCAB)).at[1, 7].set(10.0).at[1, 9].set(10.0)  # a tie
    tokens = jax.jit(sample)(logits, batch, penalties, jnp.arange(2)).tokens
    assert np.array_equal(tokens, np.argmax(logits, axis=-1))
    assert np.array_equal(jax.jit(argmax)(logits), np.argmax(logits, axis=-1))


def test_top_k_holds_whatever_the_cumulative_mass_rounds_to():
    """top_k alone (top_p = 1) keeps exactly k tokens even where the sorted probabilities' cumulative sum rounds
    to just below 1 past rank k (it then kept the whole vocabulary, so a seeded draw changed with tiny logit
    differences between batch sizes)."""
    from jaxserve.layers.sampler import _truncate_top_k_top_p

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(256, 512)).astype(np.float32) * 1.5)
    kept = np.isfinite(np.asarray(jax.jit(_truncate_top_k_top_p)(logits, jnp.full(256, 20), jnp.ones(256))))
    assert (kept.sum(axis=1) == 20).all()

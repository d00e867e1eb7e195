"""The gated delta rule (`layers/gated_delta.py`) against transformers' own torch forms (`modeling_qwen3_next`):
fresh random inputs, grouped key heads, a nonzero starting state, lengths around the chunk boundaries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from jaxserve.layers.gated_delta import chunked_gated_delta, recurrent_gated_delta


def random_inputs(rng, length: int, batch: int = 2, key_heads: int = 2, value_heads: int = 4, key_dim: int = 16,
                  value_dim: int = 8) -> dict[str, np.ndarray]:
    return {"q": rng.standard_normal((batch, length, key_heads, key_dim)).astype(np.float32),
            "k": rng.standard_normal((batch, length, key_heads, key_dim)).astype(np.float32),
            "v": rng.standard_normal((batch, length, value_heads, value_dim)).astype(np.float32),
            "g": -rng.uniform(0.01, 1.0, (batch, length, value_heads)).astype(np.float32),
            "beta": rng.uniform(0.0, 1.0, (batch, length, value_heads)).astype(np.float32),
            "state": rng.standard_normal((batch, value_heads, key_dim, value_dim)).astype(np.float32)}


def transformers_recurrent(x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    args = [torch.from_numpy(x[name]).double() for name in ("q", "k", "v", "g", "beta")]
    out, state = hf.torch_recurrent_gated_delta_rule(*args, initial_state=torch.from_numpy(x["state"]).double(),
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out.numpy(), state.numpy()


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_both_forms_match_transformers(length):
    """Float32 against transformers' recurrent form in float64 (its chunked form agrees with it): outputs and the
    final state; chunks of 16, so lengths cross their boundaries."""
    x = random_inputs(np.random.default_rng(length), length)
    expected_out, expected_state = transformers_recurrent(x)
    args = [jnp.asarray(x[name]) for name in ("q", "k", "v", "g", "beta", "state")]
    for out, state in (recurrent_gated_delta(*args), chunked_gated_delta(*args, chunk=16)):
        np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state), expected_state, rtol=1e-5, atol=1e-6)


def test_a_sequence_split_in_two_calls_carries_its_state():
    """Prefill in chunks (the engine's chunked prefill) then decode one token at a time: the state each call hands
    on gives the outputs one call over the whole sequence gives."""
    x = random_inputs(np.random.default_rng(5), 37)
    whole, final = chunked_gated_delta(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "state")), chunk=16)
    part = {name: jnp.asarray(value[:, :30]) for name, value in x.items() if name != "state"}
    first, state = chunked_gated_delta(**part, state=jnp.asarray(x["state"]), chunk=16)
    outs = [first]
    for t in range(30, 37):
        token = {name: jnp.asarray(value[:, t:t + 1]) for name, value in x.items() if name != "state"}
        out, state = recurrent_gated_delta(**token, state=state)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(whole), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state), np.asarray(final), rtol=1e-5, atol=1e-6)


def test_padding_tokens_leave_the_state_alone():
    """Tokens with g = 0 and beta = 0 (a batch's padding, whatever their q, k, v) change no state."""
    x = random_inputs(np.random.default_rng(9), 20)
    x["g"][:, 12:] = 0.0
    x["beta"][:, 12:] = 0.0
    real = {name: jnp.asarray(value[:, :12]) for name, value in x.items() if name != "state"}
    _, expected = recurrent_gated_delta(**real, state=jnp.asarray(x["state"]))
    args = [jnp.asarray(x[name]) for name in ("q", "k", "v", "g", "beta", "state")]
    for _, state in (recurrent_gated_delta(*args), chunked_gated_delta(*args, chunk=16)):
        np.testing.assert_allclose(np.asarray(state), np.asarray(expected), rtol=1e-5, atol=1e-5)

"""The gated delta rule (`layers/gated_delta.py`) against transformers' own torch forms (`modeling_qwen3_next`):
fresh random inputs, grouped key heads, a nonzero starting state, lengths around the chunk boundaries."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from jaxserve.layers import gated_delta

# jitted: op by op, each test's calls took several times longer
recurrent_gated_delta = jax.jit(gated_delta.recurrent_gated_delta, static_argnames=("l2_norm",))
chunked_gated_delta = jax.jit(gated_delta.chunked_gated_delta, static_argnames=("chunk", "l2_norm"))


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


@pytest.mark.parametrize("length", [1, 17, 40])
def test_both_forms_match_transformers(length):
    """Float32 against transformers' recurrent form in float64 (its chunked form agrees with it): outputs and the
    final state; chunks of 16, so lengths cross their boundaries."""
    x = random_inputs(np.random.default_rng(length), length)
    expected_out, expected_state = transformers_recurrent(x)
    args = [jnp.asarray(x[name]) for name in ("q", "k", "v", "g", "beta", "state")]
    for out, state in (recurrent_gated_delta(*args), chunked_gated_delta(*args, chunk=16)[:2]):
        np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state), expected_state, rtol=1e-5, atol=1e-6)


def test_a_sequence_split_in_two_calls_carries_its_state():
    """Prefill in chunks (the engine's chunked prefill) then decode one token at a time: the state each call hands
    on gives the outputs one call over the whole sequence gives."""
    x = random_inputs(np.random.default_rng(5), 37)
    whole, final, _ = chunked_gated_delta(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "state")),
                                          chunk=16)
    part = {name: jnp.asarray(value[:, :30]) for name, value in x.items() if name != "state"}
    first, state, _ = chunked_gated_delta(**part, state=jnp.asarray(x["state"]), chunk=16)
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
    for _, state in (recurrent_gated_delta(*args), chunked_gated_delta(*args, chunk=16)[:2]):
        np.testing.assert_allclose(np.asarray(state), np.asarray(expected), rtol=1e-5, atol=1e-5)


def reference_states(x: dict[str, np.ndarray], row: int) -> list[np.ndarray]:
    """Row `row`'s state after each of its tokens, token by token in float64 (numpy)."""
    q, k = (x[name][row].astype(np.float64) for name in ("q", "k"))
    repeats = x["v"].shape[2] // q.shape[1]
    q, k = (np.repeat(a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6), repeats, axis=1) for a in (q, k))
    v, g, beta = (x[name][row].astype(np.float64) for name in ("v", "g", "beta"))
    state, states = x["state"][row].astype(np.float64), []
    for t in range(q.shape[0]):
        state = state * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        states.append(state)
    return states


def test_shifted_rows_keep_the_state_after_each_chunk():
    """With offsets, row b's tokens come after `offsets[b]` padding tokens: the outputs and final state are the
    unshifted ones, and the state kept after chunk j is the state after the row's first 16(j+1) - offset tokens
    (its chunks end at positions that are multiples of 16 when its first position is offset mod 16), against a
    float64 token-by-token reference."""
    x = random_inputs(np.random.default_rng(11), 37)
    args = [jnp.asarray(x[name]) for name in ("q", "k", "v", "g", "beta", "state")]
    offsets = np.array([5, 0], np.int32)
    out, final, states = chunked_gated_delta(*args, chunk=16, offsets=jnp.asarray(offsets))
    expected_out, expected_final = transformers_recurrent(x)
    np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), expected_final, rtol=1e-5, atol=1e-5)
    assert states.shape == (2, 4, 4, 16, 8)  # (37 + 15) / 16 rounded up
    for row, offset in enumerate(offsets):
        expected = reference_states(x, row)
        for block in range(4):
            tokens = min(16 * (block + 1) - offset, 37)
            np.testing.assert_allclose(np.asarray(states[row, block]), expected[tokens - 1], rtol=1e-5, atol=1e-5)


def hf_layer(seed: int = 0):
    """transformers' Gated DeltaNet layer of a small Qwen3-Next config (2 key heads, 4 value heads), random weights
    (the decay parameters too)."""
    import transformers

    config = transformers.Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                                          linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                          num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    layer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return config, layer


def our_layer(config, layer):
    """Our layer on transformers' weights (fused into the serving layout as the engine fuses them), over a state
    pool of two slots: `run(x, state, start, lens) -> (out, state)` for rows 0 and 1 starting at position `start`."""
    from jaxserve.config import LinearAttentionConfig
    from jaxserve.distributed.tensor_parallel import TensorParallel
    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.layers.gated_deltanet import GatedDeltaNet
    from jaxserve.layers.state_slots import StateSlots
    from jaxserve.models.qwen3_next import fuse_linear_attention

    linear = LinearAttentionConfig(config.linear_num_key_heads, config.linear_num_value_heads,
                                   config.linear_key_head_dim, config.linear_value_head_dim,
                                   config.linear_conv_kernel_dim)
    module = GatedDeltaNet(linear, config.hidden_size, config.rms_norm_eps)
    weights = {name: jnp.asarray(value.detach().numpy()) for name, value in layer.state_dict().items()}
    checkpoint = {"in_proj_qkvz": {"kernel": weights["in_proj_qkvz.weight"].T},
                  "in_proj_ba": {"kernel": weights["in_proj_ba.weight"].T},
                  "conv1d": weights["conv1d.weight"], "dt_bias": weights["dt_bias"], "A_log": weights["A_log"],
                  "norm": weights["norm.weight"], "out_proj": {"kernel": weights["out_proj.weight"].T}}
    params = fuse_linear_attention(checkpoint, types.SimpleNamespace(linear_attention=linear), TensorParallel())
    state = StateSlots(jnp.full((2, linear.conv_channels, linear.conv_kernel - 1), jnp.nan),  # poisoned: a fresh
                       jnp.full((2, linear.value_heads, linear.key_dim, linear.value_dim), jnp.nan))  # row reads none

    @jax.jit
    def run(x, state, start, lens):
        tokens = x.shape[1]
        positions = jnp.broadcast_to(start + jnp.arange(tokens, dtype=jnp.int32), (2, tokens))
        meta = AttentionMetadata(positions=positions, slot_mapping=jnp.zeros((2, tokens), jnp.int32),
                                 page_tables=jnp.zeros((2, 1), jnp.int32), context_lens=start + lens,
                                 query_lens=lens, state_slots=jnp.arange(2, dtype=jnp.int32))
        return module.apply({"params": params}, x, state, meta)
    return run, state


def test_the_layer_matches_transformers_and_carries_its_states():
    """A prompt of 70 tokens (two chunks) equals transformers' layer; the same prompt as a 40-token chunk, a 27-token
    chunk padded to 32 and three one-token decode steps, each step from the states the last one left in the slots,
    equals it too; the padding changes no state."""
    config, layer = hf_layer()
    run, state = our_layer(config, layer)
    x = np.random.default_rng(3).standard_normal((2, 70, 64)).astype(np.float32)
    with torch.no_grad():
        expected = layer(torch.from_numpy(x)).numpy()
    whole, _ = run(jnp.asarray(x), state, 0, jnp.asarray([70, 70]))
    np.testing.assert_allclose(np.asarray(whole), expected, rtol=1e-5, atol=1e-5)
    outs = []
    first, state = run(jnp.asarray(x[:, :40]), state, 0, jnp.asarray([40, 40]))
    outs.append(first)
    padded = np.concatenate([x[:, 40:67], np.full((2, 5, 64), 7.0, np.float32)], axis=1)
    second, state = run(jnp.asarray(padded), state, 40, jnp.asarray([27, 27]))
    outs.append(second[:, :27])
    for t in range(67, 70):
        out, state = run(jnp.asarray(x[:, t:t + 1]), state, t, jnp.asarray([1, 1]))
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_the_unit_lower_inverse_is_the_float64_inverse(n):
    """The chunked form's UT transform (its system's inverse from matmuls), on entries of either sign up to 1."""
    strict = np.tril(np.random.default_rng(n).uniform(-1, 1, (3, n, n)), -1)
    expected = np.linalg.inv(np.eye(n) + strict)
    got = np.asarray(jax.jit(gated_delta.unit_lower_inverse)(jnp.asarray(strict, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    with pytest.raises(ValueError, match="power of two, got 3"):
        gated_delta.unit_lower_inverse(jnp.zeros((3, 3)))

"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (linear attention with a per-sequence state), as transformers'
`Qwen3NextGatedDeltaNet` computes it, over a batch of rows that each carry their state from step to step.

Per token: `in_proj_qkvz` and `in_proj_ba` (laid out per key head: each key head's q, k, then its value heads' v
and z; its value heads' b, then a), a causal depthwise convolution (`conv1d`, kernel `K`) with SiLU over the q, k
and v channels, `beta = sigmoid(b)`, the log decay `g = -exp(A_log) * softplus(a + dt_bias)`, the gated delta rule
(`layers/gated_delta.py`) with L2-normalized q and k, an RMS norm of each value head gated by `silu(z)`, and
`out_proj`. A row's state is the convolution's last `K - 1` inputs `[channels, K - 1]` and the rule's
`[value_heads, key_dim, value_dim]` matrix (float32); a step takes the states its rows had and returns the ones
their real tokens (`query_lens`) leave; padding tokens change neither.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.layers.gated_delta import chunked_gated_delta, recurrent_gated_delta
from jaxserve.layers.quant_dense import Linear

CHUNK_TOKENS = 64  # tokens per chunk of the chunked form (transformers' default)


class GatedDeltaNet(nn.Module):
    """`(x [B, T, hidden], conv_state [B, channels, K - 1], recurrent_state [B, value_heads, key_dim, value_dim],
    query_lens [B]) -> (out [B, T, hidden], conv_state, recurrent_state)`; a step of one token per row runs the
    recurrence, longer ones the chunked form."""

    hidden_size: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, conv_state: jax.Array, recurrent_state: jax.Array, query_lens: jax.Array):
        batch, tokens, _ = x.shape
        per_key = self.value_heads // self.key_heads  # value heads each key head serves
        qkvz = Linear(self.key_heads * (2 * self.key_dim + 2 * per_key * self.value_dim), dtype=self.dtype,
                      name="in_proj_qkvz")(x).reshape(batch, tokens, self.key_heads, -1)
        ba = Linear(2 * self.value_heads, dtype=self.dtype, name="in_proj_ba")(x).reshape(
            batch, tokens, self.key_heads, 2 * per_key)
        q, k, v, z = jnp.split(qkvz, [self.key_dim, 2 * self.key_dim, 2 * self.key_dim + per_key * self.value_dim],
                               axis=-1)
        b, a = jnp.split(ba, 2, axis=-1)
        mixed = jnp.concatenate([part.reshape(batch, tokens, -1) for part in (q, k, v)], axis=-1)  # [B, T, C]

        real = jnp.arange(tokens)[None, :] < query_lens[:, None]  # [B, T]
        weight = self.param("conv1d", nn.initializers.lecun_normal(), (mixed.shape[-1], self.conv_kernel),
                            self.dtype)
        mixed, conv_state = causal_conv(mixed, conv_state, weight, query_lens)
        q, k, v = jnp.split(nn.silu(mixed), [self.key_heads * self.key_dim, 2 * self.key_heads * self.key_dim],
                            axis=-1)
        q = q.reshape(batch, tokens, self.key_heads, self.key_dim)
        k = k.reshape(batch, tokens, self.key_heads, self.key_dim)
        v = v.reshape(batch, tokens, self.value_heads, self.value_dim)

        dt_bias = self.param("dt_bias", nn.initializers.ones, (self.value_heads,), jnp.float32)
        a_log = self.param("A_log", nn.initializers.zeros, (self.value_heads,), jnp.float32)
        beta = jnp.where(real[..., None], jax.nn.sigmoid(b.reshape(batch, tokens, -1).astype(jnp.float32)), 0.0)
        g = -jnp.exp(a_log) * jax.nn.softplus(a.reshape(batch, tokens, -1).astype(jnp.float32) + dt_bias)
        g = jnp.where(real[..., None], g, 0.0)  # padding tokens leave the state as it is
        rule = recurrent_gated_delta if tokens == 1 else (
            lambda *args: chunked_gated_delta(*args, chunk=CHUNK_TOKENS))
        out, recurrent_state = rule(q, k, v, g, beta, recurrent_state)

        norm = self.param("norm", nn.initializers.ones, (self.value_dim,), self.dtype)
        variance = jnp.mean(out * out, axis=-1, keepdims=True)
        out = (out * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype) * norm
        out = out.astype(jnp.float32) * nn.silu(z.reshape(out.shape).astype(jnp.float32))
        out = out.astype(self.dtype).reshape(batch, tokens, self.value_heads * self.value_dim)
        return Linear(self.hidden_size, dtype=self.dtype, name="out_proj")(out), conv_state, recurrent_state


def causal_conv(x: jax.Array, state: jax.Array, weight: jax.Array, query_lens: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution of `x [B, T, C]` with `weight [C, K]`, each row continuing from its `state [B,
    C, K - 1]` (its last `K - 1` inputs); returns the outputs and each row's inputs ending at its last real token."""
    kernel = weight.shape[-1]
    inputs = jnp.concatenate([state.swapaxes(1, 2).astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    windows = jnp.stack([inputs[:, i:i + x.shape[1]] for i in range(kernel)], axis=-1)  # [B, T, C, K]
    out = jnp.einsum("btck,ck->btc", windows.astype(jnp.float32), weight.astype(jnp.float32)).astype(x.dtype)
    new_state = jax.vmap(lambda row, length: jax.lax.dynamic_slice_in_dim(row, length, kernel - 1, axis=0))(
        inputs, query_lens.astype(jnp.int32))  # inputs [len, len + K - 1): the last K - 1 up to the last real one
    return out, new_state.swapaxes(1, 2).astype(state.dtype)

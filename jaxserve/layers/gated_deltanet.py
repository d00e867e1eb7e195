"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (linear attention with a per-sequence state), as transformers'
`Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet` compute it, over a batch of rows that each carry their state from
step to step in the engine's state slots (`layers/state_slots.py`).

Per token: one fused in-projection (`in_proj`, the serving layout: each device's columns together, `[q_d | k_d |
v_d | z_d | b_d | a_d]` for its key heads and their value heads), a causal depthwise convolution (`conv1d`, kernel
`K`, channels in the same per-device order) with SiLU over the q, k and v channels, `beta = sigmoid(b)`, the log
decay `g = -exp(A_log) * softplus(a + dt_bias)`, the gated delta rule (`layers/gated_delta.py`) with L2-normalized
q and k, an RMS norm of each value head gated by `silu(z)`, and `out_proj`. Tensor parallelism splits the key heads
(and so their value heads, channels and states) over the devices; `out_proj` splits on its input features.
A row's state is the convolution's last `K - 1` inputs `[channels, K - 1]` and the rule's `[value_heads, key_dim,
value_dim]` matrix (float32); a step reads the states its rows had and writes the ones their real tokens
(`query_lens`) leave; padding tokens change neither. A verify step (speculative decoding) keeps the state after each
of its tokens, in the rows `meta.state_writes` names, since which of them its sequence goes on from is known only
once its drafts are accepted.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.config import LinearAttentionConfig
from jaxserve.layers.gated_delta import chunked_gated_delta, padded_blocks, recurrent_gated_delta
from jaxserve.layers.paged_kv import AttentionMetadata
from jaxserve.layers.quant_dense import Linear
from jaxserve.layers.state_slots import StateSlots

CHUNK_TOKENS = 64  # tokens per chunk of the chunked form (transformers' default); state checkpoints are kept at
# multiples of it (`engine/state_checkpoints.py`)


def save_blocks(tokens: int) -> int:
    """Chunks a prefill row of `tokens` tokens saving checkpoints computes (`state_saves`' second axis)."""
    return padded_blocks(tokens, CHUNK_TOKENS, offsets=True)


def projection_widths(la: LinearAttentionConfig, shards: int) -> tuple[int, ...]:
    """One device's q, k, v, z, b, a columns of `in_proj`, in order."""
    key, value, heads = la.key_heads * la.key_dim, la.value_heads * la.value_dim, la.value_heads
    return tuple(width // shards for width in (key, key, value, value, heads, heads))


class GatedDeltaNet(nn.Module):
    """`(x [B, T, hidden], state, meta) -> (out [B, T, hidden], state)`: rows read their state slots
    (`meta.state_slots`; zeros for a row starting its sequence) and write back what their tokens leave. A step of
    one token per row runs the recurrence, longer ones the chunked form."""

    config: LinearAttentionConfig
    hidden_size: int
    eps: float
    shards: int = 1  # devices the heads split over
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, state: StateSlots, meta: AttentionMetadata) -> tuple[jax.Array, StateSlots]:
        la, n = self.config, self.shards
        batch, tokens, _ = x.shape
        widths = projection_widths(la, n)
        projected = Linear(n * sum(widths), dtype=self.dtype, out_shards=n, name="in_proj")(x)
        projected = projected.reshape(batch, tokens, n, sum(widths))  # one row of columns per device
        splits = [sum(widths[:i]) for i in range(1, len(widths))]
        q, k, v, z, b, a = jnp.split(projected, splits, axis=-1)
        mixed = jnp.concatenate([q, k, v], axis=-1).reshape(batch, tokens, -1)  # [B, T, channels], per device

        query_lens, saves = meta.query_lens, meta.state_saves
        conv_state, recurrent_state = state.read(meta.state_slots, meta.positions[:, 0] == 0, meta.state_sources)
        weight = self.param("conv1d", nn.initializers.lecun_normal(), (la.conv_channels, la.conv_kernel),
                            self.dtype)
        per_token = meta.state_writes is not None  # a verify step: the state after each token is kept
        offsets = None if saves is None or per_token else meta.positions[:, 0] % CHUNK_TOKENS
        ends = None  # a saving prefill's chunk ends (or each token's end), relative to the row's first token: [B, N]
        if per_token:
            ends = jnp.broadcast_to(jnp.arange(1, tokens + 1)[None, :], (batch, tokens))
        elif saves is not None and tokens > 1:
            ends = CHUNK_TOKENS * jnp.arange(1, saves.shape[1] + 1)[None, :] - offsets[:, None]
        mixed, conv_state, conv_kept = causal_conv(mixed, conv_state, weight, query_lens, ends)
        q, k, v = jnp.split(nn.silu(mixed).reshape(batch, tokens, n, -1), splits[:2], axis=-1)
        q = q.reshape(batch, tokens, la.key_heads, la.key_dim)
        k = k.reshape(batch, tokens, la.key_heads, la.key_dim)
        v = v.reshape(batch, tokens, la.value_heads, la.value_dim)

        real = (jnp.arange(tokens)[None, :] < query_lens[:, None])[..., None]  # [B, T, 1]
        dt_bias = self.param("dt_bias", nn.initializers.ones, (la.value_heads,), jnp.float32)
        a_log = self.param("A_log", nn.initializers.zeros, (la.value_heads,), jnp.float32)
        beta = jnp.where(real, jax.nn.sigmoid(b.reshape(batch, tokens, -1).astype(jnp.float32)), 0.0)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
            a.reshape(batch, tokens, -1).astype(jnp.float32) + dt_bias.astype(jnp.float32))
        g = jnp.where(real, g, 0.0)  # padding tokens leave the state as it is
        if per_token:  # each token's state into the row it names; a checkpoint takes the first's (always accepted)
            outs = []  # token by token, each state written as it is made: states stacked over the tokens stayed
            # alive across the layers (`jaxserve compile`: 11.1 GiB of temporaries per device at 256 rows, K = 3,
            # for Qwen3-Next-80B on h200x8)
            for t in range(tokens):
                o, recurrent_state = recurrent_gated_delta(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                                           g[:, t:t + 1], beta[:, t:t + 1], recurrent_state)
                outs.append(o)
                if saves is not None and t == 0:
                    state = state.save(saves[:, 0], conv_kept[:, 0], recurrent_state)
                state = state.write(meta.state_writes[:, t], conv_kept[:, t], recurrent_state)
            out = jnp.concatenate(outs, axis=1)
        elif tokens == 1:
            out, recurrent_state = recurrent_gated_delta(q, k, v, g, beta, recurrent_state)
            if saves is not None:  # a decode: the state after its token, where its position ends a checkpoint's span
                state = state.save(saves[:, 0], conv_state, recurrent_state)
        else:
            out, recurrent_state, kept = chunked_gated_delta(q, k, v, g, beta, recurrent_state, chunk=CHUNK_TOKENS,
                                                             offsets=offsets)
            if saves is not None:  # a prefill: the states after the chunks that end where checkpoints do
                state = state.save(saves.reshape(-1), conv_kept.reshape(-1, *conv_state.shape[1:]),
                                   kept.reshape(-1, *kept.shape[2:]))

        scale = self.param("norm", nn.initializers.ones, (la.value_dim,), self.dtype)
        variance = jnp.mean(out * out, axis=-1, keepdims=True)
        out = (out * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype) * scale
        out = out.astype(jnp.float32) * nn.silu(z.reshape(out.shape).astype(jnp.float32))
        out = out.astype(self.dtype).reshape(batch, tokens, la.value_heads * la.value_dim)
        out = Linear(self.hidden_size, dtype=self.dtype, in_shards=n, name="out_proj")(out)
        # the pools' writes done before the next layer runs: left to the scheduler, XLA kept every layer's new
        # states (rows x state) alive to the step's end (`jaxserve compile`: 2.28 GiB of temporaries per device at
        # 256 rows for Qwen3-Next on h200x8)
        if not per_token:
            state = state.write(meta.state_slots, conv_state, recurrent_state)
        return jax.lax.optimization_barrier((out, state))


def causal_conv(x: jax.Array, state: jax.Array, weight: jax.Array, query_lens: jax.Array,
                ends: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Depthwise causal convolution of `x [B, T, C]` with `weight [C, K]`, each row continuing from its `state [B,
    C, K - 1]` (its last `K - 1` inputs); returns the outputs, each row's state after its last real token, and with
    `ends [B, N]` its states after its first `ends[b, n]` tokens `[B, N, C, K - 1]` (else None)."""
    kernel = weight.shape[-1]
    inputs = jnp.concatenate([state.swapaxes(1, 2).astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    windows = jnp.stack([inputs[:, i:i + x.shape[1]] for i in range(kernel)], axis=-1)  # [B, T, C, K]
    out = jnp.einsum("btck,ck->btc", windows.astype(jnp.float32), weight.astype(jnp.float32)).astype(x.dtype)

    def after(row: jax.Array, length: jax.Array) -> jax.Array:  # inputs [len, len + K - 1): the K - 1 before len
        return jax.lax.dynamic_slice_in_dim(row, length, kernel - 1, axis=0).swapaxes(0, 1).astype(state.dtype)
    kept = None if ends is None else jax.vmap(jax.vmap(after, in_axes=(None, 0)))(inputs, ends.astype(jnp.int32))
    return out, jax.vmap(after)(inputs, query_lens.astype(jnp.int32)), kept

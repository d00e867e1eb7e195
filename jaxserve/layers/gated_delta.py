"""The gated delta rule (Gated DeltaNet: Qwen3-Next's and Qwen3.5's linear-attention layers), as pure functions of
the inputs and a per-sequence recurrent state: one token at a time (`recurrent_gated_delta`, decode and the
reference) and a chunk of tokens at a time (`chunked_gated_delta`, prefill: the WY / UT-transform form).

Per value head, with `S` the state `[key_dim, value_dim]` (float32), each token `t` does
`S <- exp(g_t) * S`, `S <- S + k_t (beta_t * (v_t - S^T k_t))^T` and outputs `S^T q_t`, with q and k L2-normalized
(when asked) and q scaled by `key_dim ** -0.5`. Key heads serve `value_heads / key_heads` consecutive value heads
each (grouped, as GQA's). A token with `g = 0` and `beta = 0` leaves the state as it is: padding tokens of a batch
are given those, so a row's state is what its real tokens made it.

The chunked form computes the same sums in another order: inside a chunk of `chunk` tokens a unit lower-triangular
system (the UT transform) turns the chunk's delta-rule updates into matmuls, and a scan carries the state across
chunks; it matches the recurrent form to float32 rounding (`tests/test_gated_delta.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

L2_EPS = 1e-6  # transformers' (and the FLA library's) l2norm epsilon
_matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)


def l2_normalized(x: jax.Array) -> jax.Array:
    """`x / sqrt(sum(x^2) + 1e-6)` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _prepared(q, k, v, g, beta, l2_norm: bool):
    """Float32 `[B, value_heads, T, ...]` inputs: key heads repeated over their value heads, q and k normalized,
    q scaled."""
    value_heads = v.shape[2]
    repeats = value_heads // k.shape[2]
    q, k = (jnp.repeat(x, repeats, axis=2) if repeats > 1 else x for x in (q, k))
    q, k, v, g, beta = (x.astype(jnp.float32).swapaxes(1, 2) for x in (q, k, v, g, beta))
    if l2_norm:
        q, k = l2_normalized(q), l2_normalized(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                          state: jax.Array, l2_norm: bool = True) -> tuple[jax.Array, jax.Array]:
    """`(out [B, T, value_heads, value_dim] float32, state)` token by token.

    q, k: `[B, T, key_heads, key_dim]`; v: `[B, T, value_heads, value_dim]`; g (log decay, <= 0) and beta:
    `[B, T, value_heads]`; state: `[B, value_heads, key_dim, value_dim]` float32, the sequence's state before the
    first token."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_norm)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t = token  # [B, H, D] and [B, H]
        state = state * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)) * beta_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    tokens = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state.astype(jnp.float32), tokens)
    return jnp.moveaxis(out, 0, 1), state


def padded_blocks(length: int, chunk: int, offsets: bool) -> int:
    """Chunks of `chunk` tokens `chunked_gated_delta` computes for `length` tokens, each row shifted right by up to
    `chunk - 1` padding tokens when it is given `offsets`."""
    return -(-(length + (chunk - 1 if offsets else 0)) // chunk)


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """`(I + strict)^-1` for strictly lower-triangular `strict [..., n, n]` (n a power of two), in matmuls:
    `(I - N)(I + N^2)(I + N^4)...`, exact once `N^n = 0`. Not `solve_triangular`: on the CPU its kernel waits on
    XLA's intra-op threads from inside them, and two devices' prefills on a two-thread pool never finish (issue 68)."""
    n = strict.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the chunk must be a power of two, got {n}")
    eye = jnp.eye(n, dtype=strict.dtype)
    inverse, power = eye - strict, strict
    for _ in range(n.bit_length() - 2):  # powers 2, 4, ..., n / 2
        power = _matmul(power, power)
        inverse = _matmul(inverse, eye + power)
    return inverse


def chunked_gated_delta(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                        chunk: int = 64, l2_norm: bool = True, offsets: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`recurrent_gated_delta`'s result, `chunk` tokens at a time (T padded to a multiple of it with tokens that
    change nothing), and with `offsets [B]` each row's state after each of its chunks `[B, chunks, value_heads,
    key_dim, value_dim]` (else None): row b's tokens then come after `offsets[b]` padding tokens, so that its
    chunks end where its positions do at multiples of `chunk` (offset: its first position modulo `chunk`)."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_norm)
    batch, heads, length, key_dim = k.shape
    chunks = padded_blocks(length, chunk, offsets is not None)
    if offsets is None:
        pad = chunks * chunk - length
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    else:  # token t of row b at index t + offsets[b]; the rest change nothing
        source = jnp.arange(chunks * chunk)[None, :] - offsets[:, None]  # [B, L]
        inside = (source >= 0) & (source < length)

        def shifted(x):
            taken = jnp.take_along_axis(x, jnp.clip(source, 0, length - 1).reshape(
                batch, 1, -1, *(1,) * (x.ndim - 3)), axis=2)
            return jnp.where(inside.reshape(batch, 1, -1, *(1,) * (x.ndim - 3)), taken, 0.0)
        q, k, v, g, beta = (shifted(x) for x in (q, k, v, g, beta))

    def split(x):  # [B, H, T, ...] -> [chunks, B, H, chunk, ...]
        return jnp.moveaxis(x.reshape(batch, heads, chunks, chunk, *x.shape[3:]), 2, 0)

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    decay = jnp.cumsum(g, axis=-1)  # [.., chunk]: log of the decay from the chunk's start through each token
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pairwise = jnp.where(causal, jnp.exp(jnp.where(causal, decay[..., :, None] - decay[..., None, :], 0.0)), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strictly = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    # the UT transform: the inverse of I + the chunk's strictly lower interactions
    inverse = unit_lower_inverse(jnp.where(strictly, jnp.einsum("...ik,...jk->...ij", k_beta, k) * pairwise, 0.0))
    values = _matmul(inverse, v_beta)
    k_decayed = _matmul(inverse, k_beta * jnp.exp(decay)[..., None])
    attention = jnp.einsum("...ik,...jk->...ij", q, k) * pairwise
    q_decayed = q * jnp.exp(decay)[..., None]
    k_to_end = k * jnp.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = jnp.exp(decay[..., -1])[..., None, None]

    def step(state, inputs):
        values, k_decayed, attention, q_decayed, k_to_end, chunk_decay = inputs
        new = values - k_decayed @ state
        out = q_decayed @ state + attention @ new
        return state * chunk_decay + jnp.swapaxes(k_to_end, -1, -2) @ new, out

    def step_keeping(state, inputs):
        state, out = step(state, inputs)
        return state, (out, state)

    inputs = (values, k_decayed, attention, q_decayed, k_to_end, chunk_decay)
    if offsets is None:
        state, out = jax.lax.scan(step, state.astype(jnp.float32), inputs)
        states = None
    else:
        state, (out, states) = jax.lax.scan(step_keeping, state.astype(jnp.float32), inputs)
        states = jnp.moveaxis(states, 0, 1)  # [B, chunks, H, key_dim, value_dim]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, chunks * chunk, -1)
    if offsets is None:
        out = out[:, :, :length]
    else:
        index = (jnp.arange(length)[None, :] + offsets[:, None]).reshape(batch, 1, length, 1)
        out = jnp.take_along_axis(out, index, axis=2)
    return out.swapaxes(1, 2), state, states

"""Normalization layers."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """`x` over its root mean square on the last axis, in float32, with no scale (Gemma 4's value and router
    norms)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32, scaled by a learned `scale` (init 1):
    the normed value cast to `dtype`, then scaled (Llama's order); with `offset` (Gemma's `1 + w`) or
    `scale_float32` (Gemma 4's `w`) scaled by `offset + scale` in float32, then cast."""

    eps: float
    dtype: Any
    offset: float = 0.0
    scale_float32: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        normed = rms_normalize(x, self.eps)
        if self.offset or self.scale_float32:
            return (normed * (self.offset + scale.astype(jnp.float32))).astype(self.dtype)
        return scale * normed.astype(self.dtype)

"""The dense gated feed-forward (`down(act(gate(x)) * up(x))`: SwiGLU with silu, GeGLU with tanh-approximated gelu):
a dense decoder layer's MLP, and the shared expert of a mixture of experts."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.quant_dense import Linear


def gate_activation(name: str):
    """The gate's activation named in `config.ACTIVATIONS`."""
    return {"silu": nn.silu, "gelu_tanh": lambda x: nn.gelu(x, approximate=True)}[name]


class MLP(nn.Module):
    """A gated feed-forward of `width` columns over `[..., hidden]`: `gate_up_proj [hidden, 2 * width]` holds each
    device's gate and up columns together (`[gate_d | up_d]` for device d), `down_proj [width, hidden]` splits on
    its input."""

    hidden_size: int
    width: int
    tp: TensorParallel
    dtype: Any
    activation: str = "silu"  # or "gelu_tanh" (`config.ACTIVATIONS`)

    @nn.compact
    def __call__(self, x):
        shards = self.tp.size
        gate_up = Linear(2 * self.width, dtype=self.dtype, out_shards=shards, name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up.reshape(*x.shape[:-1], shards, -1), 2, axis=-1)  # [..., device, columns]
        hidden = (gate_activation(self.activation)(gate) * up).reshape(*x.shape[:-1], self.width)
        return Linear(self.hidden_size, dtype=self.dtype, in_shards=shards, name="down_proj")(hidden)

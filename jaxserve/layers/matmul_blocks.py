"""How the CPU's weight-only matmuls (int8 in `quant_dense`, AWQ int4 in `awq`) and its grouped expert matmul
(`moe`) cut a weight into blocks.

XLA:CPU does not fuse a convert into a dot, so there the quantized matmuls run as a `fori_loop` over blocks of
the weight, each dequantized and multiplied on its own (`blocked_matmuls`); a block holds at most `BLOCK_BYTES` of
float (cache-resident) and there are at most `MAX_BLOCKS` of them (`num_blocks`).
"""

from __future__ import annotations

import jax

BLOCK_BYTES = (256 << 10, 1 << 20)  # float bytes of one converted block in the CPU loop: up to 16 rows, more rows
MAX_BLOCKS = 64  # more iterations than this cost more in loop overhead than the blocks save


def lowering_platform() -> str:
    """The platform a step being traced now will run on: the default device's (`jaxserve compile` makes a target's
    device the default, with jax's backend still the CPU), else jax's backend."""
    device = jax.config.jax_default_device
    return getattr(device, "platform", device) or jax.default_backend()


def blocked_matmuls() -> bool:
    """Whether weight matmuls that XLA would not fuse run as a loop over blocks: on XLA:CPU, which fuses neither a
    convert nor a dynamic slice into a dot (and lowers `ragged_dot` densely)."""
    return lowering_platform() == "cpu"


def block_budget(rows: int) -> int:
    """The float bytes of one block for a matmul of `rows` activation rows."""
    return BLOCK_BYTES[rows > 16]


def num_blocks(length: int, other: int, itemsize: int, rows: int, budget: int | None = None) -> int:
    """How many equal blocks to cut `length` rows of `other` columns into: the fewest whose float size is at
    most the block budget (`budget` bytes, default that of a matmul of `rows` activation rows), at most
    MAX_BLOCKS (the count must divide `length`)."""
    fewest = -(-length * other * itemsize // (budget or block_budget(rows)))
    for blocks in range(max(1, fewest), min(length, MAX_BLOCKS) + 1):
        if length % blocks == 0:
            return blocks
    divisors = [d for d in range(1, min(length, MAX_BLOCKS) + 1) if length % d == 0]
    return max(divisors)

"""The AWQ int4 matmul: `y = x @ ((q - z) * s)`, weights kept 4-bit in device memory.

An AWQ linear layer (loaded by `jaxserve/loading/awq.py`) has three leaves, all in the natural column order:
`kernel` uint4 `[in, out]` (the quantized weights q), `zeros` uint4 `[in / group, out]` (z) and `scales` float
`[in / group, out]` (s), with `w[i, o] = (q[i, o] - z[i // group, o]) * s[i // group, o]`. XLA stores uint4 arrays
packed, two values a byte (the `E(4)` layout), so the weights take half a byte each on every backend.

As for int8 (`quant_dense.int8_matmul`), how the dequantization reaches the dot depends on the backend:

* elsewhere than XLA:CPU, the plain expression (dequantize the weight, one dot), left to XLA to fuse;
* XLA:CPU does not fuse a convert into a dot, so the matmul runs as a `fori_loop` over blocks of input rows
  (`matmul_blocks.BLOCK_BYTES` of float each, cache-resident): each iteration dequantizes one block and multiplies
  it, so no float copy of a whole weight exists. A block is whole groups, or, when one group's float rows exceed
  the block size, an equal part of one group; its zeros and scales are its groups' rows.

Accumulation is float32 either way. `in_shards` (row-parallel layers under tensor parallelism) becomes a leading
device axis of the blocked weight, so each device loops over its own rows and the all-reduce comes once, after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.layers import matmul_blocks


def dequantize(q: jax.Array, zeros: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """`(q - zeros) * scales` in `dtype` (broadcasting: zeros and scales carry one row per group)."""
    return (q.astype(dtype) - zeros.astype(dtype)) * scales.astype(dtype)


def block_layout(groups: int, group_size: int, fan_out: int, itemsize: int, rows: int) -> tuple[int, int]:
    """`(groups per block, blocks per group)` for one device's `groups` groups: whole groups per block while a
    group's float rows fit in a block, else each group cut into equal parts (one of the two counts is 1)."""
    budget = matmul_blocks.block_budget(rows)
    if group_size * fan_out * itemsize <= budget:
        return groups // matmul_blocks.num_blocks(groups, group_size * fan_out, itemsize, rows), 1
    return 1, matmul_blocks.num_blocks(group_size, fan_out, itemsize, rows)


def awq_matmul(x: jax.Array, kernel: jax.Array, zeros: jax.Array, scales: jax.Array,
               in_shards: int = 1) -> jax.Array:
    """`x [..., in] @ ((kernel - zeros) * scales)` per group of input rows, in `x.dtype`, float32 accumulation.

    `kernel` uint4 `[in, out]`, `zeros` uint4 and `scales` float `[in / group, out]`. `in_shards`: the devices the
    input features are split over (a row-parallel layer), which hold whole groups each (the loader checks it).
    """
    lead, fan_in = x.shape[:-1], x.shape[-1]
    groups, fan_out = scales.shape
    size = fan_in // groups
    rows = x.reshape(-1, fan_in)
    if not matmul_blocks.blocked_matmuls():
        w = dequantize(kernel.reshape(groups, size, fan_out), zeros[:, None], scales[:, None], x.dtype)
        y = jnp.dot(rows, w.reshape(fan_in, fan_out), preferred_element_type=jnp.float32)
        return y.astype(x.dtype).reshape(*lead, fan_out)
    n = in_shards if groups % in_shards == 0 else 1
    per_block, parts = block_layout(groups // n, size, fan_out, jnp.dtype(x.dtype).itemsize, rows.shape[0])
    outer, width = groups // (n * per_block), size // parts  # blocks of `per_block` groups x `width` rows
    xb = rows.reshape(rows.shape[0], n, outer, per_block, parts, width)
    qb = kernel.reshape(n, outer, per_block, parts, width, fan_out)
    zb = zeros.reshape(n, outer, per_block, 1, fan_out)
    sb = scales.reshape(n, outer, per_block, 1, fan_out)

    def block(j, acc):  # acc [n, rows, out]: each device's partial sums, added up once after the loop
        g, p = j // parts, j % parts

        def take(array, axis, index):
            return jax.lax.dynamic_index_in_dim(array, index, axis, keepdims=False)

        xj = take(take(xb, 2, g), 3, p).reshape(rows.shape[0], n, per_block * width)  # [rows, n, r]
        qj = take(take(qb, 1, g), 2, p)  # [n, per_block, width, out]
        wj = dequantize(qj, take(zb, 1, g), take(sb, 1, g), x.dtype).reshape(n, per_block * width, fan_out)
        if n == 1:  # a plain 2-D dot (XLA:CPU runs batched dots slower)
            return acc + jnp.dot(xj[:, 0], wj[0], preferred_element_type=jnp.float32)[None]
        return acc + jnp.einsum("bnr,nro->nbo", xj, wj, preferred_element_type=jnp.float32)

    y = jax.lax.fori_loop(0, outer * parts, block, jnp.zeros((n, rows.shape[0], fan_out), jnp.float32)).sum(0)
    return y.astype(x.dtype).reshape(*lead, fan_out)

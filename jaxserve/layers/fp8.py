"""Block-scaled FP8 weights (vLLM's `--quantization fp8` with DeepSeek-V3's fine-grained blocks): the format, which
linears take it, quantizing a float kernel into it, and the matmul that reads it.

A linear in FP8 is `{"kernel": float8_e4m3fn [in, out], "block_scale": float32 [in / bi, out / bo]}` (an expert
linear `[E, in, out]` with `[E, in / bi, out / bo]`): `w[i, o] = kernel[i, o] * block_scale[i // bi, o // bo]`, the
transpose of a HF checkpoint's `weight [out, in]` and `weight_scale_inv [out / bo, in / bi]` (its
`weight_block_size` is `[bo, bi]`). The blocks follow from the shapes, so the steps need no static argument; a
kernel whose blocks do not tile it exactly, on every device, stays float (`fp8_blocks_fit`).

The matmul dequantizes inside the step. XLA fuses neither the convert nor the scale into a dot's operand here
(H200 and v6e, `jaxserve compile`'s HLO): it writes a dequantized copy of the kernel that the dot reads back. So
on GPU a step of up to `KERNEL_ROWS` rows (decode) runs the grouped matmul's Triton kernel with one group, which
scales each tile's product in registers; more rows (prefill, compute-bound) and TPU take the dequantized copy; on
CPU, as a loop over blocks of input rows (`matmul_blocks`), each converted and scaled on its own, as the int8
matmul does. Activations stay in the serving
dtype (W8A16): the weights' bytes halve against bfloat16, and their precision is the checkpoint's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import AbstractMesh, PartitionSpec as P

from jaxserve.distributed.tensor_parallel import MODEL_AXIS
from jaxserve.layers import matmul_blocks
from pallas_kernels import ops

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
QUANTIZE_BLOCK = (128, 128)  # `--quantization fp8` of a float checkpoint: DeepSeek-V3's blocks (input, output)
KERNEL_ROWS = 128  # on GPU, up to one tile of rows (the weights read once) runs in the Pallas kernel


def blocks_of(kernel_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """`(bi, bo)`: the input rows and output columns of one block of a kernel with these block scales."""
    return kernel_shape[-2] // scale_shape[-2], kernel_shape[-1] // scale_shape[-1]


def fp8_blocks_fit(shape: tuple[int, ...], block: tuple[int, int], in_shards: int = 1, out_shards: int = 1) -> bool:
    """Whether blocks of `block` (input rows, output columns) tile a kernel `[..., in, out]` exactly, each device's
    part too when the input features are split `in_shards` ways and the output features `out_shards` ways."""
    fan_in, fan_out = shape[-2:]
    return (fan_in % in_shards == 0 and fan_out % out_shards == 0
            and (fan_in // in_shards) % block[0] == 0 and (fan_out // out_shards) % block[1] == 0)


def quantize_fp8(kernel: jax.Array, block: tuple[int, int] = QUANTIZE_BLOCK) -> tuple[jax.Array, jax.Array]:
    """`(float8 kernel, float32 block_scale)` of a float kernel `[..., in, out]` that `block` tiles: each block's
    scale is its largest magnitude / 448 (1 for an all-zero block), values rounded to nearest e4m3."""
    *lead, fan_in, fan_out = kernel.shape
    blocks = kernel.astype(jnp.float32).reshape(*lead, fan_in // block[0], block[0], fan_out // block[1], block[1])
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (blocks / scale[..., :, None, :, None]).astype(FP8)
    return q.reshape(kernel.shape), scale


def dequantize(kernel: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The float kernel `[..., in, out]` in `dtype` (scaled in float32)."""
    *lead, fan_in, fan_out = kernel.shape
    bi, bo = blocks_of(kernel.shape, scale.shape)
    blocks = kernel.astype(jnp.float32).reshape(*lead, fan_in // bi, bi, fan_out // bo, bo)
    return (blocks * scale[..., :, None, :, None]).reshape(kernel.shape).astype(dtype)


def kernel_matmul(rows: jax.Array, kernel: jax.Array, scale: jax.Array, in_shards: int, out_shards: int
                  ) -> jax.Array:
    """Float32 `rows [R, in] @ dequantize(kernel, scale)` by the grouped matmul's Triton kernel with one group, on
    each device's own columns (`out_shards`) or input rows (`in_shards`, the partial sums added up after): a
    Pallas call is not split by the compiler, which would gather the whole kernel onto every device first."""
    def local(rows, kernel, scale):
        y = ops.grouped_matmul(rows, kernel[None], jnp.full((1,), rows.shape[0], jnp.int32), block_scale=scale[None])
        return jax.lax.psum(y, MODEL_AXIS) if in_shards > 1 else y

    if in_shards == out_shards == 1:
        return local(rows, kernel, scale)
    split_in, split_out = P(None, MODEL_AXIS), P(MODEL_AXIS, None)
    specs = (split_in, split_out, split_out) if in_shards > 1 else (P(), split_in, split_in)
    mesh = AbstractMesh((max(in_shards, out_shards),), (MODEL_AXIS,))  # the engine's mesh: one axis
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P() if in_shards > 1 else split_in,
                         check_vma=False)(rows, kernel, scale)


def fp8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, in_shards: int = 1, out_shards: int = 1
               ) -> jax.Array:
    """`x [..., in] @ dequantize(kernel [in, out], scale)` in `x.dtype`, float32 accumulation.
    `in_shards` / `out_shards`: the devices the input features (a row-parallel layer) or the output features (a
    column-parallel one) are split over, so blocks never cross them and the kernel runs on each device's part."""
    lead, fan_in = x.shape[:-1], x.shape[-1]
    fan_out = kernel.shape[1]
    rows = x.reshape(-1, fan_in)
    if matmul_blocks.lowering_platform() == "gpu" and rows.shape[0] <= KERNEL_ROWS:
        # XLA:GPU writes the dequantized kernel out before its GEMM reads it (5 bytes moved per weight where
        # bfloat16 moves 2); the Triton kernel scales each tile's product as it multiplies
        y = kernel_matmul(rows, kernel, scale, in_shards, out_shards)
        return y.astype(x.dtype).reshape(*lead, fan_out)
    if not matmul_blocks.blocked_matmuls():
        y = jnp.dot(rows, dequantize(kernel, scale, x.dtype), preferred_element_type=jnp.float32)
        return y.astype(x.dtype).reshape(*lead, fan_out)
    bi, bo = blocks_of(kernel.shape, scale.shape)
    n = in_shards if (fan_in // bi) % in_shards == 0 else 1
    units = fan_in // (n * bi)  # scale rows per device
    k = matmul_blocks.num_blocks(units, bi * fan_out, jnp.dtype(x.dtype).itemsize, rows.shape[0])
    r = units // k  # scale rows per loop block
    xb = rows.reshape(rows.shape[0], n, k, r * bi)
    wb = kernel.reshape(n, k, r * bi, fan_out)
    sb = scale.reshape(n, k, r, fan_out // bo)

    def block(j, acc):  # acc [n, rows, out]: each device's partial sums, added up once after the loop
        xj = jax.lax.dynamic_index_in_dim(xb, j, 2, keepdims=False)  # [rows, n, r * bi]
        wj = dequantize(jax.lax.dynamic_index_in_dim(wb, j, 1, keepdims=False),
                        jax.lax.dynamic_index_in_dim(sb, j, 1, keepdims=False), x.dtype)  # [n, r * bi, out]
        if n == 1:  # a plain 2-D dot (XLA:CPU runs batched dots slower)
            return acc + jnp.dot(xj[:, 0], wj[0], preferred_element_type=jnp.float32)[None]
        return acc + jnp.einsum("bnr,nro->nbo", xj, wj, preferred_element_type=jnp.float32)

    y = jax.lax.fori_loop(0, k, block, jnp.zeros((n, rows.shape[0], fan_out), jnp.float32)).sum(0)
    return y.astype(x.dtype).reshape(*lead, fan_out)


def split_ways(spec, axis: int, shards: int) -> int:
    """How many ways a `PartitionSpec` splits `axis` of its array (negative from the end) on `shards` devices."""
    entries = tuple(spec) if spec is not None else ()
    index = axis + len(entries) if axis < 0 else axis
    return shards if 0 <= index < len(entries) and entries[index] is not None else 1


def quantize_linears(tree: dict, specs: dict | None, shards: int, keep_float: tuple[str, ...],
                     block: tuple[int, int] = QUANTIZE_BLOCK) -> dict:
    """`tree` (a decoder layer's params, serving layout) with every linear's kernel `[in, out]` or experts' `[E, in,
    out]` in FP8 blocks of `block`, where they tile it on every device (`specs`: the tree's `PartitionSpec`s on
    `shards` devices); the linears named in `keep_float`, biases and norms stay float."""
    out = {}
    for name, value in tree.items():
        spec = specs.get(name) if specs is not None else None
        if not isinstance(value, dict) or name in keep_float:
            out[name] = value
        elif "kernel" in value and value["kernel"].ndim in (2, 3) and "scale" not in value and fp8_blocks_fit(
                value["kernel"].shape, block, *(split_ways(spec and spec["kernel"], axis, shards) for axis in (-2, -1))):
            kernel, scale = quantize_fp8(value["kernel"], block)
            out[name] = {**value, "kernel": kernel, "block_scale": scale}
        else:
            out[name] = quantize_linears(value, spec, shards, keep_float, block)
    return out

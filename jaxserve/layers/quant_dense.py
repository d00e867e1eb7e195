"""Weight-only int8 (W8A16): symmetric, per output channel, quantized once at load time; layers that read either
float or int8 weights.

* `quantize_params(group)` turns a serving-layout parameter group into int8: every dense kernel
  (`[in, out]`) becomes `{"kernel": int8 [in, out], "scale": float32 [out]}` with
  `kernel * scale ~= w` (scale = max |w| over the input features / 127, rounded to nearest), every expert kernel
  `[E, in, out]` the same per expert (scale `[E, out]`; a mixture of experts' router stays float), the
  embedding table `[vocab, hidden]` the same per row (one scale per token, which is also per output
  channel of a tied LM head). Biases and norms stay float.
* `Linear` and `Embedding` are `nn.Dense` / `nn.Embed` with the same parameter names, initializers and float
  arithmetic; given a `scale` leaf (the tree `quantize_params` made) they run the int8 path instead. The mode is
  carried by the parameter tree itself, so the jitted steps need no extra static argument.

The int8 matmul reads the int8 kernel from memory and applies the scale to the output columns after the dot:
`y = (x @ w_int8.astype(x.dtype)) * scale`. How the convert reaches the dot depends on the backend:

* XLA:GPU fuses a convert feeding a dot operand into the GEMM (Triton GEMM fusion), so the plain expression
  is used there.
* XLA:CPU does not (measured, jax 0.10.2): the convert becomes its own loop fusion writing a float copy of the
  whole matrix every step, then the dot reads it back (576x3072 at batch 1: 0.52 ms against 0.23 ms for the
  float32 dot). `dot_general` with an int8 operand and `preferred_element_type` lowers to the same convert + dot,
  and neither `--xla_cpu_use_xnnpack`, the xnn/ynn/onednn `..._fusion_type=LIBRARY_FUSION_TYPE_DOT,..._ELTWISE`
  flags nor `sum(x[..., None] * w)` (a reduce fusion: 13 ms) changes that. So on CPU the matmul runs as a
  `fori_loop` over contiguous blocks of the kernel's major axis (input rows of a `[in, out]` kernel, vocabulary
  rows of the embedding used as an LM head): each iteration converts one block (`matmul_blocks.BLOCK_BYTES` of
  float, cache-resident) and multiplies it, so no float buffer of a whole weight ever exists (tests/test_quantization.py
  checks the compiled decode step). A Python-unrolled version compiled 12x slower and ran slower. The layers'
  blocked matmuls run at about float32's speed at batch 1 (the int8->float convert, not memory, is the limit);
  the blocked LM head is 3x faster than the float one, whose `x @ embedding.T` XLA:CPU runs slowly.

Under tensor parallelism the blocked loop never slices a sharded axis: `in_shards` / `out_shards` name how many
devices split the blocked axis, which becomes an explicit leading device axis of the reshaped kernel, so each
device loops over its own shard's blocks and row-parallel layers still all-reduce once, after the loop.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.layers import matmul_blocks
from jaxserve.layers.awq import awq_matmul
from jaxserve.layers.fp8 import FP8, fp8_matmul, quantize_linears
from jaxserve.layers.lora import lora_delta

QUANTIZE_EMBEDDING = True  # the embedding table (and so a tied LM head) too; benchmarks/quality.py measures both
FLOAT_LINEARS = ("router", "shared_expert_gate")  # tiny, and a rounded router may choose other experts
# linears a layer reads as matrices rather than multiplying by (MLA's kv_b_proj, split into its two halves): int8
# ones are dequantized in the step, FP8 ones on load
MATRIX_LINEARS = ("kv_b_proj",)


def quantize_int8(w: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 of `w` with one float32 scale per slice along `axis` (the axis reduced: the input features):
    `(q, scale)` with `q * expand(scale) ~= w`, |q| <= 127. An all-zero channel gets scale 1."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axis)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w32 / jnp.expand_dims(scale, axis)), -127, 127).astype(jnp.int8)
    return q, scale


def quantize_params(tree: dict, quantize_embedding: bool | None = None) -> dict:
    """A serving-layout parameter tree (or one group of it) with every dense kernel, and the embedding table
    unless `quantize_embedding` is False (default: `QUANTIZE_EMBEDDING`), in int8 with float32 scales."""
    if quantize_embedding is None:
        quantize_embedding = QUANTIZE_EMBEDDING
    if "kernel" in tree and tree["kernel"].ndim in (2, 3):  # [in, out], or every expert's [E, in, out]
        kernel, scale = quantize_int8(tree["kernel"], axis=tree["kernel"].ndim - 2)
        return {**tree, "kernel": kernel, "scale": scale}
    if "embedding" in tree:
        if not quantize_embedding:
            return tree
        embedding, scale = quantize_int8(tree["embedding"], axis=1)
        return {**tree, "embedding": embedding, "scale": scale}
    return {name: quantize_params(value, quantize_embedding) if isinstance(value, dict) and name not in FLOAT_LINEARS
            else value for name, value in tree.items()}


def cast_floats(tree: dict, dtype) -> dict:
    """`tree` with its floating leaves in `dtype`; quantized weights (integer or float8) and FP8 block scales
    (float32) as they are."""
    def cast(path, x):
        keep = (not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize == 1
                or getattr(path[-1], "key", None) == "block_scale")
        return x if keep else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, tree)


def serving_weights(group: dict, quantization: str | None, specs: dict | None = None, shards: int = 1) -> dict:
    """A fused serving-layout group in the engine's `quantization` mode: int8 quantizes it here, and so does fp8
    (`fp8.quantize_linears`: `specs` and `shards` say how each leaf is split) unless the group holds FP8 leaves
    already (an FP8 checkpoint's, which decided); the float modes (None) and "awq" (whose checkpoint's 4-bit leaves
    the loader produced, `layers/awq.py`) keep it."""
    if quantization == "int8":
        return quantize_params(group)
    if quantization == "fp8" and not any(leaf.dtype == FP8 for leaf in jax.tree.leaves(group)):
        return quantize_linears(group, specs, shards, FLOAT_LINEARS + MATRIX_LINEARS)
    return group


def is_quantized(params: dict) -> bool:
    """Whether a parameter tree holds any int8 weight."""
    return any(leaf.dtype == jnp.int8 for leaf in jax.tree.leaves(params))


def int8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, in_shards: int = 1) -> jax.Array:
    """`x [..., in] @ (kernel int8 [in, out] * scale [out])` in `x.dtype`, float32 accumulation.

    `in_shards`: the devices the input features are split over (a row-parallel layer), so blocks never cross them.
    """
    lead, fan_in = x.shape[:-1], x.shape[-1]
    fan_out = kernel.shape[1]
    rows = x.reshape(-1, fan_in)
    if not matmul_blocks.blocked_matmuls():
        y = jnp.dot(rows, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        n = in_shards if fan_in % in_shards == 0 else 1
        k = matmul_blocks.num_blocks(fan_in // n, fan_out, jnp.dtype(x.dtype).itemsize, rows.shape[0])
        r = fan_in // (n * k)
        xb = rows.reshape(rows.shape[0], n, k, r)
        wb = kernel.reshape(n, k, r, fan_out)

        def block(j, acc):  # acc [n, rows, out]: each device's partial sums, added up once after the loop
            xj = jax.lax.dynamic_index_in_dim(xb, j, 2, keepdims=False)  # [rows, n, r]
            wj = jax.lax.dynamic_index_in_dim(wb, j, 1, keepdims=False).astype(x.dtype)  # [n, r, out]
            if n == 1:  # a plain 2-D dot (XLA:CPU runs batched dots slower)
                return acc + jnp.dot(xj[:, 0], wj[0], preferred_element_type=jnp.float32)[None]
            return acc + jnp.einsum("bnr,nro->nbo", xj, wj, preferred_element_type=jnp.float32)

        y = jax.lax.fori_loop(0, k, block, jnp.zeros((n, rows.shape[0], fan_out), jnp.float32)).sum(0)
    return (y * scale).astype(x.dtype).reshape(*lead, fan_out)


def int8_matmul_transposed(x: jax.Array, table: jax.Array, scale: jax.Array, out_shards: int = 1) -> jax.Array:
    """`x [..., in] @ (table int8 [out, in] * scale[out, None]).T` in `x.dtype`: a tied LM head over an int8
    embedding table. `out_shards`: the devices the table's rows (the vocabulary) are split over."""
    lead, fan_in = x.shape[:-1], x.shape[-1]
    fan_out = table.shape[0]
    rows = x.reshape(-1, fan_in)
    if not matmul_blocks.blocked_matmuls():
        y = jnp.dot(rows, table.astype(x.dtype).T, preferred_element_type=jnp.float32)
    else:
        n = out_shards if fan_out % out_shards == 0 else 1
        k = matmul_blocks.num_blocks(fan_out // n, fan_in, jnp.dtype(x.dtype).itemsize, rows.shape[0])
        v = fan_out // (n * k)
        wb = table.reshape(n, k, v, fan_in)

        def block(j, out):  # out [k, n, rows, v]: each block's logits written whole, along the major axis
            wj = jax.lax.dynamic_index_in_dim(wb, j, 1, keepdims=False).astype(x.dtype)  # [n, v, in]
            if n == 1:  # a plain 2-D dot (XLA:CPU runs batched dots slower)
                yj = jnp.dot(rows, wj[0].T, preferred_element_type=jnp.float32)[None]
            else:
                yj = jnp.einsum("bi,nvi->nbv", rows, wj, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_index_in_dim(out, yj, j, 0)

        y = jax.lax.fori_loop(0, k, block, jnp.zeros((k, n, rows.shape[0], v), jnp.float32))
        y = y.transpose(2, 1, 0, 3).reshape(rows.shape[0], fan_out)  # vocab id = (shard * k + block) * v + row
    return (y * scale).astype(x.dtype).reshape(*lead, fan_out)


class Linear(nn.Module):
    """`nn.Dense` (same names, initializers and float arithmetic) that also runs int8 weights: params `kernel`
    (float or int8 `[in, out]`), `scale` (float32 `[out]`, only when int8) and `bias` (float, optional); FP8
    weights: `kernel` float8 with `block_scale` (`layers/fp8.py`); or AWQ
    int4 weights: `kernel` uint4 `[in, out]` with `zeros` (uint4) and `scales` (float) `[in / group, out]`
    (`layers/awq.py`). `in_shards` / `out_shards`: devices the input features (row-parallel layers) or the output
    features (column-parallel ones) are split over. Given a
    "lora" collection (`lora/weights.py`: the adapters' stacked `a`, `b` and the rows' slot `mask`), each row adds
    its adapter's contribution (`layers/lora.py`), whatever the base weights' format."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    in_shards: int = 1
    out_shards: int = 1  # devices the output features are split over (column-parallel layers), for FP8's kernel

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "zeros"):
            y = awq_matmul(x.astype(self.dtype), *(self.get_variable("params", name)
                                                   for name in ("kernel", "zeros", "scales")), self.in_shards)
        elif self.has_variable("params", "block_scale"):
            y = fp8_matmul(x.astype(self.dtype), self.get_variable("params", "kernel"),
                           self.get_variable("params", "block_scale"), self.in_shards, self.out_shards)
        elif self.has_variable("params", "scale"):
            y = int8_matmul(x.astype(self.dtype), self.get_variable("params", "kernel"),
                            self.get_variable("params", "scale"), self.in_shards)
        else:
            kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.dtype)
            x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
            y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.has_variable("lora", "a"):
            y = y + lora_delta(x.astype(self.dtype), *(self.get_variable("lora", name) for name in ("a", "b", "mask")))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype)
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(self.dtype)
        return y


class Embedding(nn.Module):
    """`nn.Embed` (same name, initializer and float arithmetic) that also runs an int8 table: params `embedding`
    (float or int8 `[vocab, hidden]`) and `scale` (float32 `[vocab]`, only when int8).
    `vocab_shards`: devices the vocabulary is split over (the tied LM head's blocks stay within them)."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    vocab_shards: int = 1

    def setup(self):
        if self.has_variable("params", "scale"):
            self.embedding = self.get_variable("params", "embedding")
            self.scale = self.get_variable("params", "scale")
        else:
            self.embedding = self.param("embedding", nn.linear.default_embed_init,
                                        (self.num_embeddings, self.features), self.dtype)
            self.scale = None

    def __call__(self, ids: jax.Array) -> jax.Array:
        lookup = ids
        if self.vocab_shards > 1 and ids.size == 1:
            # XLA turns a one-row gather into a dynamic slice, which on a vocabulary split over devices gathers
            # the whole table onto each of them every step; two rows stay a gather of each device's own rows
            lookup = jnp.concatenate([ids.reshape(-1)] * 2)
        rows = jnp.take(self.embedding, lookup, axis=0).astype(self.dtype)
        if self.scale is not None:
            rows = (rows * jnp.take(self.scale, lookup, axis=0)[..., None]).astype(self.dtype)
        return rows[:1].reshape(*ids.shape, self.features) if lookup is not ids else rows

    def attend(self, query: jax.Array) -> jax.Array:
        if self.scale is not None:
            return int8_matmul_transposed(query.astype(self.dtype), self.embedding, self.scale, self.vocab_shards)
        query, embedding = nn.dtypes.promote_dtype(query, self.embedding, dtype=self.dtype)
        return jnp.dot(query, embedding.T)

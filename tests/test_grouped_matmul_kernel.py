"""The Triton grouped matmul (`pallas_kernels.ops.grouped_matmul`, the mixture-of-experts' GPU path) in Pallas'
interpreter against a float64 reference. The interpreter starts the output as NaN, so a row the kernel leaves
unwritten (a group's, or one past the groups' sum, which must be 0) fails the comparison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels.triton.grouped_matmul import block_size
from tests.test_moe import random_groups

CASES = [  # rows, groups, K, N, x dtype, kernel dtype
    (1, 1, 16, 16, "float32", "float32"),
    (7, 4, 48, 24, "float32", "int8"),  # K and N padded to the blocks
    (64, 16, 32, 32, "bfloat16", "bfloat16"),
    (100, 3, 32, 48, "bfloat16", "int8"),  # 100 rows: not a multiple of the 64-row blocks
    (40, 64, 16, 16, "float32", "bfloat16"),  # more groups than rows
]


def reference(x: np.ndarray, kernel: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    rows = len(group_of_row)
    out = np.zeros((x.shape[0], kernel.shape[2]))
    out[:rows] = np.einsum("rk,rkn->rn", x[:rows].astype(np.float64), kernel[group_of_row].astype(np.float64))
    return out


@pytest.mark.parametrize("num_rows, num_groups, fan_in, fan_out, x_dtype, kernel_dtype", CASES)
def test_grouped_matmul_matches_a_float64_reference(num_rows, num_groups, fan_in, fan_out, x_dtype, kernel_dtype):
    """Fresh random inputs each case, some groups empty, rows past the groups' sum."""
    rng = np.random.default_rng()
    sizes = random_groups(rng, num_rows, num_groups)
    x = jnp.asarray(rng.standard_normal((num_rows, fan_in)), x_dtype)
    if kernel_dtype == "int8":
        kernel = jnp.asarray(rng.integers(-127, 128, size=(num_groups, fan_in, fan_out)), jnp.int8)
    else:
        kernel = jnp.asarray(rng.standard_normal((num_groups, fan_in, fan_out)), kernel_dtype)
    ours = np.asarray(ops.grouped_matmul(x, kernel, jnp.asarray(sizes), interpret=True))
    # the reference multiplies what the kernel multiplies: x's values and the kernel converted to x's dtype
    expected = reference(np.asarray(x.astype(jnp.float32)), np.asarray(kernel.astype(x.dtype).astype(jnp.float32)),
                         sizes)
    scale = np.abs(expected).max(initial=1.0)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * scale)
    assert (ours[sizes.sum():] == 0).all()


@pytest.mark.parametrize("sizes", [[0, 0, 0], [0, 20, 0], [3, 0, 5]], ids=["all-empty", "one-group", "sum-below-rows"])
def test_rows_outside_every_group_are_zero(sizes):
    """16-row blocks: every block past the sum is zeroed by a program past the last tile, and the rest of the last
    group's block by that group's tile."""
    sizes = np.asarray(sizes, np.int32)
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)
    ours = np.asarray(ops.grouped_matmul(x, kernel, jnp.asarray(sizes), interpret=True))
    np.testing.assert_allclose(ours, reference(np.asarray(x), np.asarray(kernel), sizes), rtol=1e-5, atol=1e-5)


def test_block_sizes_divide_the_weights_when_they_can():
    """No padding (a copy of every expert's weights) where a power of two from 16 divides the dimension."""
    assert [block_size(n, 128) for n in (1536, 2880, 192, 96, 24, 8)] == [128, 64, 64, 32, 32, 16]
    assert block_size(2048, 64) == 64


def test_grouped_matmul_traces_under_jit():
    x, kernel = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16), jax.ShapeDtypeStruct((8, 64, 32), jnp.int8)
    out = jax.eval_shape(lambda *a: ops.grouped_matmul(*a, interpret=True), x, kernel,
                         jax.ShapeDtypeStruct((8,), jnp.int32))
    assert out.shape == (256, 32) and out.dtype == jnp.float32


@pytest.mark.parametrize("block", [(32, 16), (16, 32)])
def test_fp8_experts_with_block_scales_match_a_float64_reference(block):
    """The Triton kernel (interpret mode) and the CPU's tile loop each scale every block of an FP8 kernel by its
    own scale: equal to the float64 product with the dequantized kernel."""
    from jaxserve.layers.moe import tiled_grouped_matmul

    rng = np.random.default_rng()
    num_rows, num_groups, fan_in, fan_out = 50, 4, 64, 64
    sizes = random_groups(rng, num_rows, num_groups)
    x = jnp.asarray(rng.standard_normal((num_rows, fan_in)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((num_groups, fan_in, fan_out)), jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.1, 4.0, (num_groups, fan_in // block[0], fan_out // block[1])), jnp.float32)
    dequantized = (np.asarray(kernel, np.float64) * np.repeat(np.repeat(np.asarray(scale, np.float64), block[0], 1),
                                                               block[1], 2))
    expected = reference(np.asarray(x), dequantized, sizes)
    for ours in (ops.grouped_matmul(x, kernel, jnp.asarray(sizes), block_scale=scale, interpret=True),
                 tiled_grouped_matmul(x, kernel, jnp.asarray(sizes), scale)):
        np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

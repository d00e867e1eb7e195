"""The Mosaic GPU decode kernel (pallas_kernels/mosaic_gpu) without a GPU.

Numerics: Pallas' GPU interpreter (jax 0.10.2, ``InterpretGPUParams``) runs the kernel on the
CPU against the float64 numpy reference of tests/test_kernels.py, with poisoned pools (NaN or
huge values in every page and slot a sequence does not own) and NaN-filled fresh memory, so
an unwritten output or a read of foreign data fails.  The interpreter replaces the ``Q K^T``
wgmma and the layout annotations (see the kernel's docstring); the compiled path is checked
by lowering it for CUDA on the CPU, which builds the Mosaic GPU module (layouts, transforms,
wgmma shapes) and stops short of PTX.  Tiny shapes: the interpreter runs every op through
host callbacks.  On a GPU machine (``jax.default_backend() == "gpu"``, or
JAXSERVE_KERNEL_INTERPRET=0 as in tests/test_kernels.py) the reference tests run the compiled
kernel instead (it needs a Hopper GPU); the race test always runs in the interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpreter
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from pallas_kernels.mosaic_gpu import paged_attention
from tests.test_kernels import INTERPRET, assert_close, make_paged_kv, numpy_decode_reference

CASES = [
    # id, group, kv_heads, head_dim, page_size, dtype, pages_per_compute_block, num_splits, window, poison,
    # unowned, quantized pages
    ("bf16-gqa3-d64-p16-split2", 3, 2, 64, 16, "bfloat16", 4, 2, None, "nan", "poison_pages", None),
    ("f16-mqa8-d128-p8-window", 8, 1, 128, 8, "float16", 8, None, 70, "nan", "out_of_range", None),
    ("bf16-gqa1-d64-p64-huge", 1, 2, 64, 64, "bfloat16", None, None, None, "huge", "poison_pages", None),
    ("bf16-gqa2-d16-p8-split2", 2, 2, 16, 8, "bfloat16", None, 2, None, "nan", "poison_pages", None),
    ("int8-bf16-gqa4-d64-p16-split2", 4, 1, 64, 16, "bfloat16", 4, 2, None, "nan", "poison_pages", "int8"),
    ("fp8-f16-gqa2-d128-p32-window", 2, 2, 128, 32, "float16", 2, None, 100, "nan", "out_of_range", "fp8"),
]


def _inputs(group, kv_heads, head_dim, page_size, dtype, poison="nan", unowned="poison_pages", quant=None,
            seed=0):
    rng = np.random.default_rng([seed, group, head_dim, page_size])
    pages_per_seq = max(3, 256 // page_size)
    full = page_size * pages_per_seq
    lengths = [1, page_size - 1, page_size, page_size + 1, full, 0, 2 * page_size + 3]
    kv = make_paged_kv(rng, lengths, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       pages_per_seq=pages_per_seq, poison=poison, unowned=unowned,
                       int8=quant == "int8", fp8=quant == "fp8")
    q = jnp.asarray(rng.standard_normal((len(lengths), group * kv_heads, head_dim)), dtype)
    return q, kv, lengths


@pytest.mark.parametrize(
    "group,kv_heads,head_dim,page_size,dtype,ppcb,splits,window,poison,unowned,quant",
    [c[1:] for c in CASES], ids=[c[0] for c in CASES],
)
def test_decode_matches_float64_reference(group, kv_heads, head_dim, page_size, dtype, ppcb, splits,
                                          window, poison, unowned, quant):
    q, kv, lengths = _inputs(group, kv_heads, head_dim, page_size, dtype, poison, unowned, quant)
    out = paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        pages_per_compute_block=ppcb, num_splits=splits, sliding_window=window, interpret=INTERPRET,
        **kv.device(dtype),
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, sliding_window=window,
                                      **kv.host(dtype))
    assert np.isfinite(expected).all()
    assert_close(out, expected, "bfloat16", "mosaic gpu decode")  # 2e-2 relative, for bf16 and f16
    assert np.all(np.asarray(out[lengths.index(0)], np.float32) == 0.0), "length 0 must give zeros"


def test_sinks_join_the_split_merge():
    """Attention sinks (gpt-oss), binding, over two splits and an empty row, against the float64 reference."""
    q, kv, lengths = _inputs(2, 2, 64, 16, "bfloat16", seed=3)
    sinks = np.asarray([2.5, -1.0, 0.3, 6.0], np.float32)
    out = paged_attention(q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
                          pages_per_compute_block=4, num_splits=2, sinks=jnp.asarray(sinks), interpret=INTERPRET,
                          **kv.device("bfloat16"))
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, sinks=sinks,
                                      **kv.host("bfloat16"))
    plain = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, **kv.host("bfloat16"))
    assert np.abs(plain - expected).max() > 0.1  # the sinks bind
    assert_close(out, expected, "bfloat16", "mosaic gpu decode sinks")
    assert np.all(np.asarray(out[lengths.index(0)], np.float32) == 0.0), "length 0 must give zeros"


def test_no_races_and_batch_invariance():
    """The race detector finds nothing, and a row's output does not depend on the rest of the batch."""
    q, kv, lengths = _inputs(2, 1, 64, 16, "bfloat16", quant="int8", seed=1)
    args = dict(page_indices=jnp.asarray(kv.page_indices), pages_per_compute_block=4, num_splits=1,
                **kv.device("bfloat16"))
    full = paged_attention(q, lengths=jnp.asarray(lengths, jnp.int32), interpret=True, **args)
    row = 4  # the full-length row: 4 tiles through the 2-slot SMEM ring
    args["page_indices"] = args["page_indices"][row:row + 1]
    alone = paged_attention(q[row:row + 1], lengths=jnp.asarray(lengths[row:row + 1], jnp.int32),
                            interpret=InterpretGPUParams(detect_races=True), **args)
    assert not gpu_interpreter.get_races().races_found
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32), np.asarray(full[row], np.float32))


@pytest.mark.parametrize("dtype,head_dim,page_size,quant", [
    ("bfloat16", 128, 16, None), ("float16", 64, 64, None), ("bfloat16", 64, 16, "int8"),
    ("bfloat16", 128, 8, "fp8"), ("float16", 32, 16, None), ("bfloat16", 32, 16, "int8"),
])
def test_lowers_for_cuda_without_a_gpu(dtype, head_dim, page_size, quant):
    q, kv, lengths = _inputs(4, 2, head_dim, page_size, dtype, quant=quant)
    dev = kv.device(dtype)

    def decode(q, lengths, page_indices, dev):
        return paged_attention(q, lengths=lengths, page_indices=page_indices, num_splits=2, **dev)

    lowered = jax.jit(decode).trace(
        q, jnp.asarray(lengths, jnp.int32), jnp.asarray(kv.page_indices), dev
    ).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("change,match", [
    (dict(dtype="float32"), "bfloat16 or float16"),
    (dict(head_dim=8), "power of two >= 16"),
    (dict(head_dim=16, quant=True), "head_dim >= 32"),
    (dict(group=65), "at most 64"),
    (dict(page_size=4), "page_size must be >= 8"),
    (dict(head_dim=256), "SMEM"),  # even a 64-token tile overflows Hopper's 227 KiB
])
def test_rejects_unsupported_inputs(change, match):
    shape = dict(group=2, kv_heads=1, head_dim=64, page_size=16, dtype="bfloat16", quant=False) | change
    q = jnp.zeros((1, shape["group"] * shape["kv_heads"], shape["head_dim"]), shape["dtype"])
    pool_shape = (shape["kv_heads"], 4, shape["page_size"], shape["head_dim"])
    pages = jnp.zeros(pool_shape, jnp.int8 if shape["quant"] else shape["dtype"])
    scales = dict(k_scales=jnp.ones(pool_shape[:3]), v_scales=jnp.ones(pool_shape[:3])) if shape["quant"] else {}
    with pytest.raises(ValueError, match=match):
        paged_attention(q, pages, pages, jnp.ones((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32), **scales)

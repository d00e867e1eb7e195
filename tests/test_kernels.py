"""Checks of pallas_kernels against a float64 numpy reference.

On CPU the Pallas kernels run in interpret mode.  JAXSERVE_KERNEL_INTERPRET=0
runs them compiled (Triton, needs a GPU); =1 forces interpret mode; unset means
"interpret unless jax's default backend is a GPU".

Every kernel call here hands the kernel NaN-filled output buffers
(``poison_output=True``), and the K/V pools carry poisoned data (NaN or huge
values) in every page and slot a sequence does not own, with page tables that
point the unowned entries at poisoned pages (or at ids out of range), so both an
element left unwritten and a read of foreign data show up as a failure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels
from pallas_kernels import _planning as planning
from pallas_kernels.triton import decode as triton_decode
from pallas_kernels.triton import ragged as triton_ragged


def _interpret_mode() -> bool:
    flag = os.environ.get("JAXSERVE_KERNEL_INTERPRET", "").strip().lower()
    if flag == "":
        return jax.default_backend() != "gpu"
    return flag not in ("0", "false", "no", "off")


INTERPRET = _interpret_mode()
if not INTERPRET and jax.default_backend() != "gpu":
    pytest.skip(
        "JAXSERVE_KERNEL_INTERPRET=0 needs a GPU backend", allow_module_level=True
    )

TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2}
SCALED = (np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn))  # page dtypes that come with per-token scales
POISON = {"nan": np.nan, "huge": 3.0e4}  # huge stays finite in bf16 and after int8 scaling


# --------------------------------------------------------------------------- #
# float64 numpy references                                                     #
# --------------------------------------------------------------------------- #
def _dequantize(pages: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    pages = pages.astype(np.float64)
    if scales is not None:
        pages = pages * scales.astype(np.float64)[..., None]
    return pages


def _sequence_kv(pages: np.ndarray, table_row: np.ndarray, length: int) -> np.ndarray:
    """[kv_heads, length, D] float64 keys (or values) of one sequence, owned slots only."""
    page_size = pages.shape[2]
    owned = math.ceil(length / page_size)
    kv = pages[:, table_row[:owned]]  # [kv_heads, owned, page_size, D]
    return kv.reshape(pages.shape[0], owned * page_size, pages.shape[3])[:, :length]


def _softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, scale: float,
                    soft_cap: float | None = None, sink: float | None = None):
    """q [rows, D], k/v [keys, D], allowed bool[rows, keys] -> [rows, D]; empty rows -> 0; logits capped as
    soft_cap * tanh(x / soft_cap) when given; a sink is one more logit in every row's softmax, with no value."""
    out = np.zeros((q.shape[0], v.shape[1]))
    for r in range(q.shape[0]):
        keys = np.nonzero(allowed[r])[0]
        if keys.size == 0:
            continue
        logits = (k[keys] @ q[r]) * scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        top = logits.max() if sink is None else max(logits.max(), float(sink))
        p = np.exp(logits - top)
        denominator = p.sum() + (0.0 if sink is None else np.exp(float(sink) - top))
        out[r] = (p / denominator) @ v[keys]
    return out


def numpy_decode_reference(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None,
                           sliding_window=None, k_scales=None, v_scales=None, soft_cap=None, sinks=None) -> np.ndarray:
    q = np.asarray(q, np.float64)
    batch, num_q_heads, head_dim = q.shape
    k_all = _dequantize(np.asarray(k_pages), k_scales)
    v_all = _dequantize(np.asarray(v_pages), v_scales)
    kv_heads = k_all.shape[0]
    group = num_q_heads // kv_heads
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for b in range(batch):
        length = int(lengths[b])
        k = _sequence_kv(k_all, np.asarray(page_indices[b]), length)
        v = _sequence_kv(v_all, np.asarray(page_indices[b]), length)
        pos = np.arange(length)
        allowed = np.ones(length, bool)
        if sliding_window is not None:
            allowed &= pos >= length - sliding_window
        for head in range(num_q_heads):
            out[b, head] = _softmax_attend(q[b, head:head + 1], k[head // group], v[head // group],
                                           allowed[None], scale, soft_cap, None if sinks is None else sinks[head])[0]
    return out


def numpy_ragged_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale=None, sliding_window=None, k_scales=None, v_scales=None, soft_cap=None,
                           sinks=None, query_limits=None):
    """Each query sees keys up to its position, or up to its entry of ``query_limits`` (int32[num_tokens], ragged
    like q) when given; the sliding window counts back from the position."""
    q = np.asarray(q, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    k_all = _dequantize(np.asarray(k_pages), k_scales)
    v_all = _dequantize(np.asarray(v_pages), v_scales)
    kv_heads = k_all.shape[0]
    group = num_q_heads // kv_heads
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for s in range(int(np.reshape(num_seqs, -1)[0])):
        start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        q_len = end - start
        if q_len == 0:
            continue
        k = _sequence_kv(k_all, np.asarray(page_indices[s]), kv_len)
        v = _sequence_kv(v_all, np.asarray(page_indices[s]), kv_len)
        q_pos = kv_len - q_len + np.arange(q_len)
        limit = q_pos if query_limits is None else np.asarray(query_limits[start:end])
        key_pos = np.arange(kv_len)
        allowed = key_pos[None, :] <= limit[:, None]
        if sliding_window is not None:
            allowed &= key_pos[None, :] > q_pos[:, None] - sliding_window
        for h in range(kv_heads):
            for g in range(group):
                head = h * group + g
                out[start:end, head] = _softmax_attend(q[start:end, head], k[h], v[h], allowed, scale,
                                                       soft_cap, None if sinks is None else sinks[head])
    return out


# --------------------------------------------------------------------------- #
# inputs: paged pools with poisoned unowned pages and slots                    #
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class PagedKV:
    k_pages: np.ndarray  # [kv_heads, num_pages, page_size, D], float32, int8 or float8_e4m3fn
    v_pages: np.ndarray
    k_scales: np.ndarray | None
    v_scales: np.ndarray | None
    page_indices: np.ndarray  # int32[rows, pages_per_seq]

    def device(self, dtype) -> dict:
        """Kernel keyword arguments; float pools are cast to ``dtype``."""
        def cast(pages):
            return jnp.asarray(pages) if pages.dtype in SCALED else jnp.asarray(pages, dtype)
        kw = dict(k_pages=cast(self.k_pages), v_pages=cast(self.v_pages))
        if self.k_scales is not None:
            kw.update(k_scales=jnp.asarray(self.k_scales), v_scales=jnp.asarray(self.v_scales))
        return kw

    def host(self, dtype) -> dict:
        """The same data as the kernel sees it (after the cast), for the numpy reference."""
        kw = {key: np.asarray(val, np.float64) if val.dtype != jnp.int8 else np.asarray(val)
              for key, val in self.device(dtype).items()}
        kw["page_indices"] = self.page_indices
        return kw


def make_paged_kv(rng, kv_lens, *, kv_heads, head_dim, page_size, pages_per_seq,
                  int8=False, fp8=False, poison="nan", unowned="poison_pages") -> PagedKV:
    """Random pools; each sequence owns ceil(len/page_size) pages at scattered ids.

    Every other page and every slot past a sequence's length holds the poison
    value.  Unowned page-table entries point at poisoned pages, or hold ids out
    of range (``unowned="out_of_range"``).  ``int8`` / ``fp8``: quantized pages
    (float8_e4m3fn values up to 448, NaN where poisoned) with per-token scales.
    """
    owned = [math.ceil(n / page_size) for n in kv_lens]
    num_poison_pages = 3
    num_pages = sum(owned) + num_poison_pages
    perm = rng.permutation(num_pages)
    owned_ids, poison_ids = perm[: sum(owned)], perm[sum(owned):]
    shape = (kv_heads, num_pages, page_size, head_dim)
    bad = POISON[poison]
    if int8:
        k = rng.integers(-127, 128, size=shape).astype(np.int8)
        v = rng.integers(-127, 128, size=shape).astype(np.int8)
        k_scales = rng.uniform(0.002, 0.02, size=shape[:3]).astype(np.float32)
        v_scales = rng.uniform(0.002, 0.02, size=shape[:3]).astype(np.float32)
        poisoned = (k_scales, v_scales)
        k[:, poison_ids] = 127
        v[:, poison_ids] = 127
        bad = np.nan if poison == "nan" else 1e6
    elif fp8:
        k, v = (np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(jnp.float8_e4m3fn)
                for _ in "kv")
        k_scales = rng.uniform(0.0005, 0.005, size=shape[:3]).astype(np.float32)
        v_scales = rng.uniform(0.0005, 0.005, size=shape[:3]).astype(np.float32)
        poisoned = (k_scales, v_scales)
        k[:, poison_ids] = np.nan if poison == "nan" else 448  # e4m3fn has a NaN, unlike int8
        v[:, poison_ids] = np.nan if poison == "nan" else 448
        bad = np.nan if poison == "nan" else 1e6
    else:
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        k_scales = v_scales = None
        poisoned = (k, v)
    for arr in poisoned:
        arr[:, poison_ids] = bad
    table = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    cursor = 0
    for s, (n, own) in enumerate(zip(kv_lens, owned)):
        table[s, :own] = owned_ids[cursor: cursor + own]
        cursor += own
        if unowned == "out_of_range":
            table[s, own:] = rng.choice([-1, num_pages, 10**6], size=pages_per_seq - own)
        else:
            table[s, own:] = rng.choice(poison_ids, size=pages_per_seq - own)
        if n % page_size:
            for arr in poisoned:
                arr[:, table[s, own - 1], n % page_size:] = bad
    assert not np.isfinite(poisoned[0]).all() or poison != "nan", "pool must carry poison"
    return PagedKV(k, v, k_scales, v_scales, table)


def assert_close(out, expected, dtype_name: str, what: str = "") -> None:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output (unwritten or poisoned) at " \
        f"{np.argwhere(~np.isfinite(out))[:5].tolist()}"
    scale = max(np.abs(expected).max(), 1e-6)
    err = np.abs(out - expected).max() / scale
    assert err < TOLERANCE[dtype_name], f"{what}: relative error {err:.2e}"


def decode_lengths(page_size: int, pages_per_seq: int) -> list[int]:
    full = page_size * pages_per_seq
    return [1, page_size - 1, page_size, page_size + 1, full, 0, 2 * page_size + 3]


# --------------------------------------------------------------------------- #
# decode                                                                       #
# --------------------------------------------------------------------------- #
DECODE_CASES = [
    # id, group, kv_heads, head_dim, page_size, dtype, pages_per_compute_block, num_splits
    ("gqa1-d64-p16", 1, 4, 64, 16, "float32", None, None),
    ("gqa3-d128-p8", 3, 2, 128, 8, "float32", 2, 3),
    ("gqa4-d64-p32", 4, 2, 64, 32, "float32", 1, 2),
    ("gqa8-d64-p16", 8, 2, 64, 16, "float32", 2, None),
    ("mqa8-d128-p16", 8, 1, 128, 16, "float32", None, 4),
    ("mqa16-d64-p8", 16, 1, 64, 8, "float32", 4, 2),
    ("bf16-gqa4-d128-p16", 4, 2, 128, 16, "bfloat16", 1, 2),
    ("bf16-gqa1-d64-p8", 1, 2, 64, 8, "bfloat16", None, None),
    ("bf16-mqa8-d64-p32", 8, 1, 64, 32, "bfloat16", 1, 5),
    ("bf16-gqa2-d512-p16", 2, 1, 512, 16, "bfloat16", None, None),  # Gemma 4's global heads, default tiles
]


@pytest.mark.parametrize(
    "group,kv_heads,head_dim,page_size,dtype,ppcb,splits",
    [c[1:] for c in DECODE_CASES],
    ids=[c[0] for c in DECODE_CASES],
)
def test_decode_matches_float64_reference(group, kv_heads, head_dim, page_size, dtype, ppcb, splits):
    rng = np.random.default_rng([group, kv_heads, head_dim, page_size])
    pages_per_seq = 5
    lengths = decode_lengths(page_size, pages_per_seq)
    kv = make_paged_kv(rng, lengths, kv_heads=kv_heads, head_dim=head_dim,
                       page_size=page_size, pages_per_seq=pages_per_seq)
    q = jnp.asarray(rng.standard_normal((len(lengths), group * kv_heads, head_dim)), dtype)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        pages_per_compute_block=ppcb, num_splits=splits, interpret=INTERPRET,
        poison_output=True, **kv.device(dtype),
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, **kv.host(dtype))
    assert_close(out, expected, dtype, "decode")
    assert np.all(np.asarray(out[lengths.index(0)], np.float32) == 0.0), "length 0 must give zeros"


@pytest.mark.parametrize("poison,unowned", [("huge", "poison_pages"), ("nan", "out_of_range")])
def test_decode_ignores_unowned_pages(poison, unowned):
    rng = np.random.default_rng(7)
    lengths = [3, 16, 33, 0]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=16, pages_per_seq=4,
                       poison=poison, unowned=unowned)
    q = jnp.asarray(rng.standard_normal((len(lengths), 4, 64)), jnp.float32)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        pages_per_compute_block=4, num_splits=2, interpret=INTERPRET, poison_output=True,
        **kv.device(jnp.float32),
    )
    expected = numpy_decode_reference(np.asarray(q), lengths=lengths, **kv.host(jnp.float32))
    assert_close(out, expected, "float32", f"decode {poison}/{unowned}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_int8_kv(dtype):
    rng = np.random.default_rng(11)
    page_size, pages_per_seq = 16, 4
    lengths = [1, 15, 17, 64, 0]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=page_size,
                       pages_per_seq=pages_per_seq, int8=True)
    q = jnp.asarray(rng.standard_normal((len(lengths), 8, 64)), dtype)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        pages_per_compute_block=1, num_splits=2, interpret=INTERPRET, poison_output=True,
        **kv.device(dtype),
    )
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, **kv.host(dtype))
    assert_close(out, expected, dtype, "decode int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_decode_fp8_kv(dtype, poison):
    """float8_e4m3fn pages with per-token scales (kv_cache_dtype="fp8"); NaN pages where a row does not read."""
    rng = np.random.default_rng(12)
    lengths = [1, 15, 17, 64, 0]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=16, pages_per_seq=4, fp8=True,
                       poison=poison)
    q = jnp.asarray(rng.standard_normal((len(lengths), 8, 64)), dtype)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        pages_per_compute_block=1, num_splits=2, interpret=INTERPRET, poison_output=True,
        **kv.device(dtype),
    )
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, **kv.host(dtype))
    assert_close(out, expected, dtype, "decode fp8")


@pytest.mark.parametrize("window,splits", [(1, 3), (16, 2), (35, None)])
def test_decode_sliding_window(window, splits):
    rng = np.random.default_rng(window)
    page_size, pages_per_seq = 8, 8
    lengths = [1, 7, 8, 9, 40, 64, 0]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=page_size,
                       pages_per_seq=pages_per_seq)
    q = jnp.asarray(rng.standard_normal((len(lengths), 6, 64)), jnp.float32)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        sliding_window=window, pages_per_compute_block=2, num_splits=splits,
        interpret=INTERPRET, poison_output=True, **kv.device(jnp.float32),
    )
    expected = numpy_decode_reference(np.asarray(q), lengths=lengths, sliding_window=window,
                                      **kv.host(jnp.float32))
    assert_close(out, expected, "float32", f"decode window {window}")


@pytest.mark.parametrize("dtype,int8", [("float32", False), ("bfloat16", True)])
def test_decode_soft_cap(dtype, int8):
    """Gemma 2's attention-logit soft-cap, binding (large logits, cap 2), split-K, poisoned pools."""
    rng = np.random.default_rng(11)
    lengths = [1, 9, 40, 0, 64]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=8, pages_per_seq=8, int8=int8)
    q = jnp.asarray(4 * rng.standard_normal((len(lengths), 4, 64)), dtype)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices), soft_cap=2.0,
        pages_per_compute_block=2, num_splits=3, interpret=INTERPRET, poison_output=True, **kv.device(dtype))
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, soft_cap=2.0, **kv.host(dtype))
    uncapped = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, **kv.host(dtype))
    assert np.abs(uncapped - expected).max() > 0.1  # the cap binds
    assert_close(out, expected, dtype, "decode soft-cap")


SINKS = np.asarray([2.5, -1.0, 0.3, 6.0], np.float32)  # per query head; 6 outweighs most keys (binding)


@pytest.mark.parametrize("dtype,int8,splits", [("float32", False, 1), ("float32", False, 3), ("bfloat16", True, 3)])
def test_decode_sinks(dtype, int8, splits):
    """gpt-oss's attention sinks through the decode kernel, counted once over split-K, on poisoned pools."""
    rng = np.random.default_rng(21)
    lengths = [1, 9, 40, 0, 64]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=8, pages_per_seq=8, int8=int8)
    q = jnp.asarray(rng.standard_normal((len(lengths), 4, 64)), dtype)
    out = triton_decode.paged_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        sinks=jnp.asarray(SINKS), pages_per_compute_block=2, num_splits=splits, interpret=INTERPRET,
        poison_output=True, **kv.device(dtype))
    expected = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, sinks=SINKS, **kv.host(dtype))
    plain = numpy_decode_reference(np.asarray(q, np.float64), lengths=lengths, **kv.host(dtype))
    assert np.abs(plain - expected).max() > 0.1  # the sinks bind
    assert_close(out, expected, dtype, "decode sinks")


def test_decode_all_empty_and_sm_scale():
    rng = np.random.default_rng(3)
    kv = make_paged_kv(rng, [0, 0, 0], kv_heads=1, head_dim=64, page_size=16, pages_per_seq=4)
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    out = triton_decode.paged_attention(
        q, lengths=jnp.zeros((3,), jnp.int32), page_indices=jnp.asarray(kv.page_indices),
        pages_per_compute_block=1, num_splits=4, sm_scale=0.3, interpret=INTERPRET,
        poison_output=True, **kv.device(jnp.float32),
    )
    assert np.all(np.asarray(out) == 0.0)


def test_public_decode_and_xla_reference_agree():
    """The package-level entry point and the jax.numpy reference, on the same poisoned inputs."""
    rng = np.random.default_rng(5)
    lengths = [5, 32, 47, 0]
    for int8 in (False, True):
        kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=16, pages_per_seq=3,
                           int8=int8)
        q = jnp.asarray(rng.standard_normal((len(lengths), 6, 64)), jnp.float32)
        args = (q, *[kv.device(jnp.float32)[key] for key in ("k_pages", "v_pages")],
                jnp.asarray(lengths, jnp.int32), jnp.asarray(kv.page_indices))
        scales = {k: v for k, v in kv.device(jnp.float32).items() if k.endswith("scales")}
        expected = numpy_decode_reference(np.asarray(q), lengths=lengths, sliding_window=20,
                                          **kv.host(jnp.float32))
        out = pallas_kernels.paged_attention(*args, sliding_window=20, interpret=INTERPRET, **scales)
        ref = pallas_kernels.paged_attention_reference(*args, sliding_window=20, **scales)
        assert_close(out, expected, "float32", "public decode")
        assert_close(ref, expected, "float32", "xla decode reference")


def test_decode_rejects_bad_arguments():
    q = jnp.zeros((1, 4, 64), jnp.float32)
    pages = jnp.zeros((2, 4, 16, 64), jnp.float32)
    lengths, table = jnp.ones((1,), jnp.int32), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        pallas_kernels.paged_attention(q, pages, pages, lengths, table,
                                       pages_per_compute_block=3, interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        pallas_kernels.paged_attention(jnp.zeros((1, 3, 64)), pages, pages, lengths, table,
                                       interpret=True)
    with pytest.raises(ValueError, match="scales"):
        int8 = pages.astype(jnp.int8)
        pallas_kernels.paged_attention(q, int8, int8, lengths, table, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn k_pages/v_pages need k_scales"):
        fp8 = pages.astype(jnp.float8_e4m3fn)
        pallas_kernels.paged_attention(q, fp8, fp8, lengths, table, interpret=True)
    with pytest.raises(ValueError, match="only meaningful with int8 or float8_e4m3fn"):
        scales = jnp.ones(pages.shape[:3], jnp.float32)
        pallas_kernels.paged_attention(q, pages, pages, lengths, table, k_scales=scales, v_scales=scales,
                                       interpret=True)


# --------------------------------------------------------------------------- #
# ragged prefill / extend                                                      #
# --------------------------------------------------------------------------- #
MIXED = [(1, 37), (16, 16), (5, 40), (17, 17), (0, 9), (3, 3)]  # (q_len, kv_len)


def make_ragged(rng, seqs, *, kv_heads, group, head_dim, page_size, dtype, extra_seq_slots=2,
                tail_tokens=3, int8=False, fp8=False):
    """Inputs with NaN tail tokens and garbage cu_q_lens/kv_lens in inactive slots."""
    q_lens = [s[0] for s in seqs]
    kv_lens = [s[1] for s in seqs]
    pages_per_seq = max(math.ceil(n / page_size) for n in kv_lens) + 1
    max_seqs = len(seqs) + extra_seq_slots
    kv = make_paged_kv(rng, kv_lens + [0] * extra_seq_slots, kv_heads=kv_heads,
                       head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq,
                       int8=int8, fp8=fp8)
    used = sum(q_lens)
    num_tokens = used + tail_tokens
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1: len(seqs) + 1] = np.cumsum(q_lens)
    cu[len(seqs) + 1:] = 10**6  # garbage past num_seqs
    kv_lens_arr = np.asarray(kv_lens + [10**6] * extra_seq_slots, np.int32)
    q = rng.standard_normal((num_tokens, kv_heads * group, head_dim)).astype(np.float32)
    q[used:] = np.nan
    return dict(q=jnp.asarray(q, dtype), kv_lens=kv_lens_arr, cu_q_lens=cu,
                num_seqs=np.asarray([len(seqs)], np.int32), kv=kv)


RAGGED_CASES = [
    # id, seqs, group, kv_heads, head_dim, page_size, dtype, window, ppcb, int8
    ("mixed-gqa1-d64-p16", MIXED, 1, 2, 64, 16, "float32", None, 1, False),
    ("mixed-gqa3-d128-p8", MIXED, 3, 2, 128, 8, "float32", None, None, False),
    ("mixed-gqa4-d64-p32-win5", MIXED, 4, 2, 64, 32, "float32", 5, 1, False),
    ("mixed-mqa8-d64-p16", MIXED, 8, 1, 64, 16, "float32", None, 2, False),
    ("mixed-bf16-gqa4-d128-p16", MIXED, 4, 2, 128, 16, "bfloat16", None, 1, False),
    ("mixed-bf16-gqa1-d64-p8-win20", MIXED, 1, 2, 64, 8, "bfloat16", 20, 2, False),
    ("mixed-int8-gqa2-d64-p16", MIXED, 2, 2, 64, 16, "float32", None, 1, True),
    ("mixed-bf16-gqa2-d512-p16", MIXED, 2, 1, 512, 16, "bfloat16", None, None, False),
    ("prefill-only-gqa4", [(50, 50), (7, 7)], 4, 2, 64, 16, "float32", None, 1, False),
    ("decode-only-gqa8", [(1, 1), (1, 16), (1, 17), (1, 50)], 8, 2, 128, 16, "float32", 9, 1, False),
]


@pytest.mark.parametrize(
    "seqs,group,kv_heads,head_dim,page_size,dtype,window,ppcb,int8",
    [c[1:] for c in RAGGED_CASES],
    ids=[c[0] for c in RAGGED_CASES],
)
def test_ragged_matches_float64_reference(seqs, group, kv_heads, head_dim, page_size, dtype,
                                          window, ppcb, int8):
    rng = np.random.default_rng([len(seqs), group, head_dim, page_size])
    inp = make_ragged(rng, seqs, kv_heads=kv_heads, group=group, head_dim=head_dim,
                      page_size=page_size, dtype=dtype, int8=int8)
    kv = inp["kv"]
    out = triton_ragged.ragged_paged_attention(
        inp["q"], kv_lens=jnp.asarray(inp["kv_lens"]), page_indices=jnp.asarray(kv.page_indices),
        cu_q_lens=jnp.asarray(inp["cu_q_lens"]), num_seqs=jnp.asarray(inp["num_seqs"]),
        sliding_window=window, pages_per_compute_block=ppcb, interpret=INTERPRET,
        poison_output=True, **kv.device(dtype),
    )
    assert out.shape == inp["q"].shape and out.dtype == inp["q"].dtype
    expected = numpy_ragged_reference(
        np.asarray(inp["q"], np.float64), kv_lens=inp["kv_lens"], cu_q_lens=inp["cu_q_lens"],
        num_seqs=inp["num_seqs"], sliding_window=window, **kv.host(dtype),
    )
    assert_close(out, expected, dtype, "ragged")
    used = int(inp["cu_q_lens"][len(seqs)])
    assert np.all(np.asarray(out[used:], np.float32) == 0.0), "padded tail rows must be zeros"


@pytest.mark.parametrize("dtype,window", [("float32", None), ("bfloat16", 20)])
def test_ragged_soft_cap(dtype, window):
    """The soft-cap through the ragged kernel: binding, mixed prefill/decode rows, poisoned pools and tail."""
    rng = np.random.default_rng(12)
    inp = make_ragged(rng, MIXED, kv_heads=2, group=2, head_dim=64, page_size=16, dtype=dtype)
    kv, q = inp["kv"], inp["q"] * 4
    out = triton_ragged.ragged_paged_attention(
        q, kv_lens=jnp.asarray(inp["kv_lens"]), page_indices=jnp.asarray(kv.page_indices),
        cu_q_lens=jnp.asarray(inp["cu_q_lens"]), num_seqs=jnp.asarray(inp["num_seqs"]), sliding_window=window,
        soft_cap=2.0, pages_per_compute_block=1, interpret=INTERPRET, poison_output=True, **kv.device(dtype))
    expected = numpy_ragged_reference(np.asarray(q, np.float64), kv_lens=inp["kv_lens"], cu_q_lens=inp["cu_q_lens"],
                                      num_seqs=inp["num_seqs"], sliding_window=window, soft_cap=2.0,
                                      **kv.host(dtype))
    assert_close(out, expected, dtype, "ragged soft-cap")


@pytest.mark.parametrize("dtype,window", [("float32", None), ("bfloat16", 20)])
def test_ragged_sinks(dtype, window):
    """Attention sinks through the ragged kernel: mixed prefill/decode rows, poisoned pools, zero padded tail."""
    rng = np.random.default_rng(22)
    inp = make_ragged(rng, MIXED, kv_heads=2, group=2, head_dim=64, page_size=16, dtype=dtype)
    kv, q = inp["kv"], inp["q"]
    out = triton_ragged.ragged_paged_attention(
        q, kv_lens=jnp.asarray(inp["kv_lens"]), page_indices=jnp.asarray(kv.page_indices),
        cu_q_lens=jnp.asarray(inp["cu_q_lens"]), num_seqs=jnp.asarray(inp["num_seqs"]), sliding_window=window,
        sinks=jnp.asarray(SINKS), pages_per_compute_block=1, interpret=INTERPRET, poison_output=True,
        **kv.device(dtype))
    expected = numpy_ragged_reference(np.asarray(q, np.float64), kv_lens=inp["kv_lens"], cu_q_lens=inp["cu_q_lens"],
                                      num_seqs=inp["num_seqs"], sliding_window=window, sinks=SINKS,
                                      **kv.host(dtype))
    assert_close(out, expected, dtype, "ragged sinks")
    used = int(inp["cu_q_lens"][len(MIXED)])
    assert np.all(np.asarray(out[used:], np.float32) == 0.0), "padded tail rows must be zeros"


@pytest.mark.parametrize("dtype,window", [("float32", None), ("bfloat16", 20)])
def test_ragged_fp8_kv(dtype, window):
    """float8_e4m3fn pages with per-token scales (kv_cache_dtype="fp8") through the ragged kernel."""
    rng = np.random.default_rng(19)
    inp = make_ragged(rng, MIXED, kv_heads=2, group=2, head_dim=64, page_size=16, dtype=dtype, fp8=True)
    kv = inp["kv"]
    out = triton_ragged.ragged_paged_attention(
        inp["q"], kv_lens=jnp.asarray(inp["kv_lens"]), page_indices=jnp.asarray(kv.page_indices),
        cu_q_lens=jnp.asarray(inp["cu_q_lens"]), num_seqs=jnp.asarray(inp["num_seqs"]),
        sliding_window=window, pages_per_compute_block=1, interpret=INTERPRET, poison_output=True,
        **kv.device(dtype),
    )
    expected = numpy_ragged_reference(
        np.asarray(inp["q"], np.float64), kv_lens=inp["kv_lens"], cu_q_lens=inp["cu_q_lens"],
        num_seqs=inp["num_seqs"], sliding_window=window, **kv.host(dtype),
    )
    assert_close(out, expected, dtype, "ragged fp8")
    used = int(inp["cu_q_lens"][len(MIXED)])
    assert np.all(np.asarray(out[used:], np.float32) == 0.0), "padded tail rows must be zeros"


def image_limits(q_len: int, kv_len: int, image: tuple[int, int] | None) -> np.ndarray:
    """int32[q_len]: the last key each of a sequence's new tokens sees, Gemma 3's way: a token of the image (its
    positions ``image[0]..image[1]``) sees the whole image, every other token its own position."""
    pos = np.arange(kv_len - q_len, kv_len, dtype=np.int32)
    if image is None:
        return pos
    return np.where((pos >= image[0]) & (pos <= image[1]), image[1], pos).astype(np.int32)


# (q_len, kv_len, image span): one in the middle of the new tokens, past the first tile's (16 tokens at group 4) last
# query and its KV tile (16 keys), one starting in the cached context, one opening the prompt and ending the chunk,
# a decode row, an empty one
IMAGE_SEQS = [(24, 40, (26, 35)), (10, 20, (7, 12)), (5, 5, (0, 4)), (1, 9, None), (0, 5, None)]


@pytest.mark.parametrize("dtype,window", [("float32", None), ("bfloat16", 6)])
def test_ragged_query_limits(dtype, window):
    """Gemma 3's images seen both ways (``query_limits``), with GQA, poisoned pools and tail; the padded tail's
    limits are garbage. The XLA reference takes the same limits."""
    rng = np.random.default_rng(31)
    inp = make_ragged(rng, [s[:2] for s in IMAGE_SEQS], kv_heads=2, group=4, head_dim=64, page_size=8, dtype=dtype)
    kv, q = inp["kv"], inp["q"]
    limits = np.full(q.shape[0], 10**6, np.int32)
    limits[:int(inp["cu_q_lens"][len(IMAGE_SEQS)])] = np.concatenate([image_limits(*s) for s in IMAGE_SEQS])
    args = dict(kv_lens=jnp.asarray(inp["kv_lens"]), page_indices=jnp.asarray(kv.page_indices),
                cu_q_lens=jnp.asarray(inp["cu_q_lens"]), num_seqs=jnp.asarray(inp["num_seqs"]), sliding_window=window)
    out = triton_ragged.ragged_paged_attention(q, **args, query_limits=jnp.asarray(limits), pages_per_compute_block=2,
                                               interpret=INTERPRET, poison_output=True, **kv.device(dtype))
    host = dict(kv_lens=inp["kv_lens"], cu_q_lens=inp["cu_q_lens"], num_seqs=inp["num_seqs"], sliding_window=window,
                **kv.host(dtype))
    expected = numpy_ragged_reference(np.asarray(q, np.float64), query_limits=limits, **host)
    assert np.abs(expected - numpy_ragged_reference(np.asarray(q, np.float64), **host)).max() > 0.1  # they bind
    assert_close(out, expected, dtype, "ragged query limits")
    used = int(inp["cu_q_lens"][len(IMAGE_SEQS)])
    assert np.all(np.asarray(out[used:], np.float32) == 0.0), "padded tail rows must be zeros"
    ref = pallas_kernels.ragged_paged_attention_reference(q, **args, query_limits=jnp.asarray(limits),
                                                          **kv.device(dtype))
    assert_close(ref, expected, dtype, "xla ragged reference with query limits")


def test_public_ragged_and_xla_reference_agree():
    rng = np.random.default_rng(13)
    inp = make_ragged(rng, MIXED, kv_heads=2, group=2, head_dim=64, page_size=16, dtype="float32")
    kv = inp["kv"]
    dev = kv.device(jnp.float32)
    args = (inp["q"], dev["k_pages"], dev["v_pages"], jnp.asarray(inp["kv_lens"]),
            jnp.asarray(kv.page_indices), jnp.asarray(inp["cu_q_lens"]))
    expected = numpy_ragged_reference(
        np.asarray(inp["q"]), kv_lens=inp["kv_lens"], cu_q_lens=inp["cu_q_lens"],
        num_seqs=inp["num_seqs"], sliding_window=12, **kv.host(jnp.float32),
    )
    num_seqs_scalar = jnp.int32(len(MIXED))
    out = pallas_kernels.ragged_paged_attention(*args, num_seqs_scalar, sliding_window=12,
                                                interpret=INTERPRET)
    ref = pallas_kernels.ragged_paged_attention_reference(*args, jnp.asarray(inp["num_seqs"]),
                                                          sliding_window=12)
    assert_close(out, expected, "float32", "public ragged")
    assert_close(ref, expected, "float32", "xla ragged reference")


def test_ragged_decode_rows_equal_decode_kernel():
    """q_len = 1 everywhere: the ragged kernel must agree with the decode kernel."""
    rng = np.random.default_rng(17)
    lengths = [1, 9, 16, 40]
    kv = make_paged_kv(rng, lengths, kv_heads=2, head_dim=64, page_size=8, pages_per_seq=6)
    q = jnp.asarray(rng.standard_normal((len(lengths), 4, 64)), jnp.float32)
    dev = kv.device(jnp.float32)
    table = jnp.asarray(kv.page_indices)
    lens = jnp.asarray(lengths, jnp.int32)
    dec = pallas_kernels.paged_attention(q, dev["k_pages"], dev["v_pages"], lens, table,
                                         num_splits=2, pages_per_compute_block=2,
                                         interpret=INTERPRET)
    rag = pallas_kernels.ragged_paged_attention(
        q, dev["k_pages"], dev["v_pages"], lens, table,
        jnp.arange(len(lengths) + 1, dtype=jnp.int32), jnp.asarray([len(lengths)], jnp.int32),
        pages_per_compute_block=2, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(dec), np.asarray(rag), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- #
# a row's result does not depend on the rest of the batch                      #
# --------------------------------------------------------------------------- #
def _place(rng, target: int, others: list[int], batch: int) -> tuple[list[int], int]:
    """Row ids of a batch of ``batch`` rows: ``target`` at a random index among random ``others``."""
    rows = list(rng.choice(others, size=batch - 1, replace=False))
    at = int(rng.integers(0, batch))
    return rows[:at] + [target] + rows[at:], at


def assert_same_bits(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=f"{what}: bits differ")


def test_decode_row_is_bitwise_independent_of_batch():
    """Seeded sampling needs a row's logits to ignore its co-batched requests: same bits at batch 1 to 64."""
    rng = np.random.default_rng(23)
    page_size, pages_per_seq, kv_heads, group, head_dim = 16, 8, 1, 4, 32  # 8 KV tiles of one page
    full = page_size * pages_per_seq
    lengths = [full - 11] + list(rng.integers(0, full + 1, size=63))
    kv = make_paged_kv(rng, lengths, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       pages_per_seq=pages_per_seq)
    dev = kv.device(jnp.float32)
    q = rng.standard_normal((len(lengths), kv_heads * group, head_dim)).astype(np.float32)
    lengths = np.asarray(lengths, np.int32)

    def row_output(rows: list[int], at: int) -> np.ndarray:
        out = triton_decode.paged_attention(
            jnp.asarray(q[rows]), dev["k_pages"], dev["v_pages"], jnp.asarray(lengths[rows]),
            jnp.asarray(kv.page_indices[rows]), pages_per_compute_block=1, interpret=INTERPRET,
            poison_output=True)
        return np.asarray(out[at])

    alone = row_output([0], 0)
    expected = numpy_decode_reference(q[:1], lengths=lengths[:1], **{
        **kv.host(jnp.float32), "page_indices": kv.page_indices[:1]})
    assert_close(alone[None], expected, "float32", "decode alone")
    for batch in (4, 16, 64):
        got = row_output(*_place(rng, 0, list(range(1, len(lengths))), batch))
        assert_same_bits(got, alone, f"decode at batch {batch}")


def test_ragged_sequence_is_bitwise_independent_of_batch():
    """Likewise for prefill: one sequence alone, or among others with more tokens in the call."""
    rng = np.random.default_rng(29)
    page_size, kv_heads, group, head_dim = 16, 1, 4, 32
    seqs = [(3, 40)] + [(int(n), int(n) + int(rng.integers(0, 20))) for n in rng.integers(0, 24, size=15)]
    inp = make_ragged(rng, seqs, kv_heads=kv_heads, group=group, head_dim=head_dim, page_size=page_size,
                      dtype="float32", extra_seq_slots=0, tail_tokens=0)
    kv, dev = inp["kv"], inp["kv"].device(jnp.float32)
    q, cu = np.asarray(inp["q"]), inp["cu_q_lens"]

    def sequence_output(ids: list[int], at: int) -> np.ndarray:
        q_lens = [seqs[s][0] for s in ids]
        cu_ids = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q_ids = np.concatenate([q[cu[s]:cu[s + 1]] for s in ids])
        out = triton_ragged.ragged_paged_attention(
            jnp.asarray(q_ids), dev["k_pages"], dev["v_pages"], jnp.asarray(inp["kv_lens"][ids]),
            jnp.asarray(kv.page_indices[ids]), jnp.asarray(cu_ids), jnp.asarray([len(ids)], jnp.int32),
            interpret=INTERPRET, poison_output=True)
        return np.asarray(out[cu_ids[at]:cu_ids[at + 1]])

    alone = sequence_output([0], 0)
    for batch in (4, 16):
        got = sequence_output(*_place(rng, 0, list(range(1, len(seqs))), batch))
        assert_same_bits(got, alone, f"ragged among {batch} sequences")


def pallas_call_eqns(jaxpr) -> list:
    """Every pallas_call equation in ``jaxpr``, one per call site, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        else:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += pallas_call_eqns(sub)
    return found


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("pages_per_seq", [1, 3, 16, 128, 2048])
def test_decode_split_count_ignores_batch(pages_per_seq, int8):
    """The default split-K grid axis is the same at every batch size (traced, not run)."""
    spec = jax.ShapeDtypeStruct
    pages = spec((8, 64, 16, 128), jnp.int8 if int8 else jnp.bfloat16)
    scales = dict(k_scales=spec(pages.shape[:3], jnp.float32), v_scales=spec(pages.shape[:3], jnp.float32))
    splits = set()
    for batch in (1, 3, 64, 1024):
        jaxpr = jax.make_jaxpr(functools.partial(triton_decode.paged_attention, interpret=True))(
            spec((batch, 32, 128), jnp.bfloat16), pages, pages, spec((batch,), jnp.int32),
            spec((batch, pages_per_seq), jnp.int32), **(scales if int8 else {})).jaxpr
        (eqn,) = pallas_call_eqns(jaxpr)
        grid = eqn.params["grid_mapping"].grid
        assert grid[0] == batch
        splits.add(grid[2])
    assert len(splits) == 1, splits


def test_decode_splits_long_contexts_for_a_full_gpu():
    """A lone 32k-token row of an 8-KV-head model still fills an H200's 132 SMs at least once."""
    plan = planning.plan_decode(32, 8, 16, 2048, pages_per_compute_block=None, num_splits=None)
    assert plan.num_splits * 8 >= 132


def test_tiles_at_head_dim_512_stay_within_a_hopper_s_shared_memory():
    """2-byte K/V tiles at head_dim 512 (Gemma 4's global layers) are halved: 64 decode tokens, 32 ragged ones (the
    defaults asked an H200 for 404 and 320 KiB of its 227 KiB); below 512 they are as they were."""
    def tokens(head_dim: int, itemsize: int = 2) -> tuple[int, int]:
        decode = planning.plan_decode(8, 2, 16, 256, pages_per_compute_block=None, num_splits=None,
                                      kv_itemsize=itemsize, head_dim=head_dim)
        ragged = planning.plan_ragged(64, 8, 2, 4, 16, 256, pages_per_compute_block=None, kv_itemsize=itemsize,
                                      head_dim=head_dim)
        return decode.pages_per_block * 16, ragged.pages_per_block * 16

    assert tokens(512) == (64, 32) and tokens(512, 1) == (128, 64)
    assert tokens(256) == tokens(128) == (128, 64) and tokens(256, 4) == (32, 32)


@pytest.mark.parametrize("group", [1, 3, 8, 16])
def test_ragged_tiles_ignore_token_count(group):
    plans = {planning.plan_ragged(num_tokens, 8 * group, 8, 4, 16, 64, pages_per_compute_block=None)
             for num_tokens in (1, 5, 16, 64, 300)}
    assert len({(p.tokens_per_tile, p.pages_per_block, p.group_padded) for p in plans}) == 1, plans


# --------------------------------------------------------------------------- #
# XLA-side planning helpers                                                    #
# --------------------------------------------------------------------------- #
def test_sanitize_page_indices_zeroes_unowned_entries():
    table = jnp.asarray([[5, 6, -1, 10**6], [7, 8, 9, 3], [4, 4, 4, 4]], jnp.int32)
    lengths = jnp.asarray([17, 64, 0], jnp.int32)
    got = planning.sanitize_page_indices(table, lengths, page_size=16, width=6)
    np.testing.assert_array_equal(
        np.asarray(got), [[5, 6, 0, 0, 0, 0], [7, 8, 9, 3, 0, 0], [0, 0, 0, 0, 0, 0]]
    )


def test_ragged_work_list_covers_every_token_once():
    q_lens, kv_lens = [1, 16, 5, 0, 17], [37, 16, 40, 9, 17]
    tail, tokens_per_tile = 3, 4
    num_tokens = sum(q_lens) + tail
    cu = np.concatenate([[0], np.cumsum(q_lens), [10**6]]).astype(np.int32)  # 1 inactive slot
    plan_tiles = planning.cdiv(num_tokens, tokens_per_tile) + len(q_lens) + 1
    work_list = jax.jit(planning.ragged_work_list, static_argnums=(3, 4, 5))
    work = work_list(
        jnp.asarray(cu), jnp.asarray(kv_lens + [10**6], jnp.int32), jnp.asarray([len(q_lens)]),
        num_tokens, tokens_per_tile, plan_tiles,
    )
    seq, first_row, rows, first_pos, kv_len = (np.asarray(a) for a in work)
    covered = np.zeros(num_tokens, int)
    for t in range(plan_tiles):
        covered[first_row[t]: first_row[t] + rows[t]] += 1
        if rows[t] and first_row[t] < sum(q_lens):
            s = seq[t]
            offset = first_row[t] - cu[s]
            assert first_pos[t] == kv_lens[s] - q_lens[s] + offset and kv_len[t] == kv_lens[s]
        elif rows[t]:
            assert kv_len[t] == 0  # padded tail: no keys, zero output
    np.testing.assert_array_equal(covered, 1)


# --------------------------------------------------------------------------- #
# Triton lowering without a GPU                                                #
# --------------------------------------------------------------------------- #
def lower_to_triton_ir(fn, *args, **kwargs) -> list[str]:
    """Triton IR (text) of every pallas_call that ``fn`` traces to, for an sm_90 (H100/H200) GPU.

    Calls Pallas' own Triton lowering, ``lower_jaxpr_to_triton_module``, on each
    kernel jaxpr -- the step ``jax.jit(...).lower(...)`` takes on a GPU before it
    hands the IR to Triton's compiler.  It needs no GPU and no CUDA plugin, unlike
    the full lowering of jaxlib > 0.10.2, which compiles the IR to PTX right away.
    Fails if a primitive has no Triton lowering, a loaded or stored tile is not a
    power of two, or the module does not verify.
    """
    import itertools

    from jax._src import sharding_impls
    from jax._src.interpreters import mlir

    lowering = pytest.importorskip(
        "jax._src.pallas.triton.lowering",
        reason="this jax has no Pallas Triton lowering module (jax._src.pallas.triton.lowering)")
    module_context = mlir.ModuleContext(
        platforms=("cuda",), backend=None, axis_context=sharding_impls.ShardingContext(1), keepalives=[],
        channel_iterator=itertools.count(1), host_callbacks=[], lowering_parameters=mlir.LoweringParameters())
    modules = []
    for eqn in pallas_call_eqns(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr):
        result = lowering.lower_jaxpr_to_triton_module(
            eqn.params["jaxpr"], eqn.params["grid_mapping"], "cuda", 90, mlir_ctx=module_context)
        assert result.module.operation.verify()
        modules.append(str(result.module))
    return modules


LOWERING_CASES = [
    # id, kernel, dtype, int8, group, head_dim, page_size, extra kwargs
    ("decode-f32-split3-window", "decode", jnp.float32, False, 3, 64, 16,
     dict(num_splits=3, sliding_window=20, pages_per_compute_block=1)),
    ("decode-bf16-int8-mqa", "decode", jnp.bfloat16, True, 8, 128, 8, dict(num_splits=1)),
    ("ragged-f32-window", "ragged", jnp.float32, False, 4, 64, 32, dict(sliding_window=7)),
    ("ragged-bf16-int8-gqa1", "ragged", jnp.bfloat16, True, 1, 128, 16,
     dict(pages_per_compute_block=2)),
]


@pytest.mark.skipif(not triton_decode.common.TRITON_AVAILABLE,
                    reason="this jax has no jax.experimental.pallas.triton, so the kernels only run interpreted")
@pytest.mark.parametrize("kernel,dtype,int8,group,head_dim,page_size,extra",
                         [c[1:] for c in LOWERING_CASES], ids=[c[0] for c in LOWERING_CASES])
def test_kernels_lower_to_triton_ir(kernel, dtype, int8, group, head_dim, page_size, extra):
    """Lowers each kernel to Triton IR on this machine: every primitive must have a Triton
    lowering and every loaded tile a power-of-two size (nothing is compiled or run)."""
    spec = jax.ShapeDtypeStruct
    kv_heads, num_pages, pages_per_seq, rows = 2, 37, 5, 7
    pages = spec((kv_heads, num_pages, page_size, head_dim), jnp.int8 if int8 else dtype)
    scales = {}
    if int8:
        scales = dict(k_scales=spec(pages.shape[:3], jnp.float32),
                      v_scales=spec(pages.shape[:3], jnp.float32))
    q = spec((rows, kv_heads * group, head_dim), dtype)
    if kernel == "decode":
        fn = functools.partial(triton_decode.paged_attention, poison_output=True, **extra)
        args = (q, pages, pages, spec((rows,), jnp.int32), spec((rows, pages_per_seq), jnp.int32))
    else:
        fn = functools.partial(triton_ragged.ragged_paged_attention, poison_output=True, **extra)
        args = (q, pages, pages, spec((3,), jnp.int32), spec((3, pages_per_seq), jnp.int32),
                spec((4,), jnp.int32), spec((1,), jnp.int32))
    (module,) = lower_to_triton_ir(fn, *args, **scales)
    assert "tt.func public @jaxserve_" in module and "tt.dot" in module


def test_triton_ir_check_rejects_a_bad_tile():
    """The check above is not vacuous: a kernel loading a 3-row tile fails to lower."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def fn(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(2,), in_specs=[pl.BlockSpec((3, 16), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((3, 16), lambda i: (i, 0)))(x)

    with pytest.raises(Exception, match="power of 2"):
        lower_to_triton_ir(fn, jax.ShapeDtypeStruct((6, 16), jnp.float32))


# --------------------------------------------------------------------------- #
# Multi-head Latent Attention decode                                           #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("heads, latent, rope, width, page_size, dtype, ppcb, splits", [
    (4, 64, 16, 80, 8, "float32", None, None),  # fewer heads than a block
    (20, 32, 16, 64, 16, "float32", 1, 3),  # two head blocks, the second part padding; columns past the row
    (16, 64, 32, 96, 8, "bfloat16", 2, 2),
])
def test_mla_decode_matches_float64_reference(heads, latent, rope, width, page_size, dtype, ppcb, splits):
    """Each head's softmax of q_latent . c + q_rope . k_rope over its sequence's latent rows, times c: the float64
    reference is paged attention with the pool as keys and its latent part as values (the rest zeroed)."""
    rng = np.random.default_rng([heads, latent, rope, page_size])
    pages_per_seq = 5
    lengths = decode_lengths(page_size, pages_per_seq)
    kv = make_paged_kv(rng, lengths, kv_heads=1, head_dim=width, page_size=page_size, pages_per_seq=pages_per_seq)
    q = rng.standard_normal((len(lengths), heads, latent + rope))
    q_latent, q_rope = jnp.asarray(q[..., :latent], dtype), jnp.asarray(q[..., latent:], dtype)
    out = pallas_kernels.ops._triton_mla_decode.mla_paged_attention(
        q_latent, q_rope, jnp.asarray(kv.k_pages, dtype), jnp.asarray(lengths, jnp.int32),
        jnp.asarray(kv.page_indices), sm_scale=0.3, pages_per_compute_block=ppcb, num_splits=splits,
        interpret=INTERPRET, poison_output=True)
    assert out.shape == (len(lengths), heads, latent) and out.dtype == q_latent.dtype
    pool = np.asarray(jnp.asarray(kv.k_pages, dtype), np.float64)
    keys = pool[..., :latent + rope]
    values = np.where(np.arange(latent + rope) < latent, keys, 0.0)
    query = np.concatenate([np.asarray(q_latent, np.float64), np.asarray(q_rope, np.float64)], axis=-1)
    expected = numpy_decode_reference(query, keys, values, lengths, kv.page_indices, sm_scale=0.3)[..., :latent]
    assert_close(out, expected, dtype, "mla decode")
    assert np.all(np.asarray(out[lengths.index(0)], np.float32) == 0.0), "length 0 must give zeros"

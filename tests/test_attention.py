"""Checks of `jaxserve.layers.attention` (write_kv + attend) on every backend this machine runs.

Inputs follow the engine's layout (see `jaxserve/engine/model_runner.py`): rows of `T` query
tokens, padded tokens written to the scratch page 0, unused page-table entries pointing at page 0.
Here page 0, every page no row owns, every slot past a row's context and every padded token's
q/k/v hold poison (NaN, +inf or a huge value), and the result is compared with a float64 numpy
reference that reads only the keys a row owns.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.attention import (ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, KVPages,
                                      make_attention_backend)

# Every backend this machine runs: "pallas" compiles Triton kernels (a GPU), "pallas-tpu" Mosaic TPU ones (a TPU).
NEEDS = {"pallas": "gpu", "pallas-tpu": "tpu"}
BACKENDS = tuple(name for name in ATTENTION_BACKENDS if NEEDS.get(name, jax.default_backend()) == jax.default_backend())
POISON = {"nan": np.nan, "inf": np.inf, "huge": 3.0e38}
TOLERANCE = 2e-6  # absolute, outputs are O(1): float32 attention is ~3e-7 off the float64 reference here


@dataclasses.dataclass
class Step:
    """One attention call: per-row (query_len, context_len), inputs, and what the reference needs."""

    q: np.ndarray  # [B, T, q_heads, D] float32
    k_new: np.ndarray  # [B, T, kv_heads, D]
    v_new: np.ndarray
    k_pool: np.ndarray  # [kv_heads, num_pages, page_size, D], before write_kv
    v_pool: np.ndarray
    k_past: list[np.ndarray]  # per row [kv_heads, start, D]: keys already cached before this step
    v_past: list[np.ndarray]
    query_lens: list[int]
    context_lens: list[int]
    page_tables: np.ndarray  # int32 [B, P]
    slot_mapping: np.ndarray  # int32 [B, T]
    positions: np.ndarray  # int32 [B, T]
    query_limits: np.ndarray | None = None  # int32 [B, T]: the last key each query sees (None: its own)

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(
            positions=jnp.asarray(self.positions), slot_mapping=jnp.asarray(self.slot_mapping),
            page_tables=jnp.asarray(self.page_tables), context_lens=jnp.asarray(self.context_lens, jnp.int32),
            query_lens=jnp.asarray(self.query_lens, jnp.int32),
            query_limits=None if self.query_limits is None else jnp.asarray(self.query_limits))

    def real(self) -> np.ndarray:
        """bool [B, T]: query tokens whose output matters."""
        t = np.arange(self.q.shape[1])
        return (t[None, :] < np.asarray(self.query_lens)[:, None]) & (np.asarray(self.context_lens)[:, None] > 0)


def make_step(rng: np.random.Generator, rows: list[tuple[int, int]], num_tokens: int, *, kv_heads: int = 2,
              group: int = 2, head_dim: int = 16, page_size: int = 4, pages_per_seq: int = 6,
              poison: str = "nan") -> Step:
    """Random inputs for rows of (query_len, context_len); context_len 0 is an inactive row.

    Each row owns ceil(context_len / page_size) pages at scattered ids >= 1; unowned table entries
    point at page 0 or at a page nobody owns. Everything a row does not own holds the poison value.
    """
    bad = POISON[poison]
    batch = len(rows)
    owned = [math.ceil(ctx / page_size) for _, ctx in rows]
    num_pages = 1 + batch * pages_per_seq + 2  # fixed by the shapes (for jit's cache); >= 2 pages nobody owns
    ids = 1 + rng.permutation(num_pages - 1)
    owned_ids, spare_ids = ids[:sum(owned)], ids[sum(owned):]
    q_heads = kv_heads * group
    pool_shape = (kv_heads, num_pages, page_size, head_dim)
    k_pool, v_pool = np.full(pool_shape, bad, np.float32), np.full(pool_shape, bad, np.float32)
    q = rng.standard_normal((batch, num_tokens, q_heads, head_dim)).astype(np.float32)
    k_new = rng.standard_normal((batch, num_tokens, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((batch, num_tokens, kv_heads, head_dim)).astype(np.float32)
    table = np.zeros((batch, pages_per_seq), np.int32)
    slots = np.zeros((batch, num_tokens), np.int32)  # padded tokens write to the scratch page 0
    positions = np.zeros((batch, num_tokens), np.int32)
    k_past, v_past = [], []
    cursor = 0
    for b, (q_len, ctx) in enumerate(rows):
        assert q_len <= ctx <= pages_per_seq * page_size and q_len <= num_tokens
        mine = owned_ids[cursor:cursor + owned[b]]
        cursor += owned[b]
        table[b, :owned[b]] = mine
        table[b, owned[b]:] = rng.choice(np.concatenate([[0], spare_ids]), size=pages_per_seq - owned[b])
        start = ctx - q_len
        past = rng.standard_normal((2, kv_heads, start, head_dim)).astype(np.float32)
        k_past.append(past[0])
        v_past.append(past[1])
        for pos in range(start):
            page, offset = mine[pos // page_size], pos % page_size
            k_pool[:, page, offset], v_pool[:, page, offset] = past[0][:, pos], past[1][:, pos]
        positions[b] = start + np.arange(num_tokens)  # as the engine does, padded tokens included
        for j in range(q_len):
            pos = start + j
            slots[b, j] = mine[pos // page_size] * page_size + pos % page_size
        if ctx == 0:
            q[b] = bad
        q[b, q_len:], k_new[b, q_len:], v_new[b, q_len:] = bad, bad, bad
    return Step(q, k_new, v_new, k_pool, v_pool, k_past, v_past, [r[0] for r in rows], [r[1] for r in rows],
                table, slots, positions)


def reference(step: Step, sliding_window: int | None = None, soft_cap: float | None = None,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """float64 causal attention of each real query token over its row's owned keys, or up to its `query_limits`
    entry when the step has them (logits capped as `soft_cap * tanh(x / soft_cap)` when set; `sinks[h]` one more
    logit of head h, with no value); zeros elsewhere."""
    batch, num_tokens, q_heads, head_dim = step.q.shape
    kv_heads = step.k_new.shape[2]
    group = q_heads // kv_heads
    out = np.zeros(step.q.shape, np.float64)
    real = step.real()
    for b in range(batch):
        q_len = step.query_lens[b]
        if not real[b].any():
            continue
        keys = np.concatenate([step.k_past[b], step.k_new[b, :q_len].transpose(1, 0, 2)], axis=1).astype(np.float64)
        values = np.concatenate([step.v_past[b], step.v_new[b, :q_len].transpose(1, 0, 2)], axis=1).astype(np.float64)
        start = step.context_lens[b] - q_len
        for j in range(q_len):
            pos = start + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            hi = pos if step.query_limits is None else int(step.query_limits[b, j])
            for h in range(q_heads):
                k, v = keys[h // group, lo:hi + 1], values[h // group, lo:hi + 1]
                logits = k @ step.q[b, j, h].astype(np.float64) / math.sqrt(head_dim)
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                sink = [] if sinks is None else [float(sinks[h])]
                top = np.max([*logits, *sink])
                p = np.exp(logits - top)
                out[b, j, h] = p @ v / (p.sum() + np.sum(np.exp(np.asarray(sink) - top)))
    return out


@functools.partial(jax.jit, static_argnames=("backend", "sliding_window", "soft_cap"))
def _write_and_attend(q, k_pool, v_pool, k_new, v_new, meta, sinks, *, backend, sliding_window, soft_cap=None):
    attention = make_attention_backend(backend)
    kv = attention.write_kv(KVPages(k_pool, v_pool), k_new, v_new, meta.slot_mapping)
    return attention.attend(q, kv, meta, sm_scale=1 / math.sqrt(q.shape[-1]),
                            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)


def attend(backend: str, step: Step, sliding_window: int | None = None, soft_cap: float | None = None,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """write_kv then attend, jitted together as in the model; returns float64 [B, T, q_heads, D]. A backend that
    stores heads padded (Mosaic TPU: to 128) gets its pools so, zeros past the model's head size, as the engine's
    pools are (fresh pools are zeros, and every write pads with zeros)."""
    head_dim = step.q.shape[-1]
    pad = [(0, 0)] * 3 + [(0, make_attention_backend(backend).stored_head_dim(head_dim) - head_dim)]
    out = _write_and_attend(jnp.asarray(step.q), jnp.asarray(np.pad(step.k_pool, pad)),
                            jnp.asarray(np.pad(step.v_pool, pad)),
                            jnp.asarray(step.k_new), jnp.asarray(step.v_new), step.meta(),
                            None if sinks is None else jnp.asarray(sinks), backend=backend,
                            sliding_window=sliding_window, soft_cap=soft_cap)
    assert out.shape == step.q.shape and out.dtype == jnp.float32
    return np.asarray(out, np.float64)


def assert_matches(out: np.ndarray, expected: np.ndarray, real: np.ndarray, what: str) -> None:
    got = out[real]
    if not np.isfinite(got).all():
        pytest.fail(f"{what}: {np.sum(~np.isfinite(got))} non-finite outputs of real tokens")
    err = float(np.abs(got - expected[real]).max())
    if err >= TOLERANCE:
        pytest.fail(f"{what}: max abs error {err:.2e} against the float64 reference")


DECODE_ROWS = [(1, 1), (1, 5), (0, 0), (1, 12), (1, 24), (0, 0), (1, 4)]  # inactive rows: context 0
PREFILL_ROWS = [(5, 5), (3, 10), (0, 0), (8, 8), (1, 13), (2, 24)]  # (query_len, context_len)


@pytest.mark.parametrize("poison", list(POISON))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_attend_ignores_poisoned_pages(shape, backend, poison):
    """NaN/inf/huge in the scratch page, unowned pages, slots past the context and padding never leak."""
    rng = np.random.default_rng([shape == "decode", ATTENTION_BACKENDS.index(backend), list(POISON).index(poison)])
    if shape == "decode":
        step = make_step(rng, DECODE_ROWS, 1, poison=poison)
        step.query_lens = [1] * len(DECODE_ROWS)  # as the engine's decode step: inactive rows have 1 query, 0 keys
    else:
        step = make_step(rng, PREFILL_ROWS, 8, poison=poison)
    scratch = step.k_pool[:, 0]
    assert np.all((scratch == POISON[poison]) | np.isnan(scratch)), "the scratch page must be poisoned"
    out = attend(backend, step)
    assert_matches(out, reference(step), step.real(), f"{backend} {shape} {poison}")
    assert np.all(out[~step.real()] == 0.0), "padded query tokens and inactive rows must give zeros"


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_sliding_window(backend):
    rng = np.random.default_rng(41)
    step = make_step(rng, PREFILL_ROWS, 8)
    out = attend(backend, step, sliding_window=3)
    assert_matches(out, reference(step, sliding_window=3), step.real(), f"{backend} window")


def test_pallas_prefill_rows_match_xla_and_reference():
    """Rows of different query lengths, an empty row and padding: Pallas and XLA agree; padding gives zeros."""
    rng = np.random.default_rng(43)
    step = make_step(rng, [(8, 8), (0, 0), (2, 9), (4, 4), (0, 0), (1, 24)], 8)  # PREFILL_ROWS' shapes
    expected = reference(step)
    pallas, xla = attend("pallas-interpret", step), attend("xla", step)
    real = step.real()
    assert_matches(pallas, expected, real, "pallas prefill")
    assert_matches(xla, expected, real, "xla prefill")
    assert np.all(pallas[~real] == 0.0), "padded query tokens must give zeros"
    assert np.all(xla[~real] == 0.0), "padded query tokens must give zeros"


def _count_primitive(jaxpr, name: str) -> int:
    """Call sites of primitive `name` in `jaxpr`, counting inside every nested jaxpr once per call site."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _count_primitive(sub, name)
    return count


def test_pallas_prefill_is_one_kernel_call():
    rng = np.random.default_rng(47)
    step = make_step(rng, [(3, 3), (5, 9), (0, 0), (1, 12)], 5, poison="nan")
    meta = step.meta()
    kv = KVPages(jnp.asarray(step.k_pool), jnp.asarray(step.v_pool))
    closed = jax.make_jaxpr(lambda q, kv, meta: make_attention_backend("pallas-interpret").attend(
        q, kv, meta, sm_scale=0.25, sliding_window=None))(jnp.asarray(step.q), kv, meta)
    assert _count_primitive(closed.jaxpr, "pallas_call") == 1
    # The text alone cannot tell: jax prints a jaxpr shared by several call sites once.
    assert str(closed).count("pallas_call") == 1


@pytest.mark.parametrize("name,kind", [("xla", "XlaAttention"), ("pallas", "TritonAttention"),
                                       ("pallas-interpret", "TritonAttention"), ("pallas-tpu", "MosaicTpuAttention"),
                                       ("pallas-tpu-interpret", "MosaicTpuAttention")])
def test_the_backend_is_chosen_once_by_name_and_keeps_it(name, kind):
    attention = make_attention_backend(name, kv_cache_dtype="int8")
    assert type(attention.backend).__name__ == kind and attention.name == name
    assert isinstance(attention.backend, AttentionBackend)
    assert attention.quantized and hash(attention) == hash(make_attention_backend(name, kv_cache_dtype="int8"))


def test_an_unknown_backend_is_a_value_error_listing_the_backends():
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('xla', 'pallas'.*got 'cuda'"):
        make_attention_backend("cuda")


@pytest.mark.parametrize("backend, sliding_window", [("xla", None), ("xla", 5), ("pallas-interpret", 5),
                                                     ("pallas-tpu-interpret", None)])
def test_soft_cap_matches_the_reference(backend, sliding_window):
    """Gemma 2's attention-logit soft-cap in every backend, binding, with prefill and decode rows, poisoned."""
    rng = np.random.default_rng(53)
    step = make_step(rng, [(3, 3), (5, 9), (0, 0), (1, 12)], 5, poison="nan")
    step.q *= 4  # scores well past the cap, so capping changes the output
    expected = reference(step, sliding_window, soft_cap=1.5)
    assert_matches(attend(backend, step, sliding_window, soft_cap=1.5), expected, step.real(), f"{backend} soft-cap")
    assert np.abs(reference(step, sliding_window) - expected)[step.real()].max() > 1e-2


@pytest.mark.parametrize("backend, sliding_window", [("xla", None), ("xla", 5), ("pallas-interpret", 5),
                                                     ("pallas-tpu-interpret", None)])
def test_sinks_match_the_reference(backend, sliding_window):
    """gpt-oss's attention sinks in every backend, binding, with prefill and decode rows, poisoned pools."""
    rng = np.random.default_rng(54)
    step = make_step(rng, [(3, 3), (5, 9), (0, 0), (1, 12)], 5, poison="nan")
    sinks = rng.normal(0.0, 2.0, step.q.shape[2]).astype(np.float32)
    expected = reference(step, sliding_window, sinks=sinks)
    assert_matches(attend(backend, step, sliding_window, sinks=sinks), expected, step.real(), f"{backend} sinks")
    assert np.abs(reference(step, sliding_window) - expected)[step.real()].max() > 1e-2


@pytest.mark.parametrize("backend, sliding_window", [("xla", None), ("xla", 3), ("pallas-interpret", 3),
                                                     ("pallas-tpu-interpret", None)])
def test_query_limits_match_the_reference(backend, sliding_window):
    """Gemma 3's images seen both ways (`AttentionMetadata.query_limits`) in every backend, binding: an image
    inside a whole prompt and one that starts in the cache; padded tokens' limits are their positions (past the
    context), as the engine gives them."""
    rng = np.random.default_rng(55)
    step = make_step(rng, [(8, 8), (5, 9), (0, 0), (1, 12)], 8, poison="nan")
    limits = step.positions.copy()
    limits[0, 2:6] = 5  # an image at positions 2-5
    limits[1, :3] = 6  # positions 3-6, the first one cached
    expected = reference(step, sliding_window)
    step.query_limits = limits
    got = attend(backend, step, sliding_window)
    assert np.abs(reference(step, sliding_window) - expected)[step.real()].max() > 1e-2
    assert_matches(got, reference(step, sliding_window), step.real(), f"{backend} query limits")

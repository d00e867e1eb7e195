"""Checks of the Mosaic TPU kernels (`pallas_kernels.tpu`) in Pallas' TPU interpret mode, on the CPU.

The interpreter runs the kernels' DMAs and semaphores as a TPU would (`dma_execution_mode="on_wait"`: a copy
lands only when waited on, so reading a buffer before its wait shows up) and starts VMEM buffers as NaN. The
K/V pools carry NaN or huge values in every page and slot a row does not own, unowned page-table entries point
at poisoned pages or out of range, padded query tokens and inactive rows are NaN, and every result is compared
with the float64 numpy reference of tests/test_kernels.py. One call of each kernel runs under the
interpreter's race detector, with the grid split over two simulated cores (the detector compares cores'
vector clocks). The engine test runs whole models on the `pallas-tpu-interpret` backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter  # its race detector's state
from jax.experimental.pallas import tpu as pltpu

from jaxserve import LLM, SamplingParams
from pallas_kernels.tpu import ragged_paged_attention, write_to_pages
from tests.conftest import random_prompts
from tests.test_kernels import image_limits, make_paged_kv, numpy_ragged_reference

INTERPRET = pltpu.InterpretParams()
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}  # of the largest |output|; float32 is ~1e-6 off here


def make_rows(rng, rows, num_tokens, *, kv_heads, group, head_dim, page_size, dtype, int8=False, fp8=False,
              unowned="poison_pages"):
    """Padded-batch inputs `q [B, T, heads, D]` for rows of (query_len, context_len), (0, 0) inactive."""
    q_lens, contexts = [r[0] for r in rows], [r[1] for r in rows]
    pages_per_row = max(math.ceil(n / page_size) for n in contexts) + 1
    kv = make_paged_kv(rng, contexts, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       pages_per_seq=pages_per_row, int8=int8, fp8=fp8, unowned=unowned)
    q = rng.standard_normal((len(rows), num_tokens, kv_heads * group, head_dim)).astype(np.float32)
    for b, q_len in enumerate(q_lens):
        q[b, q_len:] = np.nan  # padding (and all of an inactive row)
    return jnp.asarray(q, dtype), np.asarray(contexts, np.int32), np.asarray(q_lens, np.int32), kv


def reference(q, contexts, q_lens, kv, dtype, window, soft_cap=None, sinks=None, query_limits=None):
    """The float64 ragged reference on the real tokens, put back in the padded layout (zeros elsewhere);
    `query_limits` in the padded layout too."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    flat = np.concatenate([q[b, :n] for b, n in enumerate(q_lens)])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    if query_limits is not None:
        query_limits = np.concatenate([query_limits[b, :n] for b, n in enumerate(q_lens)])
    ragged = numpy_ragged_reference(flat, kv_lens=contexts, cu_q_lens=cu, num_seqs=np.asarray([len(q_lens)]),
                                    sliding_window=window, soft_cap=soft_cap, sinks=sinks,
                                    query_limits=query_limits, **kv.host(dtype))
    out = np.zeros_like(q)
    for b, n in enumerate(q_lens):
        out[b, :n] = ragged[cu[b]:cu[b + 1]]
    return out


def assert_matches(out, expected, q_lens, dtype, what):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    real = np.arange(out.shape[1])[None, :] < np.asarray(q_lens)[:, None]
    assert np.isfinite(out).all(), f"{what}: non-finite outputs at {np.argwhere(~np.isfinite(out))[:4].tolist()}"
    assert np.all(out[~real] == 0.0), f"{what}: padded tokens and inactive rows must give zeros"
    err = np.abs(out - expected).max() / np.abs(expected).max()
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.2e} against the float64 reference"


# decode rows of length 1, a page boundary, a full table; prefill chunks (whole and extending a cache); inactive
def mixed_rows(page_size: int, num_tokens: int) -> list[tuple[int, int]]:
    return [(1, 1), (num_tokens, num_tokens), (1, page_size), (0, 0), (5, 3 * page_size + 2),
            (1, 4 * page_size), (3, 2 * page_size)]


CASES = [
    # id, group, kv_heads, head_dim, page_size, T, dtype, window, pages_per_block, query_tokens, quantized, unowned
    ("gqa1-d64-p16", 1, 2, 64, 16, 8, "float32", None, None, None, None, "poison_pages"),
    ("gqa3-d128-p8-win5", 3, 2, 128, 8, 8, "float32", 5, 2, 4, None, "out_of_range"),
    ("gqa8-d64-p8-qblocks", 8, 1, 64, 8, 16, "float32", None, 1, 4, None, "poison_pages"),
    ("bf16-gqa4-d128-p16-win20", 4, 2, 128, 16, 8, "bfloat16", 20, 1, None, None, "poison_pages"),
    ("int8-gqa2-d64-p16", 2, 2, 64, 16, 8, "float32", None, 2, None, "int8", "out_of_range"),
    ("fp8-gqa1-d128-p8-win12", 1, 2, 128, 8, 8, "bfloat16", 12, 2, 2, "fp8", "poison_pages"),
    ("bf16-gqa2-d512-p16", 2, 1, 512, 16, 8, "bfloat16", None, None, None, None, "poison_pages"),
]


@pytest.mark.parametrize("group,kv_heads,head_dim,page_size,num_tokens,dtype,window,pages_per_block,query_tokens,"
                         "quantized,unowned", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_ragged_matches_float64_reference(group, kv_heads, head_dim, page_size, num_tokens, dtype, window,
                                          pages_per_block, query_tokens, quantized, unowned):
    rng = np.random.default_rng([group, head_dim, page_size, num_tokens])
    rows = mixed_rows(page_size, num_tokens)
    q, contexts, q_lens, kv = make_rows(rng, rows, num_tokens, kv_heads=kv_heads, group=group, head_dim=head_dim,
                                        page_size=page_size, dtype=dtype, int8=quantized == "int8",
                                        fp8=quantized == "fp8", unowned=unowned)
    out = ragged_paged_attention(q, context_lens=jnp.asarray(contexts), query_lens=jnp.asarray(q_lens),
                                 page_tables=jnp.asarray(kv.page_indices), sliding_window=window,
                                 pages_per_block=pages_per_block, query_tokens=query_tokens, interpret=INTERPRET,
                                 **kv.device(dtype))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, reference(q, contexts, q_lens, kv, dtype, window), q_lens, dtype, "ragged")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_over_a_latent_pool_matches_float64_reference(dtype):
    """Multi-head Latent Attention (`value_dim`): 8 query heads over one pool of 256-wide rows whose first 128 lanes
    are also the values, each page copied once: the float64 reference is attention with those lanes as values."""
    import dataclasses

    rng = np.random.default_rng(11)
    rows = mixed_rows(8, 8)
    q, contexts, q_lens, kv = make_rows(rng, rows, 8, kv_heads=1, group=8, head_dim=256, page_size=8, dtype=dtype)
    out = ragged_paged_attention(q, jnp.asarray(kv.k_pages, dtype), None, jnp.asarray(contexts), jnp.asarray(q_lens),
                                 jnp.asarray(kv.page_indices), pages_per_block=2, value_dim=128, interpret=INTERPRET)
    assert out.shape == (*q.shape[:3], 128) and out.dtype == q.dtype
    values = dataclasses.replace(kv, v_pages=np.where(np.arange(256) < 128, kv.k_pages, 0.0))
    expected = reference(q, contexts, q_lens, values, dtype, None)
    assert_matches(out, expected[..., :128], q_lens, dtype, "latent")


@pytest.mark.parametrize("dtype,window,quantized", [("float32", None, None), ("bfloat16", 12, "int8")])
def test_ragged_soft_cap_matches_float64_reference(dtype, window, quantized):
    """Gemma 2's attention-logit soft-cap (cap 2, binding: logits of 4x-scaled queries), poisoned pools."""
    rng = np.random.default_rng(21)
    rows = mixed_rows(8, 8)
    q, contexts, q_lens, kv = make_rows(rng, rows, 8, kv_heads=2, group=2, head_dim=64, page_size=8, dtype=dtype,
                                        int8=quantized == "int8")
    q = q * 4
    out = ragged_paged_attention(q, context_lens=jnp.asarray(contexts), query_lens=jnp.asarray(q_lens),
                                 page_tables=jnp.asarray(kv.page_indices), sliding_window=window, soft_cap=2.0,
                                 pages_per_block=2, interpret=INTERPRET, **kv.device(dtype))
    expected = reference(q, contexts, q_lens, kv, dtype, window, soft_cap=2.0)
    assert np.abs(expected - reference(q, contexts, q_lens, kv, dtype, window)).max() > 0.1  # the cap binds
    assert_matches(out, expected, q_lens, dtype, "ragged soft-cap")


@pytest.mark.parametrize("dtype,window,quantized", [("float32", None, None), ("bfloat16", 12, "int8")])
def test_ragged_sinks_match_float64_reference(dtype, window, quantized):
    """gpt-oss's attention sinks (one logit per query head, binding), query blocks, poisoned pools."""
    rng = np.random.default_rng(22)
    rows = mixed_rows(8, 8)
    q, contexts, q_lens, kv = make_rows(rng, rows, 8, kv_heads=2, group=2, head_dim=64, page_size=8, dtype=dtype,
                                        int8=quantized == "int8")
    sinks = np.asarray([2.5, -1.0, 0.3, 6.0], np.float32)
    out = ragged_paged_attention(q, context_lens=jnp.asarray(contexts), query_lens=jnp.asarray(q_lens),
                                 page_tables=jnp.asarray(kv.page_indices), sliding_window=window,
                                 sinks=jnp.asarray(sinks), pages_per_block=2, query_tokens=4, interpret=INTERPRET,
                                 **kv.device(dtype))
    expected = reference(q, contexts, q_lens, kv, dtype, window, sinks=sinks)
    assert np.abs(expected - reference(q, contexts, q_lens, kv, dtype, window)).max() > 0.1  # the sinks bind
    assert_matches(out, expected, q_lens, dtype, "ragged sinks")


# (query_len, context, image span) per row of T = 16: an image across query blocks of 4 tokens and past the first
# block's last KV block (8 keys), one starting in the cached context, one opening the prompt, a decode row, none
IMAGE_ROWS = [(16, 22, (9, 17)), (6, 14, (5, 9)), (12, 12, (0, 3)), (1, 9, None), (0, 0, None)]


@pytest.mark.parametrize("dtype,window", [("float32", None), ("bfloat16", 5)])
def test_ragged_query_limits_match_float64_reference(dtype, window):
    """Gemma 3's images seen both ways (`query_limits`, binding), with GQA, query blocks, poisoned pools; padding's
    limits are garbage."""
    rng = np.random.default_rng(23)
    q, contexts, q_lens, kv = make_rows(rng, [r[:2] for r in IMAGE_ROWS], 16, kv_heads=2, group=2, head_dim=64,
                                        page_size=8, dtype=dtype)
    limits = np.full(q.shape[:2], 10**6, np.int32)
    for b, row in enumerate(IMAGE_ROWS):
        limits[b, :row[0]] = image_limits(*row)
    out = ragged_paged_attention(q, context_lens=jnp.asarray(contexts), query_lens=jnp.asarray(q_lens),
                                 page_tables=jnp.asarray(kv.page_indices), sliding_window=window,
                                 query_limits=jnp.asarray(limits), pages_per_block=1, query_tokens=4,
                                 interpret=INTERPRET, **kv.device(dtype))
    expected = reference(q, contexts, q_lens, kv, dtype, window, query_limits=limits)
    assert np.abs(expected - reference(q, contexts, q_lens, kv, dtype, window)).max() > 0.1  # the limits bind
    assert_matches(out, expected, q_lens, dtype, "ragged query limits")


def run_detecting_races(run):
    """`run()`'s result (one kernel call with `detect_races=True`), and whether the interpreter saw a race."""
    result = jax.block_until_ready(run())
    return result, tpu_interpreter.races.races_found


def test_ragged_has_no_races():
    """The double-buffered page copies never overlap the reads of the buffer they refill."""
    rng = np.random.default_rng(7)
    rows = [(1, 9), (4, 4), (2, 21)]
    q, contexts, q_lens, kv = make_rows(rng, rows, 4, kv_heads=2, group=2, head_dim=64, page_size=4,
                                        dtype="float32")
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)  # cells split over two cores
    call = lambda: ragged_paged_attention(  # noqa: E731
        q, context_lens=jnp.asarray(contexts), query_lens=jnp.asarray(q_lens),
        page_tables=jnp.asarray(kv.page_indices), pages_per_block=2, interpret=params, **kv.device("float32"))
    out, raced = run_detecting_races(call)
    assert not raced
    assert_matches(out, reference(q, contexts, q_lens, kv, "float32", None), q_lens, "float32", "races")


def make_write(rng, slots, *, kv_heads=2, num_pages=6, page_size=4, head_dim=64, dtypes=("float32", "int8")):
    """Pools of random data (each 8-bit pool followed by its float32 scales) and new tokens for `slots`."""
    pools = []
    for dtype in dtypes:
        shape = (kv_heads, num_pages, page_size, head_dim)
        if dtype == "int8":
            pools.append(rng.integers(-127, 128, shape).astype(np.int8))
        else:
            pools.append(np.asarray(rng.uniform(-100, 100, shape), jnp.dtype(dtype)))
        if jnp.dtype(dtype).itemsize == 1:
            pools.append(rng.uniform(0, 1, shape[:3]).astype(np.float32))
    new = tuple(np.asarray(rng.uniform(-100, 100, (kv_heads, len(slots), *pool.shape[3:])), pool.dtype)
                for pool in pools)
    return tuple(pools), new, np.asarray(slots, np.int32)


def expected_writes(pools, new, slots):
    """The pools after writing every token outside page 0, in numpy."""
    out = []
    for pool, tokens in zip(pools, new):
        page_size = pool.shape[2]
        expected = pool.copy()
        for t, slot in enumerate(slots):
            if slot >= page_size:
                expected[:, slot // page_size, slot % page_size] = tokens[:, t]
        out.append(expected)
    return out


def assert_bits_equal(got, expected):
    """Bitwise equality (fp8 and bfloat16 compared by their bytes)."""
    got = np.asarray(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def write(pools, new, slots, params=INTERPRET):
    return write_to_pages(tuple(jnp.asarray(p) for p in pools), tuple(jnp.asarray(n) for n in new),
                          jnp.asarray(slots), interpret=params)


WRITE_TOKENS = 160  # two grid cells of the write kernel, one per simulated core


def padded_slots(real: dict[int, int], tokens: int = WRITE_TOKENS) -> list[int]:
    """`tokens` slots: `real[token]` for the given tokens, the scratch page's slots 0-3 for the rest."""
    return [real.get(t, t % 4) for t in range(tokens)]


def test_write_to_pages_writes_only_real_slots_without_races():
    """Scattered slots over page boundaries, in both grid cells, are written; padding aimed at the scratch page 0
    is skipped; nothing else changes; an int8 pool and its scales are written by the same call."""
    rng = np.random.default_rng(3)
    page_size = 4
    slots = padded_slots({0: 5 * page_size + 3, 7: 2 * page_size, 8: 2 * page_size + 1, 130: page_size + 3,
                          159: 4 * page_size})
    pools, new, slots = make_write(rng, slots, page_size=page_size)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    written, raced = run_detecting_races(lambda: write(pools, new, slots, params))
    assert not raced
    for got, expected in zip(written, expected_writes(pools, new, slots)):
        assert_bits_equal(got, expected)


# slots of a pool of 8 pages of 8 rows: row groups are 2 rows (bfloat16) or 4 (int8, fp8), a scales group a page row
DECODE_SLOTS = {2: 8 + 1, 5: 3 * 8 + 6, 6: 7 * 8 + 3, 9: 5 * 8}  # lone tokens at odd rows; others keep their rows
PREFILL_SLOTS = {t: 2 * 8 + 3 + t for t in range(14)} | {20: 6 * 8 + 7, 21: 7 * 8}  # runs across groups, pages


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("slots", [DECODE_SLOTS, PREFILL_SLOTS], ids=["decode", "prefill"])
def test_write_to_pages_unaligned_rows_keep_their_group(dtype, slots):
    """Tokens at offsets inside a row group (a 32-bit word's 2 or 4 rows, a scales page row) are written exactly,
    in any order, and the group's other rows (earlier tokens of the sequence) keep their contents; padding in
    page 0 is skipped."""
    rng = np.random.default_rng(list(slots))
    order = rng.permutation(24)  # tokens come in any order, padding among them
    slots = [padded_slots(slots, 24)[t] for t in order]
    pools, new, slots = make_write(rng, slots, num_pages=8, page_size=8, dtypes=(dtype,))
    for got, expected in zip(write(pools, new, slots), expected_writes(pools, new, slots)):
        assert_bits_equal(got, expected)


def test_write_to_pages_race_detector_sees_a_shared_slot():
    """The detector is live: two tokens sent to one real slot from cells on two cores are a race."""
    pools, new, slots = make_write(np.random.default_rng(4), padded_slots({0: 9, 150: 9}), dtypes=("float32",))
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    _, raced = run_detecting_races(lambda: write(pools, new, slots, params))
    assert raced


def test_kernels_reject_bad_arguments():
    q = jnp.zeros((2, 8, 4, 64))
    pages = jnp.zeros((2, 5, 8, 64))
    lens, table = jnp.ones((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="query_tokens"):
        ragged_paged_attention(q, pages, pages, lens, lens, table, query_tokens=3, interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(jnp.zeros((2, 8, 3, 64)), pages, pages, lens, lens, table, interpret=INTERPRET)
    with pytest.raises(ValueError, match="new tokens"):
        write_to_pages((pages,), (jnp.zeros((2, 3, 32)),), jnp.zeros((3,), jnp.int32), interpret=INTERPRET)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_engine_greedy_tokens_match_xla(tiny_model_dirs, family):
    """Whole models on the interpreted TPU kernels: chunked prefills (16-token budget) run between the decode
    steps of earlier requests; the sliding windows (16, every other layer) are shorter than the sequences, Gemma 2
    caps its attention logits and gpt-oss has attention sinks."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 5, 30, seed=17)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(max_num_seqs=2, decode_batch_buckets=(2,), max_model_len=64, page_size=8,
                   max_num_batched_tokens=16, enable_prefix_caching=False, warmup=False)
    outputs = {backend: [out.outputs[0].token_ids for out in LLM(
        tiny_model_dirs[family], attention_backend=backend, **options).generate(prompts, params, use_tqdm=False)]
        for backend in ("xla", "pallas-tpu-interpret")}
    assert outputs["pallas-tpu-interpret"] == outputs["xla"]


def test_engine_tensor_parallel_int8_kv_matches_xla(tiny_llama_dir):
    """Two devices (one KV head each, the kernels under shard_map) and an int8 KV cache (the write kernel stores
    values and scales): the same greedy tokens as the xla backend with the same int8 cache."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 5, 30, seed=18)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(max_num_seqs=2, decode_batch_buckets=(2,), max_model_len=64, page_size=8,
                   max_num_batched_tokens=16, enable_prefix_caching=False, kv_cache_dtype="int8", warmup=False)
    xla = LLM(tiny_llama_dir, attention_backend="xla", **options).generate(prompts, params, use_tqdm=False)
    tpu = LLM(tiny_llama_dir, attention_backend="pallas-tpu-interpret", tensor_parallel_size=2, **options)
    assert tpu.llm_engine.runner.kv_cache[0].k.values.sharding.spec[0] is not None  # pools split on the heads
    assert [out.outputs[0].token_ids for out in tpu.generate(prompts, params, use_tqdm=False)] == [
        out.outputs[0].token_ids for out in xla]

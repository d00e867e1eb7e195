"""Quantized KV cache (issue 13): `kv_cache_dtype="int8"` and `"fp8"` (e4m3), per-token per-head scales.

Attention over quantized pools against a float64 reference on the dequantized K/V (both backends this machine
runs, poisoned pages included); the XLA path never dequantizes the whole pool; the engine end to end on a tiny
model: the Pallas kernels (interpret mode) give the XLA path's tokens, preemption, prefix caching and tensor
parallelism give the unconstrained one-device tokens, the page budget counts the quantized page, and the
capacity shows in the stats, the start-up log and /metrics.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.layers.attention import make_attention_backend
from jaxserve.layers.paged_kv import KVPages, QuantizedPages, quantize_kv
from tests.conftest import random_prompts, shard_shapes
from tests.test_attention import BACKENDS, DECODE_ROWS, PREFILL_ROWS, make_step, reference

KV_DTYPES = ("int8", "fp8")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def dequantize(values, scales) -> np.ndarray:
    return np.asarray(values, np.float64) * np.asarray(scales, np.float64)[..., None]


@pytest.mark.parametrize("kv_cache_dtype, max_relative_error", [("int8", 0.5 / 127), ("fp8", 2.0 ** -4)])
def test_quantize_kv_round_trip(kv_cache_dtype, max_relative_error):
    """Each vector's error is within half a step of its own scale (int8) or e4m3's relative rounding (fp8)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * rng.uniform(0.01, 100, (5, 3, 1)).astype(np.float32)
    x[2, 1] = 0.0  # an all-zero vector: scale 0, zeros, no NaN
    values, scales = quantize_kv(jnp.asarray(x), kv_cache_dtype)
    assert values.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_cache_dtype]
    assert scales.shape == (5, 3) and scales.dtype == jnp.float32
    back = dequantize(values, scales)
    assert np.all(np.isfinite(back)) and np.all(back[2, 1] == 0)
    peak = np.abs(x).max(axis=-1, keepdims=True)
    assert np.all(np.abs(back - x) <= max_relative_error * peak * 1.0001 + 1e-30)
    if kv_cache_dtype == "fp8":  # e4m3 is relative: small entries keep their precision, unlike int8
        big = np.abs(x) > peak / 64
        assert np.all(np.abs(back - x)[big] <= 2.0 ** -4 * np.abs(x)[big] * 1.0001)


def _quantized_step(step, kv_cache_dtype: str):
    """The step's float pools quantized per token (poison becomes NaN scales / garbage values) and the float K/V
    to write; the step's K/V are replaced by what the pool will hold, so the float64 reference reads exactly the
    stored numbers."""
    new_kv = (step.k_new, step.v_new)
    pools = []
    for pool in (step.k_pool, step.v_pool):
        values, scales = quantize_kv(jnp.asarray(pool), kv_cache_dtype)
        scales = jnp.where(np.isfinite(pool).all(axis=-1), scales, np.nan)  # poison: NaN scales
        pools.append(QuantizedPages(values, scales))
    for name in ("k_new", "v_new"):
        new = getattr(step, name)
        setattr(step, name, dequantize(*quantize_kv(jnp.asarray(new), kv_cache_dtype)).astype(np.float32))
    for name in ("k_past", "v_past"):
        setattr(step, name, [dequantize(*quantize_kv(jnp.asarray(p), kv_cache_dtype)) for p in getattr(step, name)])
    return pools, new_kv


@functools.partial(jax.jit, static_argnames=("backend",))
def _write_and_attend(q, k_pool, v_pool, k_new, v_new, meta, *, backend):
    kv = backend.write_kv(KVPages(k_pool, v_pool), k_new, v_new, meta.slot_mapping)
    return backend.attend(q, kv, meta, sm_scale=1 / math.sqrt(q.shape[-1]), sliding_window=None)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_attend_over_quantized_pages_matches_float64_reference(shape, backend, kv_cache_dtype):
    """write_kv quantizes the new tokens, attend applies every key's scales; NaN scales and garbage values in
    the scratch page, unowned pages and past the context never leak."""
    rng = np.random.default_rng([shape == "decode", len(backend), len(kv_cache_dtype)])
    if shape == "decode":
        step = make_step(rng, DECODE_ROWS, 1, page_size=8, head_dim=16)
        step.query_lens = [1] * len(DECODE_ROWS)
    else:
        step = make_step(rng, PREFILL_ROWS, 8, page_size=8, head_dim=16)
    (k_pool, v_pool), (k_new, v_new) = _quantized_step(step, kv_cache_dtype)
    assert np.isnan(np.asarray(k_pool.scales[:, 0])).all(), "the scratch page's scales must be poisoned"
    attention = make_attention_backend(backend, kv_cache_dtype=kv_cache_dtype)
    pad = attention.stored_head_dim(16) - 16  # pools of a backend that pads heads hold zeros past them
    k_pool, v_pool = (pool.replace(values=jnp.pad(pool.values, [(0, 0)] * 3 + [(0, pad)]))
                      for pool in (k_pool, v_pool))
    out = _write_and_attend(jnp.asarray(step.q), k_pool, v_pool, jnp.asarray(k_new), jnp.asarray(v_new),
                            step.meta(), backend=attention)
    out = np.asarray(out, np.float64)
    real = step.real()
    expected = reference(step)
    assert np.isfinite(out[real]).all()
    error = np.abs(out[real] - expected[real]).max()
    assert error < 1e-5, f"{backend} {kv_cache_dtype} {shape}: max abs error {error:.2e}"
    assert np.all(out[~real] == 0.0)


def _float_outputs(jaxpr):
    """(shape, dtype) of every floating-point value any equation in `jaxpr` (nested ones included) produces."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if jnp.issubdtype(var.aval.dtype, jnp.floating) and var.aval.dtype not in (jnp.float8_e4m3fn,):
                yield var.aval.shape
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _float_outputs(sub)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_xla_path_converts_per_block_never_the_whole_pool(kv_cache_dtype):
    """No float array as large as a layer's pool (or its pages of one row) appears in the XLA path's attend."""
    heads, pages, page_size, head_dim = 2, 64, 8, 16
    step = make_step(np.random.default_rng(5), [(1, 200), (1, 60)], 1, page_size=page_size, head_dim=head_dim,
                     pages_per_seq=32, kv_heads=heads)
    values = jnp.zeros((heads, pages, page_size, head_dim), {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_cache_dtype])
    pool = QuantizedPages(values, jnp.zeros((heads, pages, page_size), jnp.float32))
    backend = make_attention_backend("xla", kv_cache_dtype=kv_cache_dtype)
    closed = jax.make_jaxpr(lambda q, kv, meta: backend.attend(q, kv, meta, sm_scale=0.25, sliding_window=None))(
        jnp.asarray(step.q), KVPages(pool, pool), step.meta())
    row_tokens = 32 * page_size  # one row's whole page table
    sizes = [math.prod(shape) for shape in _float_outputs(closed.jaxpr)]
    assert sizes and max(sizes) < row_tokens * heads * head_dim, sorted(sizes)[-3:]


# -- the engine with quantized pages ----------------------------------------------------------------------------

SMALL = dict(max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=64, smallest_prefill_bucket=64,
             warmup=False)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_pallas_kernels_read_quantized_pages_as_the_xla_path_does(tiny_llama_dir, kv_cache_dtype):
    """The engine's pages (and their scales) through both Pallas kernels in interpret mode give the XLA path's
    greedy tokens with the same kv_cache_dtype."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 5, 40, seed=16)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(SMALL, decode_batch_buckets=(4,), kv_cache_dtype=kv_cache_dtype)
    xla = LLM(tiny_llama_dir, attention_backend="xla", **options)
    pallas = LLM(tiny_llama_dir, attention_backend="pallas-interpret", **options)
    k_pool = pallas.llm_engine.runner.kv_cache[0].k
    assert isinstance(k_pool, QuantizedPages)
    assert k_pool.values.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_cache_dtype]
    assert k_pool.scales.shape == k_pool.values.shape[:3] and k_pool.scales.dtype == jnp.float32
    assert token_ids(pallas.generate(prompts, params, use_tqdm=False)) == token_ids(
        xla.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("kv_cache_dtype", ["int8"])  # fp8 pages are the same QuantizedPages, another rounding
def test_preemption_prefix_caching_and_two_devices_with_quantized_pages(tiny_llama_dir, kv_cache_dtype):
    """Pages and scales split over two devices, too few pages (preemption) and shared prefixes (cache hits) give
    the tokens of one device with room for everything and no prefix caching, with the same kv_cache_dtype."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 500, 10, 60, seed=6)]
    shared = random_prompts(1, 500, 64, 64, seed=7)[0]
    prompts += [{"prompt_token_ids": shared + tail} for tail in random_prompts(3, 500, 3, 9, seed=8)]
    options = dict(max_num_seqs=8, max_model_len=256, page_size=16, max_num_batched_tokens=64, warmup=False,
                   smallest_prefill_bucket=64, decode_batch_buckets=(8,), kv_cache_dtype=kv_cache_dtype)
    reference = token_ids(LLM(tiny_llama_dir, enable_prefix_caching=False, **options).generate(
        prompts, params, use_tqdm=False))
    constrained = LLM(tiny_llama_dir, tensor_parallel_size=2, num_kv_pages=24, **options)
    k_pool = constrained.llm_engine.runner.kv_cache[0].k
    assert shard_shapes(k_pool.values) == {(1, *k_pool.shape[1:])}  # 2 KV heads: one per device
    assert shard_shapes(k_pool.scales) == {(1, *k_pool.shape[1:3])}
    assert {s.device for s in k_pool.scales.addressable_shards} == set(constrained.llm_engine.runner.mesh.devices.flat)
    assert token_ids(constrained.generate(prompts, params, use_tqdm=False)) == reference
    stats = constrained.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("dtype, kv_cache_dtype, storage", [
    ("float32", "auto", "float32"), ("float32", "int8", "int8"), ("float32", "fp8", "float8_e4m3fn"),
    ("bfloat16", "auto", "bfloat16"), ("bfloat16", "int8", "int8"),
])
def test_page_budget_counts_the_quantized_page_and_shows_it(tiny_llama_dir, monkeypatch, caplog, dtype,
                                                            kv_cache_dtype, storage):
    """The CPU pool budget holds (head_dim * itemsize) / (head_dim + 4 bytes of scale) times the pages, and the
    capacity and dtype show in the stats, the start-up log and /metrics."""
    from jaxserve.engine import kv_budget
    from jaxserve.server.metrics import EngineCollector

    budget = 64 * 4096  # 64 float32 pages of the tiny model (2 layers x 2 KV heads x 8 tokens x 16 dims x 4 B, K+V)
    monkeypatch.setattr(kv_budget, "CPU_POOL_BYTES", budget)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.kv_plan"):
        llm = LLM(tiny_llama_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, max_model_len=256,
                  page_size=8, max_num_batched_tokens=64, warmup=False)
    runner = llm.llm_engine.runner
    head_dim, itemsize = 16, {"float32": 4, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1}[storage]
    token_bytes = head_dim * itemsize + (4 if kv_cache_dtype != "auto" else 0)
    plan = runner.kv_plan
    assert plan.groups[0].page_bytes == 2 * 2 * 8 * 2 * token_bytes
    assert plan.num_pages == budget // plan.groups[0].page_bytes  # 64 (float32), 128 (bf16), 204 (int8 / fp8)
    leaves = jax.tree.leaves(runner.kv_cache)
    assert sum(leaf.nbytes for leaf in leaves) == plan.pool_bytes  # what is allocated is what was counted
    assert {leaf.dtype.name for leaf in leaves} == ({storage, "float32"} if kv_cache_dtype != "auto" else {storage})
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids  # it serves
    stats = llm.llm_engine.stats()
    capacity = (plan.num_pages - 1) * 8
    assert (stats.kv_cache_capacity_tokens, stats.kv_cache_dtype, stats.kv_cache_storage_dtype) == (
        capacity, kv_cache_dtype, storage)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("KV pools:", "KV cache group"))]
    assert f"kv_cache_dtype {kv_cache_dtype}: {storage} pages" in lines[0] and len(lines) == 2
    assert f"({capacity} usable tokens)" in lines[1]
    samples = {(family.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in EngineCollector([llm.llm_engine.stats], "tiny").collect() for sample in family.samples}
    labels = (("kv_cache_dtype", kv_cache_dtype), ("model_name", "tiny"), ("storage_dtype", storage))
    assert samples[("jaxserve:kv_cache_capacity_tokens", labels)] == capacity


def test_an_unknown_kv_cache_dtype_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'\), got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_attention_backend("xla", kv_cache_dtype="float8")


def test_default_model_keeps_16_of_32_greedy_tokens_with_int8_and_fp8_pages(tmp_path):
    """Issue 13's target on the default model (float32): a mean common prefix of at least 16 of 32 greedy tokens
    with the float KV cache, on the first shipped prompts (benchmarks/quality.py measures more of them, and
    teacher-forces the reference's tokens too, which this leaves out)."""
    from benchmarks import quality

    result = quality.main(["--modes", "float", "kv-int8", "kv-fp8", "--num-prompts", "3", "--max-tokens", "32",
                           "--max-model-len", "256", "--max-num-seqs", "4", "--result-file", str(tmp_path / "q.json"),
                           "--no-plot", "--disable-tqdm", "--no-teacher-forcing"])
    assert [row["mode"] for row in result["rows"]] == ["float", "kv-int8", "kv-fp8"] and result["num_prompts"] >= 3
    for row in result["rows"][1:]:
        assert row["mean_common_prefix"] >= 16, row


def test_teacher_forcing_agrees_with_greedy_decoding_and_sees_the_kv_pages_quantized(tiny_llama_dir, tmp_path):
    """benchmarks/quality.py's teacher forcing (the default-model run above leaves it out), on a tiny model: the
    float mode's forward over its own greedy tokens has them as its argmax everywhere, and int8 KV pages change
    the logprobs it gives them, a little."""
    from benchmarks import quality

    result = quality.main(["--model", tiny_llama_dir, "--modes", "float", "kv-int8", "--num-prompts", "2",
                           "--max-tokens", "8", "--max-model-len", "256", "--max-num-seqs", "2", "--result-file",
                           str(tmp_path / "q.json"), "--no-plot", "--disable-tqdm"])
    reference, int8 = result["rows"]
    assert result["num_prompts"] == 2
    assert reference["teacher_forced_argmax_agreement"] == 1 and reference["mean_abs_logprob_diff"] == 0
    assert 0 < int8["mean_abs_logprob_diff"] < 0.05, int8

"""The engine end to end on a tiny random model: batching, staggering, preemption, prefix caching, sampling,
bad input, donation and recompiles."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.sampling_params import GuidedDecodingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_OPTIONS = dict(max_num_seqs=8, max_model_len=256, page_size=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """Prefix caching off, so a request run alone never reuses K/V that an earlier run computed."""
    return LLM(tiny_llama_dir, enable_prefix_caching=False, **ENGINE_OPTIONS)


def token_ids(outputs):
    return [out.outputs[0].token_ids for out in outputs]


def test_greedy_matches_transformers(llm, tiny_llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = random_prompts(3, 500, 5, 40, seed=3)
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref


def test_batch_invariance(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(20, 500, 1, 90, seed=4)]
    together = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]
    assert together == alone


def test_staggered_arrival_short_requests_do_not_wait(llm):
    engine = llm.llm_engine
    long_params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = random_prompts(4, 500, 5, 30, seed=5)
    engine.add_request("long", {"prompt_token_ids": prompts[0]}, long_params)
    finished_at = {}
    for step in range(200):
        if step == 5:
            engine.add_request("short-a", {"prompt_token_ids": prompts[1]}, short_params)
        if step == 8:
            engine.add_request("short-b", {"prompt_token_ids": prompts[2]}, short_params)
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = (step, out.outputs[0].token_ids)
        if len(finished_at) == 3:
            break
    assert finished_at["short-a"][0] < finished_at["long"][0] and finished_at["short-b"][0] < finished_at["long"][0]
    alone = token_ids(llm.generate([{"prompt_token_ids": prompts[0]}], long_params))[0]
    assert finished_at["long"][1] == alone
    assert finished_at["short-a"][1] == token_ids(llm.generate([{"prompt_token_ids": prompts[1]}], short_params))[0]


def test_preemption_gives_identical_outputs(llm, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, 500, 10, 60, seed=6)]
    small = LLM(tiny_llama_dir, max_num_seqs=16, max_model_len=256, page_size=16, num_kv_pages=41,
                max_num_batched_tokens=64, smallest_prefill_bucket=64, decode_batch_buckets=(16,), warmup=False)
    constrained = token_ids(small.generate(prompts, params, use_tqdm=False))
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert small.llm_engine.page_manager.num_free_pages == 40
    assert constrained == token_ids(llm.generate(prompts, params, use_tqdm=False))


def test_prefix_caching_hits_and_matches_uncached(tiny_llama_dir):
    prefix = random_prompts(1, 500, 200, 200, seed=7)[0]
    prompts = [{"prompt_token_ids": prefix + tail} for tail in random_prompts(6, 500, 3, 20, seed=8)]
    cached = LLM(tiny_llama_dir, warmup=False, **ENGINE_OPTIONS)  # the fixture's shapes: cache hits
    first = token_ids(cached.generate(prompts[:1], GREEDY))
    rest = token_ids(cached.generate(prompts[1:], GREEDY, use_tqdm=False))
    manager = cached.llm_engine.page_manager
    assert manager.num_prefix_hits >= 5 * 192
    uncached = LLM(tiny_llama_dir, enable_prefix_caching=False, warmup=False, **ENGINE_OPTIONS)
    assert first + rest == token_ids(uncached.generate(prompts, GREEDY, use_tqdm=False))
    assert uncached.llm_engine.page_manager.num_prefix_hits == 0
    # after unrelated traffic, a request gives what a fresh engine gives
    other = {"prompt_token_ids": random_prompts(1, 500, 50, 50, seed=9)[0]}
    assert token_ids(cached.generate([other], GREEDY)) == token_ids(uncached.generate([other], GREEDY))


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 500, 4, 30, seed=10)]
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = token_ids(llm.generate(prompts[:1], params))[0]
    again = token_ids(llm.generate(prompts[:1], params))[0]
    mixed = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 4
    batched = token_ids(llm.generate(prompts, [params] + mixed, use_tqdm=False))[0]
    assert alone == again == batched
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert token_ids(llm.generate(prompts[:1], other_seed))[0] != alone


def test_top_k_one_equals_greedy(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 4, 30, seed=11)]
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=5)
    assert token_ids(llm.generate(prompts, top1, use_tqdm=False)) == token_ids(llm.generate(prompts, GREEDY))


def test_stop_token_ids_and_min_tokens(llm):
    prompt = {"prompt_token_ids": random_prompts(1, 500, 20, 20, seed=12)[0]}
    free_run = token_ids(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))[0]
    stop_token = free_run[5]
    first_at = free_run.index(stop_token)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == free_run[:first_at + 1]
    # min_tokens bans stop tokens from the first min_tokens outputs (vLLM's meaning); the next may be one
    for min_tokens in (first_at, first_at + 2):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                    min_tokens=min_tokens, stop_token_ids=[stop_token]))[0].outputs[0]
        assert stop_token not in out.token_ids[:min_tokens]
        if stop_token in out.token_ids:
            assert out.finish_reason == "stop" and out.stop_reason == stop_token
            assert out.token_ids.index(stop_token) == len(out.token_ids) - 1 >= min_tokens
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 20
        if min_tokens == first_at:  # the ban ends just in time: the free run's stop is kept
            assert out.token_ids == free_run[:first_at + 1] and out.finish_reason == "stop"


def test_stop_string_before_min_tokens_stays_in_the_text(llm):
    """vLLM's rule: stop strings are not checked before min_tokens outputs, and `text` stays a prefix of the
    decoded tokens (it was cut out of the middle: "abc STOP def" came back as "abc  def")."""
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": random_prompts(1, 256, 20, 20, seed=13)[0]}
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    texts = []  # the text after each output token
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step()]
    free = texts[-1]
    stop = free[4:7]
    assert len(texts) == 30 and free.count(stop) == 1
    seen = next(count for count, text in enumerate(texts, start=1) if stop in text)
    early = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=seen + 1)
    out = llm.generate([prompt], early)[0].outputs[0]
    assert out.text == free and out.finish_reason == "length"
    in_time = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=seen)
    out = llm.generate([prompt], in_time)[0].outputs[0]
    assert out.text == free[:4] and out.finish_reason == "stop" and out.stop_reason == stop and len(out.token_ids) == seen


def test_n_gives_distinct_completions_and_logprobs(llm):
    prompt = {"prompt_token_ids": random_prompts(1, 500, 10, 10, seed=14)[0]}
    out = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True,
                                                logprobs=3))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for completion in out.outputs:
        assert len(completion.logprobs) == 10
        for token, step_logprobs in zip(completion.token_ids, completion.logprobs):
            assert token in step_logprobs and len(step_logprobs) in (3, 4)
            assert all(v <= 0 for v in step_logprobs.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(lp[t] for t, lp in zip(completion.token_ids, completion.logprobs)), rel=1e-5)


@pytest.mark.parametrize("make_bad, message", [
    (lambda: SamplingParams(max_tokens=-1), "max_tokens"),
    (lambda: SamplingParams(top_p=2), "top_p"),
    (lambda: SamplingParams(temperature=-1), "temperature"),
    (lambda: SamplingParams(n=0), "n must"),
])
def test_bad_sampling_params_raise(make_bad, message):
    with pytest.raises(ValueError, match=message):
        make_bad()


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 300}], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 100000]}], GREEDY)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 250}], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == 12


def test_abort_frees_slot_and_pages(llm):
    engine = llm.llm_engine
    free_before = engine.page_manager.num_free_pages
    engine.add_request("to-abort", {"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("to-abort")
    outputs = engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.request_id == "to-abort"] == ["abort"]
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_running == 0 and engine.page_manager.num_free_pages == free_before


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_kv_pool_is_donated_and_no_compiles_after_warmup(llm, tiny_llama_dir, caplog, tensor_parallel_size):
    """A mixed workload — penalties, min_tokens with many stop ids, logprobs, n > 1, a constrained request (its
    token masks sent from the host), short and long prompts, chunked prefill — runs only the executables compiled
    at start-up, on one device or split over two."""
    if tensor_parallel_size > 1:
        llm = LLM(tiny_llama_dir, enable_prefix_caching=False, tensor_parallel_size=tensor_parallel_size,
                  **ENGINE_OPTIONS)
    runner = llm.llm_engine.runner
    old_pool = runner.kv_cache[0].k
    prompts = [{"prompt_token_ids": p} for p in random_prompts(9, 500, 1, 200, seed=15)]
    many_stop_ids = list(range(400, 440))  # more than one chunk of banned ids
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=20, seed=1, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=7, n=3, seed=2, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=10, stop_token_ids=many_stop_ids),
        SamplingParams(temperature=0.5, top_k=5, min_p=0.1, max_tokens=25, min_tokens=5, seed=3, logprobs=20,
                       stop_token_ids=many_stop_ids[:17]),
        SamplingParams(n=2, temperature=0, max_tokens=12, logprobs=0, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=50, seed=4, repetition_penalty=0.9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, guided_decoding=GuidedDecodingParams(regex="[a-z]{2,9}")),
    ]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        llm.generate(prompts, params, use_tqdm=False)
        compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
        jax.jit(lambda x: x + 1)(np.ones(7))  # proves the capture sees a compile when one happens
        assert len([r for r in caplog.records if "Compiling" in r.getMessage()]) == len(compiles) + 1
    assert compiles == []
    assert old_pool.is_deleted()


def test_pallas_interpret_backend_gives_identical_greedy_outputs(llm, tiny_model_dirs):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 5, 40, seed=16)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for family in ("gemma2",):  # sliding window (16), GQA and the attention soft-cap through both kernels
        options = dict(ENGINE_OPTIONS, max_num_seqs=4, decode_batch_buckets=(4,), smallest_prefill_bucket=64,
                       max_model_len=64, warmup=False)
        xla = LLM(tiny_model_dirs[family], attention_backend="xla", **options)
        pallas = LLM(tiny_model_dirs[family], attention_backend="pallas-interpret", **options)
        assert pallas.llm_engine.runner.kv_cache[0].k.shape[0] == 2  # heads-major pool layout for the kernels
        assert token_ids(pallas.generate(prompts, params, use_tqdm=False)) == token_ids(
            xla.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("aging_seconds, expected", [(1e6, ["p0", "p1", "p5"]), (1e-9, ["p5", "p0", "p1"])])
def test_priority_scheduling_with_aging(tiny_llama_dir, aging_seconds, expected):
    llm = LLM(tiny_llama_dir, max_num_seqs=1, max_model_len=64, page_size=8, max_num_batched_tokens=16,
              scheduling_policy="priority", priority_aging_seconds=aging_seconds, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for name, priority in (("p5", 5), ("p0", 0), ("p1", 1)):  # arrival order p5, p0, p1
        llm.llm_engine.add_request(name, {"prompt_token_ids": [3, 4, 5]}, params, priority=priority)
    finished = []
    while llm.llm_engine.has_unfinished_requests():
        finished += [out.request_id for out in llm.llm_engine.step() if out.finished]
    # with slow aging the priority decides; with instant aging the wait dominates (no starvation)
    assert finished == expected


def test_compilation_cache_is_under_the_cache_root_unless_disabled(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("JAXSERVE_DISABLE_COMPILE_CACHE", raising=False)
    assert EngineConfig().compilation_cache_dir == str(tmp_path / "xla")
    monkeypatch.setenv("JAXSERVE_DISABLE_COMPILE_CACHE", "1")
    assert EngineConfig().compilation_cache_dir is None
    assert EngineConfig(compilation_cache_dir=str(tmp_path)).compilation_cache_dir == str(tmp_path)

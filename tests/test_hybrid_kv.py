"""The hybrid KV cache end to end (issue 29): sliding-window layers in a pool of their own give the outputs of one
pool for every layer (greedy and seeded, chunked prefill, preemption, prefix caching, two devices, n-gram
speculation), fit more long sequences in the same bytes, and compile nothing after warm-up.
(`tests/test_model.py` checks greedy tokens against transformers for every windowed family with it on.)"""

from __future__ import annotations

import logging

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import random_prompts

OPTIONS = dict(max_num_seqs=8, max_model_len=160, page_size=8, max_num_batched_tokens=32)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(8, 500, 100, 140, seed=29)]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)] * 4


def run(llm: LLM) -> tuple[list, int]:
    """Every prompt's tokens, and the most sequences that were decoding (whole context in the pools) at once."""
    engine = llm.llm_engine
    for index, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(index), prompt, params)
    outputs, most = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = output.outputs[0].token_ids
        most = max(most, sum(not seq.is_prefilling for seq in engine.scheduler.running))
    return [outputs[index] for index in range(len(PROMPTS))], most


@pytest.fixture(scope="module")
def uniform(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["gemma3_text"], **OPTIONS, kv_cache_memory_bytes=300_000,
              disable_hybrid_kv_cache_manager=True, warmup=False)
    assert len(llm.llm_engine.runner.kv_plan.groups) == 1
    return run(llm)


def test_the_same_bytes_hold_more_long_sequences_with_the_same_outputs(tiny_model_dirs, uniform, caplog):
    expected, uniform_most = uniform
    llm = LLM(tiny_model_dirs["gemma3_text"], **OPTIONS, kv_cache_memory_bytes=300_000)
    runner = llm.llm_engine.runner
    plan = runner.kv_plan
    assert len(plan.groups) == 2 and len(plan.groups[1].layers) == 2 and plan.pool_bytes <= 300_000
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        outputs, most = run(llm)
    assert [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()] == []
    assert outputs == expected
    assert most >= 2 * uniform_most  # (preemption under the hybrid cache: tests/test_model.py's engine test)
    stats = llm.llm_engine.stats()
    assert stats.kv_cache_window_capacity_tokens == plan.groups[1].capacity_tokens > 0


def test_two_devices_and_ngram_speculation(tiny_model_dirs, uniform):
    expected, _ = uniform
    for options in ({"tensor_parallel_size": 2},
                    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        llm = LLM(tiny_model_dirs["gemma3_text"], **OPTIONS, kv_cache_memory_bytes=300_000, warmup=False, **options)
        assert len(llm.llm_engine.runner.kv_plan.groups) == 2
        assert run(llm)[0] == expected, options


def test_a_budget_too_small_for_one_sequence_is_a_clear_error(tiny_model_dirs):
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(tiny_model_dirs["gemma3_text"], **OPTIONS, kv_cache_memory_bytes=20_000, warmup=False)

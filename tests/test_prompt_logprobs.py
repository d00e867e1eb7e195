"""Prompt scoring (`SamplingParams(prompt_logprobs=k)`) on a tiny random model, against HF transformers' full forward
over the whole prompt: chunked prefill, prefix caching, preemption, a batch mixed with ordinary requests,
max_tokens=0, DELTA outputs, and no compile after warm-up."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, Logprob, SamplingParams
from jaxserve.sampling_params import MAX_LOGPROBS, RequestOutputKind
from jaxserve.engine.steps import SCORE_POSITIONS
from tests.conftest import random_prompts

CHUNKED = dict(max_num_seqs=8, max_model_len=256, page_size=8, max_num_batched_tokens=16)  # 16-token chunks
TOLERANCE = 1e-4  # float32 on the CPU: the engine's paged attention against HF's, in log-probability


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chunked_llm(tiny_llama_dir):
    """Prefix caching off: every prompt is computed here, so only the tests that turn it on exercise it."""
    return LLM(tiny_llama_dir, enable_prefix_caching=False, **CHUNKED)


def reference(hf_model, prompt: list[int]) -> list[np.ndarray | None]:
    """Per prompt token: None for the first, then the log-softmax the token was drawn from, from one forward."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].double(), dim=-1).numpy()
    return [None] + [logprobs[j - 1] for j in range(1, len(prompt))]


def assert_matches(prompt_logprobs, prompt: list[int], expected: list[np.ndarray | None], k: int) -> None:
    """One entry per prompt token: the token's logprob and rank, and the top k, as in the reference (ranks and top
    ids are compared up to near-ties, which float32 may order either way)."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry, row = prompt_logprobs[j], expected[j]
        assert prompt[j] in entry and len(entry) in (k, k + 1) and len(entry) >= 1, j
        assert all(isinstance(value, Logprob) for value in entry.values())
        for token, value in entry.items():
            assert value.logprob == pytest.approx(row[token], abs=TOLERANCE), (j, token)
        chosen = row[prompt[j]]
        assert np.sum(row > chosen + TOLERANCE) < entry[prompt[j]].rank <= np.sum(row >= chosen - TOLERANCE), j
        top = sorted((value for token, value in entry.items() if token != prompt[j] or value.rank <= k),
                     key=lambda value: value.rank)
        assert [value.rank for value in top] == list(range(1, k + 1)), j
        np.testing.assert_allclose([value.logprob for value in top], np.sort(row)[::-1][:k], atol=TOLERANCE)


def test_prompt_logprobs_equal_a_full_forward_across_chunks(chunked_llm, hf_model):
    """Prompts over 1..7 chunks of 16: the last position of each chunk predicts the next chunk's first token."""
    prompts = [[7], [7, 9]] + random_prompts(4, 500, 15, 110, seed=21) + [random_prompts(1, 500, 16, 16, seed=22)[0]]
    k = 5
    outs = chunked_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k),
                                use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), k)
        decoded = chunked_llm.get_tokenizer().decode([prompt[-1]])
        assert len(prompt) == 1 or out.prompt_logprobs[-1][prompt[-1]].decoded_token == decoded


def test_prompt_logprobs_of_prefill_calls_larger_than_one_scoring_chunk(tiny_llama_dir, hf_model):
    """A 512-token prefill call (one prompt, or four packed) is scored SCORE_POSITIONS positions at a time."""
    assert 512 > SCORE_POSITIONS
    llm = LLM(tiny_llama_dir, enable_prefix_caching=False, max_num_seqs=8, max_model_len=512, page_size=16,
              max_num_batched_tokens=512)
    prompts = random_prompts(1, 500, 400, 400, seed=30) + random_prompts(4, 500, 100, 120, seed=31)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 2)


def test_requests_without_prompt_logprobs_get_none_and_k_zero_gives_the_prompt_token_only(chunked_llm, hf_model):
    prompt = random_prompts(1, 500, 40, 40, seed=23)[0]
    plain, zero = chunked_llm.generate([{"prompt_token_ids": prompt}] * 2, [
        SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)])
    assert plain.prompt_logprobs is None
    assert_matches(zero.prompt_logprobs, prompt, reference(hf_model, prompt), 0)
    assert all(len(entry) == 1 for entry in zero.prompt_logprobs[1:])


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, "3"])
def test_bad_prompt_logprobs_raise_naming_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prefix_cache_hits_do_not_skip_scored_positions(tiny_llama_dir, hf_model):
    """A prompt whose first 64 tokens are cached still gets every position scored (the lookup is skipped), and a
    later request without prompt_logprobs still hits the cache."""
    llm = LLM(tiny_llama_dir, enable_prefix_caching=True, **CHUNKED)
    prefix = random_prompts(1, 500, 64, 64, seed=24)[0]
    first, scored, later = [prefix + tail for tail in random_prompts(3, 500, 10, 20, seed=25)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": first}], params)
    out = llm.generate([{"prompt_token_ids": scored}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                                      prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, scored, reference(hf_model, scored), 3)
    assert llm.generate([{"prompt_token_ids": later}], params)[0].num_cached_tokens >= 64


def test_preemption_scores_every_prompt_token_exactly_once(tiny_llama_dir, hf_model):
    """Long prompts prefilled 16 tokens a step in a pool too small for all: sequences are preempted mid-prefill and
    recomputed, and each prompt's list still has one entry per token, equal to the reference."""
    llm = LLM(tiny_llama_dir, max_num_seqs=8, max_model_len=256, page_size=8, num_kv_pages=40,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = random_prompts(8, 500, 60, 120, seed=26)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 2)
    assert llm.llm_engine.page_manager.num_free_pages == 39


def test_mixed_batch_keeps_other_outputs_and_compiles_nothing(tiny_llama_dir, hf_model, caplog):
    """Scoring rows packed into one prefill call with ordinary greedy and seeded rows (16-token chunks four to a
    call): every request's tokens are those of the same batch without prompt_logprobs, and the scoring prefills were
    compiled at start-up."""
    llm = LLM(tiny_llama_dir, enable_prefix_caching=False, **dict(CHUNKED, max_num_batched_tokens=64))
    assert (4, 16) in llm.llm_engine.engine_config.prefill_shapes
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 500, 9, 16, seed=27)]
    prompts += [{"prompt_token_ids": p} for p in random_prompts(2, 500, 40, 70, seed=28)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    plain = [greedy, sampled, greedy, sampled, greedy, sampled, greedy, sampled]
    scoring = [dataclasses.replace(params, prompt_logprobs=4) if i % 3 == 1 else params
               for i, params in enumerate(plain)]
    expected = llm.generate(prompts, plain, use_tqdm=False)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        got = llm.generate(prompts, scoring, use_tqdm=False)
    assert [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage() or "warm-up" in r.getMessage()] == []
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for i, (prompt, out) in enumerate(zip(prompts, got)):
        if i % 3 == 1:
            ids = prompt["prompt_token_ids"]
            assert_matches(out.prompt_logprobs, ids, reference(hf_model, ids), 4)
        else:
            assert out.prompt_logprobs is None


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(chunked_llm, hf_model):
    prompt = random_prompts(1, 500, 50, 50, seed=29)[0]
    free_before = chunked_llm.llm_engine.page_manager.num_free_pages
    out = chunked_llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(max_tokens=0, n=2, temperature=1.0, prompt_logprobs=1))[0]
    assert [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] == [([], "", "length")] * 2
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 1)
    assert chunked_llm.llm_engine.page_manager.num_free_pages == free_before
    assert not chunked_llm.llm_engine.has_unfinished_requests()
    unscored = chunked_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0))[0]
    assert unscored.outputs[0].token_ids == [] and unscored.prompt_logprobs is None


def test_delta_outputs_carry_the_prompt_logprobs_once_with_the_first_tokens(chunked_llm, hf_model):
    engine = chunked_llm.llm_engine
    prompt = random_prompts(1, 500, 70, 70, seed=30)[0]
    engine.add_request("delta", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2,
                                      output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[0].outputs[0].token_ids  # nothing was reported before the prompt was scored
    assert_matches(outputs[0].prompt_logprobs, prompt, reference(hf_model, prompt), 2)
    assert all(out.prompt_logprobs is None for out in outputs[1:])
    assert sum(len(out.outputs[0].token_ids) for out in outputs) == 5


def test_prompt_logprobs_with_the_vocabulary_split_over_two_devices(tiny_llama_dir, hf_model):
    """Tensor parallelism shards the logits' vocabulary: the log-softmax and top-k of the scoring prefill span it."""
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, enable_prefix_caching=False, **CHUNKED)
    prompt = random_prompts(1, 500, 45, 45, seed=31)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 3)

"""A request's life in the engine: output kinds and snapshots, ids, aborts in every state, counters, the
context limit, and exactness under preemption and prefix caching with sampling, penalties and logprobs."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import RequestOutputKind
from tests.conftest import random_prompts

ENGINE_OPTIONS = dict(max_num_seqs=8, max_model_len=256, page_size=8, max_num_batched_tokens=64, warmup=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLM(tiny_llama_dir, **ENGINE_OPTIONS).llm_engine


def run(engine: LLMEngine) -> list:
    """Steps until idle; every output in order."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def prompt(seed: int, length: int = 20) -> dict:
    return {"prompt_token_ids": random_prompts(1, 500, length, length, seed=seed)[0]}


def test_outputs_are_snapshots(engine):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=20, logprobs=2, ignore_eos=True)
    engine.add_request("snap", prompt(1), params)
    outputs = run(engine)
    assert len(outputs) == 20 and outputs[-1].finished
    for count, output in enumerate(outputs, start=1):  # each kept its own state, though the engine moved on
        completion = output.outputs[0]
        assert len(completion.token_ids) == len(completion.logprobs) == count
        assert output.metrics is not outputs[-1].metrics or output is outputs[-1]
    assert [o.metrics.last_token_time for o in outputs] == sorted(o.metrics.last_token_time for o in outputs)
    assert len({o.metrics.last_token_time for o in outputs}) == 20


def test_delta_outputs_add_up_to_the_cumulative_one(engine):
    params = dict(temperature=0.8, seed=2, max_tokens=15, logprobs=1, n=2, stop=["a"])
    engine.add_request("cumulative", prompt(2), SamplingParams(**params))
    final = run(engine)[-1]
    engine.add_request("delta", prompt(2), SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    deltas = run(engine)
    for index, completion in enumerate(final.outputs):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        assert "".join(c.text for c in parts) == completion.text
        assert [t for c in parts for t in c.token_ids] == completion.token_ids
        assert [lp for c in parts for lp in c.logprobs] == completion.logprobs
        assert [c.finish_reason for c in parts].count(completion.finish_reason) == 1  # reported once, at the end
        assert all(c.token_ids or c.text or c.finish_reason for c in parts)  # no empty deltas
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1


def test_final_only_gives_one_output(engine):
    engine.add_request("final", prompt(3), SamplingParams(**vars(GREEDY) | {"output_kind": RequestOutputKind.FINAL_ONLY}))
    outputs = run(engine)
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 12


def test_duplicate_request_id_is_rejected_until_it_finishes(engine):
    engine.add_request("dup", prompt(4), GREEDY)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", prompt(5), GREEDY)
    first = run(engine)[-1]
    engine.add_request("dup", prompt(4), GREEDY)  # free again once finished
    assert run(engine)[-1].outputs[0].token_ids == first.outputs[0].token_ids


def test_generated_ids_skip_ids_in_use(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS)
    llm.llm_engine.add_request("0", prompt(6), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    outputs = llm.generate([prompt(7), prompt(8)], GREEDY, use_tqdm=False)  # used to spin forever
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12] and "0" not in [o.request_id for o in outputs]
    assert run(llm.llm_engine)[-1].request_id == "0"


def test_counters_count_requests_not_sequences(engine):
    before = engine.stats()
    prompt_ids = prompt(9, length=17)
    engine.add_request("n3", prompt_ids, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))
    run(engine)
    after = engine.stats()
    assert after.prompt_tokens - before.prompt_tokens == 17
    assert after.finished("length") - before.finished("length") == 1
    assert after.generation_tokens - before.generation_tokens == 15


def test_abort_waiting_request(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, max_num_seqs=1, max_model_len=64, page_size=8, max_num_batched_tokens=16,
                 warmup=False).llm_engine
    engine.add_request("running", prompt(10), GREEDY)
    engine.add_request("waiting", prompt(11), GREEDY)
    engine.step()
    assert engine.stats().num_waiting_seqs == 1
    engine.abort_request("waiting")
    outputs = run(engine)
    aborted = [o for o in outputs if o.request_id == "waiting"]
    assert len(aborted) == 1 and aborted[0].outputs[0].finish_reason == "abort" and aborted[0].outputs[0].token_ids == []
    assert [o for o in outputs if o.request_id == "running"][-1].outputs[0].finish_reason == "length"
    assert engine.stats().num_waiting_seqs == 0 and engine.page_manager.usage == 0


def test_abort_preempted_request(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, max_num_seqs=4, max_model_len=128, page_size=8, num_kv_pages=17,
                 max_num_batched_tokens=64, warmup=False).llm_engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for index in range(4):
        engine.add_request(f"r{index}", prompt(20 + index, length=10), params)
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    victim = engine.scheduler.waiting[0].request_id
    engine.abort_request(victim)
    outputs = run(engine)
    finals = {o.request_id: o.outputs[0] for o in outputs if o.finished}
    assert finals[victim].finish_reason == "abort"
    assert all(finals[f"r{i}"].finish_reason == "length" for i in range(4) if f"r{i}" != victim)
    assert engine.page_manager.num_free_pages == 16


def test_abort_after_one_of_n_completions_finished(engine):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    engine.add_request("free", prompt(12), params)
    free = run(engine)[-1].outputs
    stop = next(t for t in free[0].token_ids[1:4] if t not in free[1].token_ids)
    engine.add_request("one-done", prompt(12), SamplingParams(**vars(params) | {"stop_token_ids": [stop]}))
    output = None
    while output is None or output.outputs[0].finish_reason is None:
        output = next((o for o in engine.step() if o.request_id == "one-done"), output)
    before = engine.stats()
    engine.abort_request("one-done")
    final = run(engine)[-1]
    assert final.finished and [c.finish_reason for c in final.outputs] == ["stop", "abort"]
    assert final.outputs[0].token_ids == free[0].token_ids[:free[0].token_ids.index(stop) + 1]
    assert engine.stats().finished("abort") - before.finished("abort") == 1


@pytest.mark.parametrize("max_tokens", [None, 6])
def test_finishing_exactly_at_max_model_len(tiny_llama_dir, max_tokens):
    llm = LLM(tiny_llama_dir, max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=64, warmup=False)
    out = llm.generate([prompt(13, length=58)], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                               ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    last = llm.generate([prompt(13, length=63)], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(last[0].outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt(13, length=58)], SamplingParams(max_tokens=7))


SAMPLED = [
    SamplingParams(temperature=0.9, seed=11, max_tokens=40, logprobs=3, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=40, presence_penalty=0.8, frequency_penalty=0.5,
                   ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.5, logprobs=1, min_tokens=30),
    SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=13, max_tokens=40, logprobs=0, ignore_eos=True),
]


def completions(outputs) -> list:
    return [(c.token_ids, c.finish_reason) for o in outputs for c in o.outputs]


def logprobs(outputs) -> list:
    return [lp for o in outputs for c in o.outputs for lp in (c.logprobs or [])]


def assert_same_logprobs(got, expected):
    assert len(got) == len(expected)
    for step, reference in zip(got, expected):
        assert step.keys() == reference.keys()
        assert [step[t] for t in reference] == pytest.approx([reference[t] for t in reference], abs=1e-4)


def test_preemption_and_prefix_caching_are_exact_for_sampling_penalties_and_logprobs(tiny_llama_dir):
    """Seeded sampling, penalties, min_tokens, logprobs and n > 1 through preemption (a pool too small for the
    batch) and prefix caching (prompts sharing a long prefix) give what a roomy uncached engine gives."""
    shared = random_prompts(1, 500, 64, 64, seed=30)[0]
    prompts = [{"prompt_token_ids": shared + tail} for tail in random_prompts(8, 500, 3, 30, seed=31)]
    params = [SAMPLED[i % len(SAMPLED)] for i in range(len(prompts))]
    roomy = LLM(tiny_llama_dir, enable_prefix_caching=False, **ENGINE_OPTIONS)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    tight = LLM(tiny_llama_dir, num_kv_pages=40, **ENGINE_OPTIONS)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 64
    assert completions(got) == completions(expected)
    assert_same_logprobs(logprobs(got), logprobs(expected))


def test_prefix_cache_reuse_after_eviction_under_pool_pressure(tiny_llama_dir):
    """Cached pages evicted by other traffic are recomputed, those left are reused; outputs never change."""
    cached = LLM(tiny_llama_dir, num_kv_pages=33, **ENGINE_OPTIONS)
    uncached = LLM(tiny_llama_dir, enable_prefix_caching=False, **ENGINE_OPTIONS)
    target = prompt(40, length=120)
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=8, ignore_eos=True)
    expected = completions(uncached.generate([target], params))
    assert completions(cached.generate([target], params)) == expected
    hits = cached.llm_engine.stats().prefix_cache_hits
    assert completions(cached.generate([target], params)) == expected
    assert cached.llm_engine.stats().prefix_cache_hits - hits == 112  # 14 full pages (the last token is computed)
    # 20 pages for another request: the target's unhashed tail page, the 16 never used, then its last 3 full pages
    cached.generate([prompt(41, length=150)], params)
    hits = cached.llm_engine.stats().prefix_cache_hits
    assert completions(cached.generate([target], params)) == expected
    reused = cached.llm_engine.stats().prefix_cache_hits - hits
    assert reused == 96  # the 12 pages left of the 14


def test_generation_config_eos_ids_and_defaults_reach_generation(tiny_llama_dir, tmp_path):
    """generation_config.json's extra EOS ids end generation, and its sampling defaults are what `generate` uses
    when given no SamplingParams (vLLM's `get_default_sampling_params`)."""
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    plain = LLM(str(model_dir), **ENGINE_OPTIONS)
    free = plain.generate([prompt(50)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    eos = free.token_ids[3]
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "temperature": 0.0, "max_new_tokens": 10}))
    llm = LLM(str(model_dir), **ENGINE_OPTIONS)
    assert llm.get_default_sampling_params().temperature == 0 and llm.get_default_sampling_params().max_tokens == 10
    out = llm.generate([prompt(50)])[0].outputs[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(eos) + 1] and out.finish_reason == "stop"


def test_priority_needs_the_priority_policy(engine):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        engine.add_request("prio", prompt(60), GREEDY, priority=1)
    assert not engine.has_unfinished_requests()


def test_token_latencies_are_measured_for_every_output_kind(engine):
    """One first-token sample per request and one inter-token sample per later step, whatever the output kind
    (a whole answer used to record none) and however many completions share the step."""
    kinds = (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE)
    for index, kind in enumerate(kinds):
        engine.add_request(f"lat{index}", prompt(70 + index), SamplingParams(
            n=2, temperature=1.0, seed=index, max_tokens=5, ignore_eos=True, output_kind=kind))
    first, gaps = [], []
    while engine.has_unfinished_requests():
        engine.step()
        first += engine.iteration_stats().time_to_first_tokens
        gaps += engine.iteration_stats().inter_token_latencies
    assert len(first) == 3 and len(gaps) == 3 * 4
    assert all(latency > 0 for latency in first + gaps)

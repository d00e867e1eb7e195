"""Async scheduling and the device-resident slot state: the same outputs as the synchronous loop, whatever ends a
sequence, and the device's per-slot tokens and page tables always what the host's sequences say."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.scheduler_output import ScheduledDecode
from jaxserve.engine.step_inputs import decode_inputs
from tests.conftest import random_prompts

ENGINE_OPTIONS = dict(max_num_seqs=6, max_model_len=192, page_size=8, max_num_batched_tokens=48, warmup=False)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(7, 500, 3, 70, seed=40)]
SHARED = random_prompts(1, 500, 40, 40, seed=41)[0]
PREFIXED = [{"prompt_token_ids": SHARED + p} for p in random_prompts(6, 500, 2, 20, seed=42)]

WORKLOADS = {
    # every way a sequence ends: length, EOS (not ignored), stop ids held back by min_tokens, stop strings
    "greedy-stops": [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=list(range(100, 300))),
        SamplingParams(temperature=0, max_tokens=40, stop=["a", "e"], ignore_eos=True),
        SamplingParams(n=3, temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=[7, 77, 177]),
    ],
    # seeded sampling, penalties and logprobs
    "sampled": [
        SamplingParams(temperature=0.8, seed=1, max_tokens=30, logprobs=2, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=2, max_tokens=30, presence_penalty=0.5),
        SamplingParams(temperature=0.6, top_k=10, seed=3, max_tokens=30, min_tokens=20, stop=["x"],
                       frequency_penalty=0.4),
    ],
}


def completions(outputs) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for o in outputs for c in o.outputs]


def generate(model: str, prompts, params, **options):
    llm = LLM(model, **{**ENGINE_OPTIONS, **options})
    outputs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
    return llm.llm_engine, outputs


def assert_same(got, expected):
    assert len(got) == len(expected)
    for (tokens, text, reason, stop, logprobs), (e_tokens, e_text, e_reason, e_stop, e_logprobs) in zip(got, expected):
        assert (tokens, text, reason, stop) == (e_tokens, e_text, e_reason, e_stop)
        assert (logprobs is None) == (e_logprobs is None)
        for step, reference in zip(logprobs or [], e_logprobs or []):
            assert step.keys() == reference.keys()
            assert [step[t] for t in reference] == pytest.approx([reference[t] for t in reference], abs=1e-5)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_async_outputs_equal_the_synchronous_loop(tiny_llama_dir, workload, pool):
    """Tight: a pool too small for the batch (preemption) and prompts sharing a prefix (prefix caching)."""
    params = WORKLOADS[workload]
    prompts, options = (PROMPTS, {}) if pool == "roomy" else (PREFIXED, dict(num_kv_pages=20, max_model_len=128))
    sync_engine, expected = generate(tiny_llama_dir, prompts, params, async_scheduling=False, **options)
    engine, got = generate(tiny_llama_dir, prompts, params, **options)
    assert_same(completions(got), completions(expected))
    if pool == "tight":
        assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits > 0
    for e in (engine, sync_engine):
        assert e.page_manager.num_free_pages == e.page_manager.num_usable_pages and not e.scheduler.running


def test_the_next_step_is_dispatched_before_the_previous_one_is_read(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    calls = []
    dispatch, collect = runner.dispatch, runner.collect
    runner.dispatch = lambda plan: calls.append("dispatch") or dispatch(plan)
    runner.collect = lambda step: calls.append("collect") or collect(step)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    # one prefill step and four decodes (the fifth token comes from the fourth decode): each read follows the
    # next dispatch, and the last read comes from an empty step
    assert calls == ["dispatch", "dispatch", "collect", "dispatch", "collect", "dispatch", "collect",
                     "dispatch", "collect", "collect"]
    assert engine.stats().generation_tokens == 5


@pytest.mark.parametrize("speculative_config",
                         [None, {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}])
def test_slot_state_and_runner_rows_are_what_the_host_sequences_say(tiny_llama_dir, speculative_config):
    """After every step, each decoding sequence's slot holds its latest token and its page table, on the device:
    through chunked prefill, preemption and recompute (which may leave its last known token to a decode). And the
    runner is fed plain diffs: at every dispatch, each scheduled sequence's row in the runner's persistent batch
    holds exactly the scheduler's page table and (where the step reads them) its tokens, through admission, chunked
    prefill, preemption and re-admission, and (speculating) the pages trimmed after rejected drafts."""
    llm = LLM(tiny_llama_dir, **{**ENGINE_OPTIONS, "num_kv_pages": 20, "max_model_len": 128}, async_scheduling=False,
              speculative_config=speculative_config)
    engine, rows_checked = llm.llm_engine, []
    dispatch, page_table = engine.runner.dispatch, engine.scheduler.page_manager.page_table

    def checked_dispatch(plan):
        step = dispatch(plan)
        rows = engine.runner.batch
        verifies = any(decode.num_draft for decode in plan.decodes)
        for seq_id, reads_tokens in ([(chunk.seq_id, True) for chunk in plan.prefills]
                                     + [(decode.seq_id, verifies) for decode in plan.decodes]):
            seq, slot = engine.scheduler.seqs[seq_id], rows.slot_of[seq_id]
            known = rows.token_ids[slot]  # a plain decode reads its token on the device: its row may lag
            assert slot == seq.slot and known == seq.token_ids[:len(known) if not reads_tokens else None]
            assert list(rows.page_tables[0, slot, :rows.num_pages[slot]]) == page_table(seq.seq_id)
            assert not rows.page_tables[0, slot, rows.num_pages[slot]:].any()
            rows_checked.append(seq_id)
        assert all(plain_data(record) for record in (plan.left_seq_ids, plan.new_seqs, plan.cached_seqs,
                                                      plan.prefills, plan.decodes))
        return step

    engine.runner.dispatch = checked_dispatch
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PREFIXED):
        engine.add_request(str(i), prompt, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        state = jax.device_get(engine.runner.batch.slot_state)
        for seq in engine.scheduler.running:
            pages = -(-seq.num_computed_tokens // engine.engine_config.page_size)
            assert list(state.page_tables[0, seq.slot][:pages]) == page_table(seq.seq_id)[:pages]
            if not seq.is_prefilling:
                assert state.tokens[seq.slot] == seq.token_ids[-1], seq
                checked += 1
    assert engine.stats().num_preemptions > 0 and checked > 100 and len(rows_checked) > 100
    if speculative_config:
        assert engine.stats().spec_decode_num_drafts > 0


def plain_data(value) -> bool:
    """True for ints, strings, ranges, sampling parameters, a prompt's images (frozen records of numbers and arrays),
    None and tuples of them: nothing of the engine's own."""
    from jaxserve.multimodal.inputs import MultiModalPrompt

    if isinstance(value, tuple):
        return all(plain_data(item) for item in value)
    return value is None or isinstance(value, (int, str, range, SamplingParams, MultiModalPrompt))


def test_abort_while_a_step_is_in_flight(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("kept", PROMPTS[0], params)
    engine.add_request("aborted", PROMPTS[1], params)
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("aborted")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    _, expected = generate(tiny_llama_dir, PROMPTS[:2], [params], async_scheduling=False)
    aborted = outputs["aborted"].outputs[0]
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == expected[1].outputs[0].token_ids[:len(aborted.token_ids)]
    assert outputs["kept"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages


def test_decode_inputs_are_one_value_per_row(tiny_llama_dir):
    """The host sends each decode row's slot, position, current page and output index: O(rows) bytes, not the
    page tables (the device keeps them)."""
    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS)
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    seq = engine.outputs.requests["r"].seqs[0]
    position = seq.num_tokens - 1
    inputs = decode_inputs(engine.runner.batch, (ScheduledDecode(seq.seq_id, position),), engine.engine_config)
    batch = inputs.batch
    arrays = [batch.slots, batch.positions, inputs.output_index, batch.active]
    assert all(a.shape == (1,) for a in arrays) and batch.pages.shape == (1, 1)  # one KV cache group
    page = engine.scheduler.page_manager.page_table(seq.seq_id)[position // engine.engine_config.page_size]
    assert (batch.positions[0], batch.pages[0, 0]) == (position, page)
    assert np.array_equal(batch.active, [True])
    while engine.has_unfinished_requests():
        engine.step()

"""Detokenization in a second process (`detokenizer_process=True`): the same outputs as inline detokenization, whatever
ends a sequence (stop strings arrive a step or two late and their extra tokens are dropped), streamed deltas that
add up to the final output, aborts, and a dead worker reported as an error."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.sampling_params import RequestOutputKind
from tests.conftest import random_prompts
from tests.test_async_scheduling import ENGINE_OPTIONS, PREFIXED, PROMPTS, WORKLOADS, assert_same, completions

STOPS = [  # stop strings the tiny tokenizer's texts complete early, late, across tokens, with min_tokens and n > 1
    SamplingParams(temperature=0, max_tokens=40, stop=["a", "e"], ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30, stop=["used3", "<unused4"], include_stop_str_in_output=True,
                   ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=30, logprobs=2, stop=["x", "u"], min_tokens=5),
    SamplingParams(temperature=0, max_tokens=6, stop=["d"], ignore_eos=True),
]


def run(model: str, prompts, params, **options):
    llm = LLM(model, **{**ENGINE_OPTIONS, **options})
    outputs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
    return llm.llm_engine, outputs


@pytest.mark.parametrize("workload", ["stops", *sorted(WORKLOADS)])
@pytest.mark.parametrize("loop", ["async", "sync"])
def test_outputs_equal_inline_detokenization(tiny_llama_dir, workload, loop):
    params = STOPS if workload == "stops" else WORKLOADS[workload]
    options = dict(async_scheduling=loop == "async")
    inline, expected = run(tiny_llama_dir, PROMPTS, params, detokenizer_process=False, **options)
    engine, got = run(tiny_llama_dir, PROMPTS, params, detokenizer_process=True, **options)
    assert engine.outputs.detokenizer_process is not None and inline.outputs.detokenizer_process is None
    assert_same(completions(got), completions(expected))
    for a, b in zip(got, expected):
        assert [c.cumulative_logprob for c in a.outputs] == pytest.approx([c.cumulative_logprob for c in b.outputs])
    assert engine.stats().generation_tokens == inline.stats().generation_tokens
    assert engine.stats().request_success == inline.stats().request_success
    assert not engine.outputs.requests and not engine.outputs._texts and not engine.scheduler.running
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages


def test_preemption_and_prefix_caching(tiny_llama_dir):
    options = dict(num_kv_pages=20, max_model_len=128)
    params = WORKLOADS["greedy-stops"] + STOPS
    _, expected = run(tiny_llama_dir, PREFIXED, params, detokenizer_process=False, **options)
    engine, got = run(tiny_llama_dir, PREFIXED, params, detokenizer_process=True, **options)
    assert_same(completions(got), completions(expected))
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits > 0


def stream(engine, prompt, params) -> tuple[list, list]:
    """Steps a DELTA request to its end: its outputs and the concatenation of each completion's deltas."""
    request_id = engine.add_request(None, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    merged = {}
    for output in outputs:
        for c in output.outputs:
            text, tokens, reason = merged.get(c.index, ("", [], None))
            merged[c.index] = (text + c.text, tokens + c.token_ids, c.finish_reason or reason)
    return outputs, [merged[i] for i in sorted(merged)]


def test_streamed_deltas_add_up_and_never_show_a_stop_string(tiny_llama_dir):
    prompt = {"prompt_token_ids": random_prompts(1, 500, 20, 20, seed=5)[0]}
    params = SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=40, stop=["used4"], ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS, detokenizer_process=True)
    (expected,) = LLM(tiny_llama_dir, **ENGINE_OPTIONS, detokenizer_process=False).generate(
        [prompt], dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    outputs, merged = stream(llm.llm_engine, prompt, params)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert merged == [(c.text, c.token_ids, c.finish_reason) for c in expected.outputs]
    assert any(c.finish_reason == "stop" for c in expected.outputs)  # the workload has a stop string to hide
    for output in outputs:
        for c in output.outputs:
            assert "used4" not in c.text


def test_a_stop_string_read_after_the_length_limit_still_ends_the_completion(tiny_llama_dir, monkeypatch):
    """The worker's answers are held back until the sequence has ended by length; the stop string, completed by an
    earlier token, wins and the tokens after it are dropped (what inline detokenization gives)."""
    prompt = PROMPTS[0]
    inline = LLM(tiny_llama_dir, **ENGINE_OPTIONS, detokenizer_process=False)
    (free,) = inline.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    detok = IncrementalDetokenizer(inline.llm_engine.tokenizer, prompt["prompt_token_ids"], [], True)
    ends = [0]
    for token in free.outputs[0].token_ids:
        detok.add_token(token)
        ends.append(len(detok))
    text = detok.text  # the stop string: the first piece from the 8th token on that the text has not had before
    stop = next(text[ends[k]:ends[k + 1]] for k in range(8, 38)
                if ends[k + 1] > ends[k] and text.find(text[ends[k]:ends[k + 1]]) == ends[k])
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    (expected,) = inline.generate([prompt], params, use_tqdm=False)
    assert expected.outputs[0].finish_reason == "stop" and 8 < len(expected.outputs[0].token_ids) < 40
    engine = LLM(tiny_llama_dir, **ENGINE_OPTIONS, detokenizer_process=True).llm_engine
    worker = engine.outputs.detokenizer_process
    read = worker.answers
    monkeypatch.setattr(worker, "answers", lambda timeout=0.0: [])
    request_id = engine.add_request(None, prompt, params)
    seq = None
    while seq is None or not seq.is_finished:
        engine.step()
        seq = engine.outputs.requests[request_id].seqs[0]
    assert seq.finish_reason == "length" and seq.num_output_tokens == 40
    monkeypatch.setattr(worker, "answers", read)
    outputs = []  # cumulative outputs: one per step in which answers arrived (how many is up to the worker)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    got = outputs[-1]
    assert got.finished and not any(o.finished for o in outputs[:-1])
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in got.outputs] == [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in expected.outputs]
    assert engine.stats().generation_tokens == len(expected.outputs[0].token_ids)


def test_abort_while_texts_are_pending(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, **ENGINE_OPTIONS, detokenizer_process=True).llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    aborted = engine.add_request(None, PROMPTS[1], params)
    for _ in range(3):
        engine.step()
    engine.abort_request(aborted)
    kept = engine.add_request(None, PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[aborted].outputs[0].finish_reason == "abort"
    assert finals[kept].outputs[0].finish_reason == "length" and len(finals[kept].outputs[0].token_ids) == 5
    assert not engine.outputs._texts


def test_a_dead_worker_is_an_error_that_names_it(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, **ENGINE_OPTIONS, detokenizer_process=True).llm_engine
    engine.outputs.detokenizer_process._process.kill()
    engine.outputs.detokenizer_process._process.wait()
    engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    with pytest.raises(RuntimeError, match="detokenizer process died"):
        while engine.has_unfinished_requests():
            engine.step()


def test_off_by_default_and_a_server_flag(tiny_llama_dir):
    from jaxserve.server.cli_args import build_parser, engine_config

    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS)
    assert llm.llm_engine.engine_config.detokenizer_process is False and llm.llm_engine.outputs.detokenizer_process is None
    args = build_parser().parse_args(["--model", tiny_llama_dir, "--detokenizer-process"])
    assert engine_config(args).detokenizer_process is True

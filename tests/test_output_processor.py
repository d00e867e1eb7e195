"""The output processor: detokenization, stop strings and outputs on their own thread, fed by the stepping thread."""

from __future__ import annotations

import threading

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import output_processor
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.output_processor import TokenUpdate
from jaxserve.engine.request import Request
from jaxserve.engine.sequence import Sequence
from jaxserve.loading import load_tokenizer
from jaxserve.sampling_params import RequestOutputKind
from tests.conftest import random_prompts

ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=128, page_size=8, max_num_batched_tokens=32)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 4, 30, seed=60)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **ENGINE_OPTIONS)


def test_detokenization_runs_off_the_stepping_thread(llm, monkeypatch):
    threads = []
    add_token = IncrementalDetokenizer.add_token

    def recording(self, token_id, check_stop=True):
        threads.append(threading.current_thread().name)
        return add_token(self, token_id, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", recording)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zq"]),
                           use_tqdm=False)
    assert all(output.outputs[0].text for output in outputs)
    assert len(threads) == 36 and set(threads) == {"jaxserve-outputs"}


def test_a_stop_string_cuts_the_output_and_ends_the_sequence_in_the_engine(llm):
    engine = llm.llm_engine
    free = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[6:8]
    first = free.text.index(stop)
    stopped = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason, stopped.text) == ("stop", stop, free.text[:first])
    # the output ends with the token that completed the stop string; tokens computed after it never show
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 24
    assert not engine.has_unfinished_requests() and not engine.scheduler.running
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages
    assert engine.stats().finished("stop") >= 1


def test_outputs_built_meanwhile_come_as_one_per_request(tiny_llama_dir, monkeypatch):
    """While nobody takes outputs, a request's newer outputs fold into the waiting one: the newest cumulative
    snapshot, or the deltas merged; nothing is lost."""
    gate = threading.Event()
    advance = output_processor.RequestState.advance
    monkeypatch.setattr(output_processor.RequestState, "advance", lambda self, update: gate.wait() and advance(
        self, update))
    processor = output_processor.OutputProcessor(load_tokenizer(tiny_llama_dir), lambda *stop: None,
                                                 lambda request: None)
    prompt = PROMPTS[1]["prompt_token_ids"]
    requests = []
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        params = SamplingParams(max_tokens=5, output_kind=kind)
        requests.append(Request(kind.name, None, prompt, params, [Sequence(kind.name, 0, prompt, params, 0, 0.0)],
                                0.0))
    tokens = [300 + i for i in range(5)]
    for token in tokens:  # five steps' updates queue up behind the gate
        for request in requests:
            request.seqs[0].token_ids.append(token)
            if token == tokens[-1]:
                request.seqs[0].finish_reason = "length"
        processor.put([TokenUpdate.of(request) for request in requests])
    gate.set()
    outputs = processor.take(wait=True)
    processor.close()
    detokenizer = IncrementalDetokenizer(load_tokenizer(tiny_llama_dir), prompt, [], True)
    for token in tokens:
        detokenizer.add_token(token)
    assert [o.request_id for o in outputs] == ["CUMULATIVE", "DELTA", "FINAL_ONLY"]
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and (completion.token_ids, completion.text, completion.finish_reason) == (
            tokens, detokenizer.text, "length")


def test_a_failing_output_processor_fails_the_engine_loop(tiny_llama_dir, monkeypatch):
    llm = LLM(tiny_llama_dir, **ENGINE_OPTIONS)
    engine = llm.llm_engine

    def broken(self, update):
        raise KeyError("detokenizer state lost")

    monkeypatch.setattr(output_processor.RequestState, "advance", broken)
    engine.add_request("r", PROMPTS[2], GREEDY)
    with pytest.raises(RuntimeError, match="output processor failed"):
        while engine.has_unfinished_requests():
            engine.step()

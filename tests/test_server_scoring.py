"""Prompt scoring over HTTP: `/v1/completions` with `echo` (and `logprobs`, `max_tokens: 0`, streaming, vLLM's
`prompt_logprobs` extra) on the real engine over a tiny random model, in process (ASGI, no sockets), checked against
HF transformers' log-softmax over the whole prompt and against lm-eval-harness's way of reading the answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from tests.test_server_app import MODEL, run_in_process, sse_events

TOLERANCE = 1e-4
TEXT = "the theory of the thing is that the other one is in there"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    """One engine for the module (each test's app builds its AsyncEngine around it); 8-token pages, 32-token chunks."""
    return LLMEngine(EngineConfig(model=tiny_llama_dir, max_num_seqs=4, max_model_len=128, page_size=8,
                                  max_num_batched_tokens=32))


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        """[len(ids) - 1]: each prompt token's log-probability given the tokens before it."""
        with torch.no_grad():
            rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
        return rows[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()

    return logprobs


def post(engine: LLMEngine, body: dict) -> tuple[int, dict | str]:
    """One /v1/completions request; (status, JSON body, or the event stream's text)."""
    result = {}

    async def check(http, _):
        response = await http.post("/v1/completions", json={"model": MODEL, **body})
        result["answer"] = (response.status_code,
                            response.text if body.get("stream") and response.status_code == 200 else response.json())

    run_in_process(lambda: engine, check)
    return result["answer"]


def test_echo_with_max_tokens_zero_scores_the_prompt(engine, hf_logprobs):
    ids = engine.tokenizer.encode(TEXT)
    status, body = post(engine, {"prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 2, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    logprobs = choice["logprobs"]
    tokens = [engine.tokenizer.decode([t]) for t in ids]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], hf_logprobs(ids), atol=TOLERANCE)
    assert logprobs["text_offset"] == list(np.cumsum([0] + [len(t) for t in tokens[:-1]]))
    for token, value, top in zip(tokens[1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert top[token] == value and 2 <= len(top) <= 3
        assert max(top.values()) >= value


def test_echo_with_generated_tokens_puts_the_prompt_first(engine):
    ids = engine.tokenizer.encode(TEXT)
    request = {"prompt": TEXT, "max_tokens": 4, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    status, plain = post(engine, request)
    assert status == 200, plain
    status, echoed = post(engine, {**request, "echo": True})
    assert status == 200, echoed
    plain, echoed = plain["choices"][0], echoed["choices"][0]
    assert echoed["text"] == TEXT + plain["text"]
    assert echoed["logprobs"]["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    assert echoed["logprobs"]["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"])
    assert echoed["logprobs"]["token_logprobs"][0] is None and len(echoed["logprobs"]["tokens"]) == len(ids) + 4
    offsets = echoed["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[len(ids)] == sum(len(t) for t in echoed["logprobs"]["tokens"][:len(ids)])
    status, text_only = post(engine, {**request, "echo": True, "logprobs": None})
    assert text_only["choices"][0]["text"] == TEXT + plain["text"] and text_only["choices"][0]["logprobs"] is None


def test_max_tokens_zero_needs_echo(engine):
    for body in ({"prompt": TEXT, "max_tokens": 0}, {"prompt": TEXT, "max_tokens": -1, "echo": True}):
        status, answer = post(engine, body)
        assert status == 400 and answer["error"]["param"] == "max_tokens", answer


def test_streamed_echo_sends_the_prompt_in_the_first_chunk(engine):
    ids = engine.tokenizer.encode(TEXT)
    request = {"prompt": TEXT, "echo": True, "max_tokens": 3, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    status, whole = post(engine, request)
    status, stream = post(engine, {**request, "stream": True})
    assert status == 200, stream
    events = sse_events(stream)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert chunks[0]["text"].startswith(TEXT)
    assert chunks[0]["logprobs"]["tokens"][:len(ids)] == [engine.tokenizer.decode([t]) for t in ids]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    joined = {key: sum((chunk["logprobs"][key] for chunk in chunks), []) for key in whole["choices"][0]["logprobs"]}
    assert "".join(chunk["text"] for chunk in chunks) == whole["choices"][0]["text"]
    assert joined["tokens"] == whole["choices"][0]["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["choices"][0]["logprobs"]["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"][1:])
    status, scored_only = post(engine, {**request, "max_tokens": 0, "stream": True})
    chunks = [json.loads(event)["choices"] for event in sse_events(scored_only)[:-1]]
    assert [c["text"] for c in sum(chunks, [])] == [TEXT] and chunks[-1][0]["finish_reason"] == "length"


def test_lm_eval_loglikelihood_request(engine, hf_logprobs):
    """lm-eval's local-completions loglikelihood: token-id prompts (context + continuation), echo, max_tokens 1,
    logprobs 1; it sums token_logprobs[ctxlen:-1] and calls the continuation greedy if each is its top's max."""
    context = engine.tokenizer.encode("the other one is")
    continuations = [engine.tokenizer.encode(" in there"), engine.tokenizer.encode(" the theory")]
    prompts = [context + continuation for continuation in continuations]
    status, body = post(engine, {"prompt": prompts, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0})
    assert status == 200, body
    for prompt, choice in zip(prompts, sorted(body["choices"], key=lambda c: c["index"])):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1
        ours = sum(logprobs["token_logprobs"][len(context):-1])
        assert ours == pytest.approx(hf_logprobs(prompt)[len(context) - 1:].sum(), abs=1e-3)
        for value, top in zip(logprobs["token_logprobs"][len(context):-1], logprobs["top_logprobs"][len(context):-1]):
            assert (value == max(top.values())) == (len(top) == 1)  # the prompt token is the top one, or it is not


def test_vllm_prompt_logprobs_extra(engine, hf_logprobs):
    ids = engine.tokenizer.encode(TEXT)
    status, body = post(engine, {"prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    assert status == 200, body
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    values = [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], entries[1:])]
    np.testing.assert_allclose(values, hf_logprobs(ids), atol=TOLERANCE)
    assert all(sorted(v["rank"] for v in entry.values())[:2] == [1, 2] for entry in entries[1:])
    assert body["choices"][0]["logprobs"] is None
    status, answer = post(engine, {"prompt": TEXT, "prompt_logprobs": 2, "stream": True})
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer
    status, answer = post(engine, {"prompt": TEXT, "prompt_logprobs": 99})
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer

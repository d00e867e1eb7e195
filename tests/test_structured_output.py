"""Constrained decoding with llguidance: outputs that match their JSON schema, regex, choice or grammar (greedy and
sampled, n > 1, preemption, prefix caching, async and synchronous loops alike), the device-side bitmask against
llguidance's numpy reference, bad grammars as ValueErrors, and no cost for unconstrained batches."""

from __future__ import annotations

import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, GuidedDecodingParams, SamplingParams
from jaxserve.layers.sampler import apply_token_bitmask
from tests.test_async_scheduling import assert_same, completions

OPTIONS = dict(max_num_seqs=4, max_model_len=192, page_size=8, max_num_batched_tokens=48, decode_batch_buckets=(1, 4))
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "size"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "size": {"enum": ["small", "large"]},
                         "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                      "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-c]+"
CHOICES = ["yes", "no way", "maybe"]
LARK = 'start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'
GBNF = 'root ::= "[" item ("|" item)* "]"\nitem ::= [a-e]+'


def guided(**kind) -> GuidedDecodingParams:
    return GuidedDecodingParams(**kind)


def matches(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (set(value) - {"tags"} == {"id", "ok", "size"} and isinstance(value["id"], int)
                and isinstance(value["ok"], bool) and value["size"] in ("small", "large")
                and all(isinstance(t, int) for t in value.get("tags", [])))
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "grammar":
        return re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text) is not None
    return re.fullmatch(r"\[[a-e]+(\|[a-e]+)*\]", text) is not None  # gbnf


KINDS = {"json": guided(json=SCHEMA), "json_object": guided(json_object=True), "regex": guided(regex=REGEX),
         "choice": guided(choice=CHOICES), "grammar": guided(grammar=LARK), "gbnf": guided(grammar=GBNF)}
PROMPTS = ["Give me the record:", "an answer", "x" * 30, "the the the then"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **OPTIONS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint(llm, temperature):
    """Sampling at temperature 1 from a random model explores the grammar; each finished output must match."""
    names = sorted(KINDS)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, n=2, guided_decoding=KINDS[name])
              for i, name in enumerate(names)]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))], params, use_tqdm=False)
    for name, output in zip(names, outputs):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (name, completion.text)
            assert matches(name, completion.text), (name, completion.text)


def test_json_allows_no_free_whitespace(llm):
    """Values without strings: any whitespace would be the grammar's, and only ', ' and ': ' are allowed."""
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=120, n=2,
                                                   guided_decoding=guided(json=SCHEMA)), use_tqdm=False)
    for completion in (c for o in outputs for c in o.outputs):
        text = completion.text
        assert "\n" not in text and "\t" not in text and "  " not in text, text
        assert json.dumps(json.loads(text)) == text  # exactly json.dumps' separators


def test_a_cut_output_is_length_not_stop(llm):
    output = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, guided_decoding=guided(json=SCHEMA)),
                          use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_async_and_synchronous_loops_give_the_same_outputs(tiny_llama_dir, pool):
    """Mixed constrained and free requests, greedy and seeded; tight: preemption and shared prefixes."""
    options = {**OPTIONS, **({} if pool == "roomy" else dict(num_kv_pages=16, max_model_len=96))}
    prompts = [{"prompt_token_ids": [7] * 40 + [i, i + 1]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=40, guided_decoding=KINDS["json"]),
              SamplingParams(temperature=0.9, seed=4, max_tokens=40, n=2, guided_decoding=KINDS["grammar"]),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=40, logprobs=1, guided_decoding=KINDS["regex"])]
    runs = []
    for async_scheduling in (False, True):
        engine = LLM(tiny_llama_dir, **options, async_scheduling=async_scheduling)
        runs.append(engine.generate(prompts, [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False))
        if pool == "tight":
            assert engine.llm_engine.stats().num_preemptions > 0
    assert_same(completions(runs[1]), completions(runs[0]))
    names = ["json", "grammar", None, "regex"]
    for i, output in enumerate(runs[1]):
        for completion in output.outputs:
            if names[i % 4] and completion.finish_reason == "stop":
                assert matches(names[i % 4], completion.text), completion.text


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_with_speculative_decoding(tiny_llama_dir, method, tmp_path):
    """Steps with a constrained row decode without drafts (an EAGLE-3 head keeps their hidden states); the others
    speculate."""
    import transformers

    from tests.eagle3_heads import save_eagle3_head

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": None}
    if method == "eagle3":
        head = save_eagle3_head(str(tmp_path / "head"), transformers.AutoConfig.from_pretrained(tiny_llama_dir),
                                draft_vocab_size=128, aux_layers=(0, 1, 1))
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    llm = LLM(tiny_llama_dir, **OPTIONS, speculative_config=spec)
    params = [SamplingParams(temperature=0, max_tokens=50, guided_decoding=KINDS["json"]),
              SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)]
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert matches("json", outputs[0].outputs[0].text)
    assert llm.llm_engine.stats().spec_decode_num_drafts > 0


def test_bitmask_matches_llguidance_reference():
    import llguidance.numpy

    rng = np.random.default_rng(0)
    for vocab in (40, 64, 513):
        logits = rng.normal(size=(3, vocab)).astype(np.float32)
        bitmask = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        expected = logits.copy()
        llguidance.numpy.apply_token_bitmask_inplace(expected, bitmask)
        got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
        np.testing.assert_array_equal(got, expected)
        ones = np.full_like(bitmask, -1)
        np.testing.assert_array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(ones))), logits)


@pytest.mark.parametrize("kind, message", [
    (guided(regex="(unclosed"), "grammar does not compile"),
    (guided(grammar="start: undefined_rule"), "grammar does not compile"),
    (guided(json={"type": "no-such-type"}), "grammar does not compile"),
    (guided(json="{not json"), "not a valid JSON schema"),
])
def test_bad_grammars_are_value_errors_and_the_engine_keeps_serving(llm, kind, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", SamplingParams(max_tokens=4, guided_decoding=kind), use_tqdm=False)
    assert not llm.llm_engine.outputs.requests and not llm.llm_engine.scheduler.waiting  # nothing was queued
    assert llm.generate("hi", SamplingParams(temperature=0, max_tokens=4, guided_decoding=guided(choice=["ok"])),
                        use_tqdm=False)[0].outputs[0].text == "ok"


def test_guided_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        GuidedDecodingParams(choice=[""])


def test_unconstrained_batches_build_no_mask_and_compile_nothing(llm, monkeypatch, caplog):
    from jaxserve.structured_output import grammar

    calls = []
    fill = grammar.fill_bitmask
    monkeypatch.setattr(grammar, "fill_bitmask", lambda *args: calls.append(1) or fill(*args))
    llm.generate(PROMPTS, SamplingParams(temperature=0.7, seed=1, max_tokens=10), use_tqdm=False)
    assert calls == []
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        llm.generate(PROMPTS, [SamplingParams(temperature=0.7, seed=1, max_tokens=30, guided_decoding=KINDS["json"]),
                               SamplingParams(temperature=0, max_tokens=30)] * 2, use_tqdm=False)
        compiles = [r.getMessage() for r in caplog.records
                    if "Compiling" in r.getMessage() or "warm-up missed it" in r.getMessage()]
    assert compiles == [] and calls

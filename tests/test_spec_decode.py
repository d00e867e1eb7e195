"""Speculative decoding: greedy outputs token-identical to plain decoding (n-gram and draft-model proposals, with
prefix caching, preemption, n > 1, stops, min_tokens, penalties and logprobs), the rejection sampler's output
distribution equal to the target's (chi-square), the proposer, rollback of rejected pages, metrics, bad configs."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.layers.sampler import SamplingBatch
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramIndex
from jaxserve.spec_decode.verify import verify_sample
from tests.conftest import random_prompts, save_tiny_model
from tests.test_async_scheduling import assert_same, completions

OPTIONS = dict(max_num_seqs=4, max_model_len=160, page_size=8, max_num_batched_tokens=48, decode_batch_buckets=(1, 4))
# speculation in batches too (on a CPU it is off by default while two or more sequences run)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None}


def repetitive_prompts(count: int, seed: int) -> list[dict]:
    """Prompts that repeat a random phrase, so that prompt lookup finds n-grams to propose."""
    phrases = random_prompts(count, 500, 4, 9, seed=seed)
    return [{"prompt_token_ids": (phrase * 4)[:30]} for phrase in phrases]


PROMPTS = repetitive_prompts(5, seed=60) + [{"prompt_token_ids": p} for p in random_prompts(2, 500, 3, 40, seed=61)]
GREEDY = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=33, min_tokens=20, stop_token_ids=list(range(100, 300))),
    SamplingParams(n=2, temperature=0, max_tokens=25, ignore_eos=True, stop=["a"]),
    SamplingParams(temperature=0, max_tokens=37, repetition_penalty=1.3, frequency_penalty=0.2, logprobs=2,
                   ignore_eos=True),
]


def generate(model, prompts, params, **options):
    llm = LLM(model, **{"warmup": False, **OPTIONS, **options})
    outputs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
    return llm.llm_engine, outputs


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    return {pool: completions(generate(tiny_llama_dir, PROMPTS, GREEDY, **options)[1])
            for pool, options in (("roomy", {}), ("tight", dict(num_kv_pages=24)))}


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_ngram_greedy_outputs_equal_plain_decoding(tiny_llama_dir, plain_outputs, pool):
    """Tight: a pool too small for the batch, so sequences are preempted and recomputed; prompts repeat phrases,
    so prefix pages are shared too."""
    options = {} if pool == "roomy" else dict(num_kv_pages=24)
    engine, got = generate(tiny_llama_dir, PROMPTS, GREEDY, speculative_config=NGRAM, **options)
    assert_same(completions(got), plain_outputs[pool])
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_accepted_per_pos[0] >= stats.spec_decode_accepted_per_pos[-1]
    if pool == "tight":
        assert stats.num_preemptions > 0
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages and not engine.scheduler.running
    assert not engine.scheduler.drafter.indexes  # finished sequences' n-gram indexes are dropped


def test_draft_model_greedy_outputs_equal_plain_decoding(tiny_llama_dir, tmp_path, plain_outputs):
    """A draft with other weights (same vocabulary): outputs as without speculation, some drafts rejected."""
    draft = save_tiny_model("llama", str(tmp_path / "draft"), seed=1, num_hidden_layers=1)
    engine, got = generate(tiny_llama_dir, PROMPTS, GREEDY, num_kv_pages=24,
                           speculative_config={"model": draft, "num_speculative_tokens": 2,
                                               "disable_by_batch_size": None})
    assert_same(completions(got), plain_outputs["tight"])
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages


def test_the_target_as_its_own_draft_accepts_nearly_everything(tiny_llama_dir, plain_outputs):
    """A check of the verify step itself: the draft computes what the target computes."""
    engine, got = generate(tiny_llama_dir, PROMPTS[:4], GREEDY[:1],
                           speculative_config={"model": tiny_llama_dir, "num_speculative_tokens": 3,
                                               "disable_by_batch_size": None})
    _, expected = generate(tiny_llama_dir, PROMPTS[:4], GREEDY[:1])
    assert_same(completions(got), completions(expected))
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens >= 0.97 * stats.spec_decode_num_draft_tokens > 0
    # 4 requests x 40 tokens: a verify step yields up to K+1 = 4 tokens per sequence
    assert stats.num_steps < 0.5 * 4 * 40


def test_sampled_requests_are_seeded_and_finish(tiny_llama_dir):
    """Sampling with speculation: every request ends, a seed repeats its output, and the sampler path runs."""
    params = [SamplingParams(temperature=0.8, seed=5, max_tokens=30, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=6, max_tokens=30, presence_penalty=0.3,
                             min_tokens=25, stop_token_ids=[9])]
    first = completions(generate(tiny_llama_dir, PROMPTS[:4], params, speculative_config=NGRAM)[1])
    engine, second = generate(tiny_llama_dir, PROMPTS[:4], params, speculative_config=NGRAM)
    assert_same(completions(second), first)
    assert all(len(tokens) >= 25 for tokens, *_ in first)
    assert engine.stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_compiles_after_warmup(tiny_llama_dir, caplog, method):
    spec = NGRAM if method == "ngram" else {"model": tiny_llama_dir, "num_speculative_tokens": 2,
                                            "disable_by_batch_size": None}
    llm = LLM(tiny_llama_dir, **OPTIONS, speculative_config=spec)
    params = GREEDY + [SamplingParams(temperature=0.7, seed=1, max_tokens=20, logprobs=2, ignore_eos=True)]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        llm.generate(PROMPTS, [params[i % len(params)] for i in range(len(PROMPTS))], use_tqdm=False)
        compiles = [r.getMessage() for r in caplog.records
                    if "Compiling" in r.getMessage() or "warm-up missed it" in r.getMessage()]
    assert compiles == []
    assert llm.llm_engine.stats().spec_decode_num_drafts > 0


def _chi_square(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * observed.sum()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_rejection_sampling_preserves_the_target_distribution(proposer):
    """Over 20,000 rows with their own seeds: the first output token follows p_0, and the second, wherever the
    first draft was accepted, follows p_1 (chi-square, 23 degrees of freedom: 99.9% quantile 49.7)."""
    rows, k, vocab = 20000, 2, 24  # vocab >= MAX_LOGPROBS
    rng = np.random.default_rng(0)
    target_logits = rng.normal(0, 1.5, (k + 1, vocab)).astype(np.float32)
    target_logits[0, 5] = -np.inf  # a token the target never emits, whatever the draft proposes
    draft_probs = jax.nn.softmax(rng.normal(0, 1.5, (k, vocab)).astype(np.float32), axis=-1)
    q = np.asarray(draft_probs, np.float64)
    q /= q.sum(axis=-1, keepdims=True)
    drafts = np.stack([rng.choice(vocab, rows, p=q[i]) for i in range(k)], axis=1).astype(np.int32)
    if proposer == "ngram":  # deterministic proposals (q one-hot): each position's likeliest token
        drafts = np.tile(np.argmax(target_logits[:k], axis=-1).astype(np.int32), (rows, 1))
    batch = SamplingBatch(
        temperature=jnp.ones(rows), top_p=jnp.ones(rows), top_k=jnp.zeros(rows, jnp.int32), min_p=jnp.zeros(rows),
        repetition_penalty=jnp.ones(rows), presence_penalty=jnp.zeros(rows), frequency_penalty=jnp.zeros(rows),
        seed=jnp.arange(rows, dtype=jnp.uint32), output_index=jnp.full(rows, 3, jnp.int32),
        min_tokens=jnp.zeros(rows, jnp.int32), wants_logprobs=jnp.zeros(rows, bool))
    zeros = jnp.zeros((rows, vocab))
    result = jax.jit(verify_sample)(
        jnp.broadcast_to(target_logits, (rows, k + 1, vocab)), jnp.asarray(drafts), jnp.full(rows, k, jnp.int32),
        None if proposer == "ngram" else jnp.broadcast_to(draft_probs, (rows, k, vocab)), batch, zeros.astype(bool),
        zeros.astype(jnp.int32), zeros.astype(bool))
    tokens, accepted = np.asarray(result.tokens), np.asarray(result.num_accepted)
    p = np.asarray(jax.nn.softmax(target_logits, axis=-1), np.float64)
    assert _chi_square(np.bincount(tokens[:, 0], minlength=vocab), p[0]) < 49.7
    second = tokens[accepted >= 1, 1]
    assert len(second) > 2000
    assert _chi_square(np.bincount(second, minlength=vocab), p[1]) < 49.7
    # the accepted prefix really is the drafts
    for row in range(50):
        assert list(tokens[row, :accepted[row]]) == list(drafts[row, :accepted[row]])


def test_ngram_index_proposes_the_latest_longest_match_in_o_of_new_tokens():
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert index.propose(tokens, k=2) == [7, 8]  # the latest earlier "1 2 3" was followed by 7 8
    assert index.indexed == len(tokens) - 1
    tokens += [7]
    assert index.propose(tokens, k=4) == [8, 1, 2, 3]  # "2 3 7" ends at position 7
    assert index.indexed == len(tokens) - 1  # only the new token was indexed
    assert NgramIndex(2, 3).propose([4, 5, 6, 7], k=3) == []  # nothing repeats
    assert NgramIndex(1, 1).propose([4, 5, 4], k=3) == [5, 4]  # proposals stop at the sequence's end


def test_rejected_drafts_release_their_pages(tiny_llama_dir):
    """After every speculative step a sequence holds no page past its tokens (the room made for K drafts goes
    back to the pool wherever drafts were rejected) and every page of its computed tokens."""
    llm = LLM(tiny_llama_dir, **OPTIONS, speculative_config={**NGRAM, "num_speculative_tokens": 7}, warmup=False)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if not seq.is_prefilling:
                page_size = engine.engine_config.page_size
                num_pages = len(engine.scheduler.page_manager.page_table(seq.seq_id))
                assert -(-seq.num_computed_tokens // page_size) <= num_pages <= -(-len(seq) // page_size)
                checked += 1
    assert checked > 20 and engine.stats().spec_decode_num_accepted_tokens < engine.stats().spec_decode_num_draft_tokens


def test_large_batches_decode_without_drafts(tiny_llama_dir):
    engine, _ = generate(tiny_llama_dir, PROMPTS[:4], GREEDY[:1],
                         speculative_config={**NGRAM, "disable_by_batch_size": 4})
    stats = engine.stats()
    # four sequences decode together until the first finishes, without drafts; then with them
    assert 0 < stats.spec_decode_num_drafts < stats.num_steps


@pytest.mark.parametrize("config, key", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1}, "draft_tensor_parallel"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("{not json", "JSON"),
])
def test_bad_configs_name_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(speculative_config=config).resolve(2048)


def test_a_draft_must_share_the_vocabulary_and_cover_max_model_len(tiny_llama_dir, tmp_path):
    other_vocab = save_tiny_model("llama", str(tmp_path / "vocab"), vocab_size=384)
    with pytest.raises(ValueError, match="'model'.*vocabulary of 384"):
        LLM(tiny_llama_dir, speculative_config={"model": other_vocab, "num_speculative_tokens": 2})
    short = save_tiny_model("llama", str(tmp_path / "short"), max_position_embeddings=64)
    with pytest.raises(ValueError, match="'model'.*context of 64 tokens"):
        LLM(tiny_llama_dir, max_model_len=128, speculative_config={"model": short, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'model'"):
        LLM(tiny_llama_dir, speculative_config={"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})


def test_parse_accepts_vllm_json_and_infers_the_method():
    config = SpeculativeConfig.parse('{"model": "draft-dir", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "draft-dir", 3)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).method == "ngram"
    cpu_default = EngineConfig(speculative_config={"num_speculative_tokens": 2}).resolve(2048)
    assert cpu_default.async_scheduling is False and cpu_default.speculative_config.disable_by_batch_size == 2
    explicit = EngineConfig(speculative_config={"num_speculative_tokens": 2, "disable_by_batch_size": None}).resolve(2048)
    assert explicit.speculative_config.disable_by_batch_size is None


def test_drafts_stop_at_max_model_len_and_max_tokens(tiny_llama_dir):
    """Near its limits a sequence gets fewer drafts (a step yields drafts + 1 tokens): outputs end exactly where
    plain decoding's do, and no KV is written past max_model_len."""
    prompts, options = PROMPTS[:3], dict(max_model_len=48, num_kv_pages=30)
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    _, expected = generate(tiny_llama_dir, prompts, params, **options)
    engine, got = generate(tiny_llama_dir, prompts, params, speculative_config={**NGRAM, "num_speculative_tokens": 7},
                           **options)
    assert_same(completions(got), completions(expected))
    assert [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in got[::2]] == [48, 48]
    assert engine.stats().spec_decode_num_accepted_tokens > 0

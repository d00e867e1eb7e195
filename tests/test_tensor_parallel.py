"""Tensor parallelism on host devices (the suite runs with four, see conftest): outputs equal one device's,
and every device really holds only its share of the weights and the KV pool."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import random_prompts, shard_shapes

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Once upon a time, a fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=seed, max_tokens=16, ignore_eos=True)
          for seed in range(len(PROMPTS))]
SMALL = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64, warmup=False, decode_batch_buckets=(4,))


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def one_device():
    return LLM(tensor_parallel_size=1, **SMALL)


@pytest.fixture(scope="module")
def three_devices():
    return LLM(tensor_parallel_size=3, **SMALL)


def test_default_model_on_three_devices_matches_one_greedy_and_seeded(one_device, three_devices):
    assert token_ids(three_devices.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        token_ids(one_device.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(three_devices.generate(PROMPTS, SEEDED, use_tqdm=False)) == \
        token_ids(one_device.generate(PROMPTS, SEEDED, use_tqdm=False))


def test_weights_and_kv_pool_are_split_over_the_devices(three_devices):
    runner = three_devices.llm_engine.runner
    assert len(runner.mesh.devices.flat) == 3
    layer = runner.params["layers_0"]
    cfg = runner.model_config
    qkv = layer["attn"]["qkv_proj"]["kernel"]  # 9 query heads + 3 KV heads (x2) of 64: 3 per device + 1 + 1
    assert qkv.shape == (cfg.hidden_size, 15 * 64) and shard_shapes(qkv) == {(cfg.hidden_size, 5 * 64)}
    assert shard_shapes(layer["attn"]["o_proj"]["kernel"]) == {(3 * 64, cfg.hidden_size)}
    assert shard_shapes(layer["mlp"]["gate_up_proj"]["kernel"]) == {(cfg.hidden_size, 2 * cfg.intermediate_size // 3)}
    assert shard_shapes(layer["mlp"]["down_proj"]["kernel"]) == {(cfg.intermediate_size // 3, cfg.hidden_size)}
    assert shard_shapes(runner.params["embed"]["embedding"]) == {(cfg.vocab_size // 3, cfg.hidden_size)}
    k_pool = runner.kv_cache[0].k
    assert k_pool.shape[0] == 3 and shard_shapes(k_pool) == {(1, *k_pool.shape[1:])}
    assert {shard.device for shard in k_pool.addressable_shards} == set(runner.mesh.devices.flat)


def test_preemption_and_prefix_caching_on_two_devices_match_one_device(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 500, 10, 60, seed=6)]
    shared = random_prompts(1, 500, 64, 64, seed=7)[0]
    prompts += [{"prompt_token_ids": shared + tail} for tail in random_prompts(3, 500, 3, 9, seed=8)]
    options = dict(max_num_seqs=8, max_model_len=256, page_size=16, max_num_batched_tokens=64, warmup=False,
                   smallest_prefill_bucket=64, decode_batch_buckets=(8,))
    reference = token_ids(LLM(tiny_llama_dir, **options).generate(prompts, params, use_tqdm=False))
    constrained = LLM(tiny_llama_dir, tensor_parallel_size=2, num_kv_pages=24, **options)
    assert token_ids(constrained.generate(prompts, params, use_tqdm=False)) == reference
    stats = constrained.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_replicated_kv_heads_and_pallas_kernels_under_shard_map(tiny_llama_dir):
    """4 devices for 2 KV heads (vLLM's rule: each KV head on two devices), Pallas kernels in interpret mode."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 5, 40, seed=9)]
    options = dict(attention_backend="pallas-interpret", max_num_seqs=4, max_model_len=128,
                   max_num_batched_tokens=32, smallest_prefill_bucket=32, decode_batch_buckets=(4,), warmup=False)
    reference = token_ids(LLM(tiny_llama_dir, **options).generate(prompts, GREEDY, use_tqdm=False))
    four = LLM(tiny_llama_dir, tensor_parallel_size=4, **options)
    k_pool = four.llm_engine.runner.kv_cache[0].k
    assert k_pool.shape[0] == 4 and shard_shapes(k_pool) == {(1, *k_pool.shape[1:])}  # one pool head per device
    assert token_ids(four.generate(prompts, GREEDY, use_tqdm=False)) == reference


@pytest.mark.parametrize("size, message", [
    (2, "tensor_parallel_size 2 must divide the number of attention heads (9)"),
    (9, "tensor_parallel_size 9 needs 9 devices, but only 4"),
])
def test_a_size_that_does_not_fit_is_a_value_error_naming_both_numbers(size, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(tensor_parallel_size=size, **SMALL)

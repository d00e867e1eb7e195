"""Prefill/decode disaggregation (`--kv-transfer-config`, `engine/kv_connector.py`): a prefill worker's pages pulled
over jax's transfer server into a decode worker's pool give the decode worker's greedy tokens equal to one worker's
own, with only the last prompt token computed there; a pull that fails or expires is computed locally instead; a
request whose prefill worker had another model, page size or prompt is refused naming the difference."""

from __future__ import annotations

import time

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from tests.conftest import random_prompts
from tests.test_server_process import free_port

ENGINE = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_kv_pages=64, warmup=False)


def greedy(max_tokens: int, kv_transfer_params: dict | None = None, n: int = 1) -> SamplingParams:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n, extra_args=extra)


def prefill(producer: LLM, prompts: list[list[int]]) -> list[dict]:
    """What vllm-router's first stage does: max_tokens=1 with `do_remote_decode`; the responses' params."""
    outputs = producer.generate([{"prompt_token_ids": p} for p in prompts], greedy(1, {"do_remote_decode": True}),
                                use_tqdm=False)
    return [output.kv_transfer_params for output in outputs]


def decode(consumer: LLM, prompt: list[int], params: dict, max_tokens: int = 8, n: int = 1) -> list[list[int]]:
    output = consumer.generate([{"prompt_token_ids": prompt}], greedy(max_tokens, params, n), use_tqdm=False)[0]
    return [completion.token_ids for completion in output.outputs]


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    producer = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_producer"}, **ENGINE)
    consumer = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_consumer", "kv_connector_extra_config": {
        "pull_timeout_s": 2}}, **ENGINE)
    yield producer, consumer
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


def test_pulled_pages_decode_as_one_worker(workers):
    producer, consumer = workers
    prompts = random_prompts(4, 500, 17, 70, seed=1) + [[5] * 9]  # one page and one token
    expected = [out.outputs[0].token_ids for out in producer.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)]  # one worker alone
    before = consumer.llm_engine.stats()
    params = prefill(producer, prompts)
    assert all(p["do_remote_prefill"] and p["remote_port"] > 0 and p["num_tokens"] == len(prompt) - 1
               for p, prompt in zip(params, prompts))
    assert [decode(consumer, prompt, p)[0] for prompt, p in zip(prompts, params)] == expected
    stats = consumer.llm_engine.stats()
    assert stats.prompt_tokens_computed - before.prompt_tokens_computed == len(prompts)  # each last token only
    assert stats.kv_transfer_tokens_received - before.kv_transfer_tokens_received == sum(len(p) - 1 for p in prompts)
    assert dict(stats.kv_transfer_pull_failures) == dict(before.kv_transfer_pull_failures)

    # the decode worker's own prefix cache holds the first prompt's pages now: its next pull writes only past them
    again = prefill(producer, prompts[:1])[0]
    assert decode(consumer, prompts[0], again, n=2) == [expected[0], expected[0]]
    assert consumer.llm_engine.stats().prefix_cache_hits > stats.prefix_cache_hits


def test_a_failed_or_expired_pull_is_computed_here(workers, tiny_llama_dir):
    producer, consumer = workers
    prompt = random_prompts(1, 500, 40, 40, seed=2)[0]
    expected = decode(producer, prompt, None)
    failures = sum(dict(consumer.llm_engine.stats().kv_transfer_pull_failures).values())

    # the prefill worker died: nothing listens (jax's transfer server keeps trying to connect: a timeout here)
    gone = {**prefill(producer, [prompt])[0], "remote_port": free_port()}
    assert decode(consumer, prompt, gone) == expected
    assert sum(dict(consumer.llm_engine.stats().kv_transfer_pull_failures).values()) == failures + 1

    short = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_producer", "kv_connector_extra_config": {
        "abort_timeout_s": 0.5}}, **ENGINE)
    expired = prefill(short, [prompt])[0]
    time.sleep(1.5)  # past the prefill worker's abort timeout: jax has dropped the pages
    assert decode(consumer, prompt, expired) == expected
    assert sum(dict(consumer.llm_engine.stats().kv_transfer_pull_failures).values()) == failures + 2
    short.llm_engine.shutdown()


def test_a_request_aborted_while_its_pages_are_pulled_ends_as_aborted(workers):
    producer, consumer = workers
    prompt = random_prompts(1, 500, 20, 20, seed=4)[0]
    engine = consumer.llm_engine
    engine.add_request("pulling", {"prompt_token_ids": prompt},
                       greedy(4, {**prefill(producer, [prompt])[0], "remote_port": free_port()}))  # never arrives
    engine.step()
    assert engine.connector.num_pulling == 1 and engine.wait_for_requests(0)
    _, arrays = engine.connector._pulls["pulling"].pulled.result(timeout=60)
    engine.abort_request("pulling")
    (output,) = engine.step()
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert engine.connector.num_pulling == 0 and not engine.has_unfinished_requests()
    assert all(array.is_ready() for array in arrays)  # failed: their device memory is released


def test_mismatched_workers_and_roles_are_refused(workers, tiny_llama_dir):
    producer, consumer = workers
    prompt = random_prompts(1, 500, 30, 30, seed=3)[0]
    params = prefill(producer, [prompt])[0]
    other = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_consumer"}, **{**ENGINE, "page_size": 16})
    with pytest.raises(ValueError, match="page_size 8 differs from this worker's 16"):
        other.llm_engine.add_request("a", {"prompt_token_ids": prompt}, greedy(4, params))
    other.llm_engine.shutdown()
    with pytest.raises(ValueError, match="different prompt"):
        consumer.llm_engine.add_request("b", {"prompt_token_ids": prompt[1:] + [7]}, greedy(4, params))
    with pytest.raises(ValueError, match="kv_role is 'kv_consumer'"):
        consumer.llm_engine.add_request("c", {"prompt_token_ids": prompt}, greedy(1, {"do_remote_decode": True}))
    with pytest.raises(ValueError, match="remote_port must be a int"):
        consumer.llm_engine.add_request("d", {"prompt_token_ids": prompt}, greedy(4, {**params, "remote_port": "x"}))
    assert decode(consumer, prompt, params) == decode(producer, prompt, None)  # both still serve


def test_the_config_is_checked():
    with pytest.raises(ValueError, match="kv_role must be one of"):
        EngineConfig(kv_transfer_config={"kv_role": "producer"})
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        EngineConfig(kv_transfer_config='{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="unknown fields"):
        EngineConfig(kv_transfer_config={"kv_role": "kv_both", "kv_parallel_size": 2})
    with pytest.raises(ValueError, match="kv_buffer_size must be a number of bytes"):
        EngineConfig(kv_transfer_config={"kv_buffer_size": -1})
    with pytest.raises(ValueError, match="pull_timeout_s must be a number of seconds"):
        EngineConfig(kv_transfer_config={"kv_connector_extra_config": {"pull_timeout_s": 0}})

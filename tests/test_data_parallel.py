"""Data-parallel replicas in one server (`--data-parallel-size`): outputs, load balancing, metrics, bad sizes."""

from __future__ import annotations

import asyncio

import httpx
import jax
import pytest

from tests.conftest import random_prompts, serve_app
from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig

# one decode bucket and one prefill chunk shape, compiled when first used: routing and replicas are the point here
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, page_size=8, warmup=False,
              decode_batch_buckets=(4,), smallest_prefill_bucket=64)
MODEL = "tiny"


def replicas(model_dir: str, method: str, **options):
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.async_engine import AsyncEngine
    from jaxserve.server.data_parallel import DataParallelEngine

    configs = [EngineConfig(model=model_dir, data_parallel_rank=rank, **ENGINE, **options) for rank in range(2)]
    return DataParallelEngine([AsyncEngine(lambda c=c: LLMEngine(c), max_waiting=8, replica=rank)
                               for rank, c in enumerate(configs)], method)


def served_by(metrics: str) -> dict[str, float]:
    """Finished requests per replica, from /metrics."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("jaxserve:request_success_total{") and 'finished_reason="length"' in line:
            replica = line.split('replica="')[1].split('"')[0]
            counts[replica] = float(line.split()[-1])
    return counts


def test_two_replicas_answer_as_one_engine_greedy_and_seeded(tiny_llama_dir):
    prompts = random_prompts(6, 500, 5, 40, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_llama_dir, **ENGINE)
    expected = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)] for params in (greedy, seeded)]
    del llm

    async def check(http: httpx.AsyncClient) -> None:
        got = []
        for params in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}):
            answers = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True,
                **params}) for prompt in prompts))
            assert all(answer.status_code == 200 for answer in answers), answers[0].text
            got.append([answer.json()["choices"][0]["token_ids"] for answer in answers])
        assert got == expected
        metrics = (await http.get("/metrics")).text
        assert served_by(metrics) == {"0": 6.0, "1": 6.0}  # round robin: every other request
        assert 'jaxserve:num_requests_running{model_name="tiny",replica="1"}' in metrics
        assert 'jaxserve:time_to_first_token_seconds_count{model_name="tiny",replica="0"}' in metrics

    engine = replicas(tiny_llama_dir, "round_robin")
    serve_app(engine, check, MODEL)
    for rank, replica in enumerate(engine.replicas):  # each replica's weights and KV pool on its own device
        runner = replica.llm_engine.runner
        assert {d.id for leaf in jax.tree.leaves((runner.params, runner.kv_cache)) for d in leaf.devices()} == {rank}


def test_cache_aware_follows_the_prefix_and_breaks_ties_and_crowds_by_load(tiny_llama_dir):
    engine = replicas(tiny_llama_dir, "cache_aware")
    conversation = random_prompts(1, 500, 40, 40, seed=12)[0]
    other = random_prompts(1, 500, 40, 40, seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def check(http: httpx.AsyncClient) -> None:
        first, second = engine.replicas
        assert engine.ranking(conversation) == [first, second]  # nothing cached anywhere: by load, then index
        await second.submit("turn-1", [conversation], params).final_outputs()  # the conversation lives on 1
        follow_up = conversation + [7, 8, 9]
        assert engine.ranking(follow_up) == [second, first]
        assert engine.ranking(other) == [first, second]  # a miss goes by load
        answer = await http.post("/v1/completions", json={"model": MODEL, "prompt": follow_up, "max_tokens": 4})
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert served_by((await http.get("/metrics")).text) == {"0": 0.0, "1": 2.0}
        # four long requests make replica 1 a full batch busier than replica 0: the hit no longer outweighs that
        held = [second.submit(f"busy-{i}", [other], SamplingParams(max_tokens=80, ignore_eos=True))
                for i in range(4)]
        assert engine.ranking(follow_up) == [first, second]
        for submission in held:
            submission.abort()

    serve_app(engine, check, MODEL)



def test_cache_aware_keys_an_adapters_prompts_by_the_adapter(tiny_llama_dir, tmp_path):
    """A replica's prefix cache keeps an adapter's pages apart from the base model's: routing looks them up so."""
    from jaxserve import LoRARequest
    from tests.test_lora import save_peft_adapter

    adapter = LoRARequest("a", 1, save_peft_adapter(tiny_llama_dir, str(tmp_path / "a"), 0, r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "v_proj"]))
    engine = replicas(tiny_llama_dir, "cache_aware", enable_lora=True, max_lora_rank=4)
    conversation = random_prompts(1, 500, 40, 40, seed=12)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def check(http: httpx.AsyncClient) -> None:
        first, second = engine.replicas
        await second.submit("turn-1", [conversation], params, lora_request=adapter).final_outputs()
        follow_up = conversation + [7, 8, 9]
        assert engine.ranking(follow_up, adapter) == [second, first]  # the adapter's pages live on 1
        assert engine.ranking(follow_up) == [first, second]  # the base model's are nowhere: by load, then index
        hits = second.llm_engine.stats().prefix_cache_hits
        await engine.submit("turn-2", [follow_up], params, lora_request=adapter).final_outputs()
        assert second.llm_engine.stats().prefix_cache_hits - hits == 40

    serve_app(engine, check, MODEL)

def test_a_router_pins_a_request_to_a_replica_by_vllms_header(tiny_llama_dir):
    """`X-data-parallel-rank` (vllm-router's data-parallel mode): the request runs on that replica whatever the
    load-balance method would pick; a replica the server lacks, or a rank that is not a number, is a 400."""
    engine = replicas(tiny_llama_dir, "cache_aware")
    prompt = random_prompts(1, 500, 24, 24, seed=14)[0]

    async def check(http: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        for rank in (1, 1, 0):
            answer = await http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
            assert answer.status_code == 200, answer.text
        assert served_by((await http.get("/metrics")).text) == {"0": 1.0, "1": 2.0}  # cache_aware alone: all on 1
        for rank, message in (("2", "not a replica of this server (0..1)"), ("x", "must be an integer")):
            answer = await http.post("/v1/chat/completions", headers={"X-data-parallel-rank": rank}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text

    serve_app(engine, check, MODEL)


def test_a_full_replica_is_skipped_and_all_full_is_a_503(tiny_llama_dir):
    from jaxserve.server.async_engine import ServerOverloaded

    engine = replicas(tiny_llama_dir, "round_robin")
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def check(http: httpx.AsyncClient) -> None:
        first, second = engine.replicas
        held = [first.submit(f"fill-{i}", [[5, 6, 7]], long) for i in range(12)]  # 4 slots + 8 waiting
        submission = engine.submit("next", [[5, 6, 7]], long)
        assert submission.request_ids[0] in second._requests  # replica 0 was next in turn, but full
        held += [submission] + [second.submit(f"more-{i}", [[5, 6, 7]], long) for i in range(11)]
        with pytest.raises(ServerOverloaded, match="every replica is at capacity"):
            engine.submit("refused", [[5, 6, 7]], long)
        refused = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        for each in held:
            each.abort()

    serve_app(engine, check, MODEL)


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "3", "--tensor-parallel-size", "2"], "needs 6 devices, but only 4 are visible"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["--data-parallel-size", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:1"],
     "not supported with --nnodes > 1"),
    (["--data-parallel-size", "2", "--load-balance-method", "random"], "invalid choice: 'random'"),
])
def test_sizes_that_do_not_fit_are_clear_errors(argv, message, capsys):
    from jaxserve.server import serve_main

    with pytest.raises(SystemExit) as exit:
        serve_main(["--model", "unused", *argv])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_bad_replica_settings_are_value_errors():
    from jaxserve.server.data_parallel import DataParallelEngine

    with pytest.raises(ValueError, match="data_parallel_rank must be an integer >= 0"):
        EngineConfig(data_parallel_rank=-1)
    with pytest.raises(ValueError, match="load_balance_method must be one of"):
        DataParallelEngine([], "fastest")
    with pytest.raises(ValueError, match="needs >= 2 replicas"):
        DataParallelEngine([], "round_robin")

"""KV cache events (vLLM's `--kv-events-config`): the batches a subscriber reads, decoded with a schema written
here from vLLM's wire format (not jaxserve's own structs), replay the prefix cache exactly: the pages stored
minus those removed, after a reset that clears them all, are the pages the page manager holds, each chained to its
parent by its key; a replay request gets every batch from the sequence number it asks for."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.page_manager import page_key
from tests.conftest import random_prompts
from tests.test_server_process import free_port


class Event(msgspec.Struct, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(Event):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def replay(endpoint: str, start: int) -> list[tuple[int, Batch]]:
    """Every buffered batch from sequence number `start`, read through the replay socket."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart((b"", start.to_bytes(8, "big")))
    batches = []
    while True:
        assert socket.poll(30_000), "no replay answer"
        _, sequence, payload = socket.recv_multipart()
        if int.from_bytes(sequence, "big", signed=True) == -1:
            break
        batches.append((int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload, type=Batch)))
    context.destroy(linger=0)
    return batches


def test_the_event_stream_replays_the_prefix_cache(tiny_llama_dir):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(tiny_llama_dir, max_num_seqs=2, max_model_len=128, page_size=8, num_kv_pages=24, warmup=False,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                "replay_endpoint": replay_endpoint, "topic": "kv"})
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts(6, 500, 30, 60, seed=3)]
    llm.generate(prompts, params, use_tqdm=False)  # a pool of 24 pages: later prompts evict earlier pages
    assert llm.reset_prefix_cache()
    llm.generate(prompts[:2] + prompts[:2], params, use_tqdm=False)  # stored again, then hit
    engine.kv_events.flush()

    batches = replay(replay_endpoint, 0)
    assert [sequence for sequence, _ in batches] == list(range(len(batches)))
    assert [sequence for sequence, _ in replay(replay_endpoint, 3)] == list(range(3, len(batches)))
    held: dict[bytes, bytes | None] = {}
    kinds = set()
    for _, batch in batches:
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            kinds.add(type(event).__name__)
            if isinstance(event, BlockStored):
                (key,) = event.block_hashes
                assert event.block_size == 8 and event.medium == "GPU" and len(event.token_ids) == 8
                assert page_key(event.parent_block_hash or b"", tuple(event.token_ids)) == key
                assert event.parent_block_hash is None or event.parent_block_hash in held  # its parent is cached
                held[key] = event.parent_block_hash
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    del held[key]
            else:
                held.clear()
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert set(held) == set(engine.page_manager.page_of_key)
    engine.shutdown()


def test_the_config_is_checked():
    with pytest.raises(ValueError, match="unknown fields"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "endpoints": "tcp://*:5557"})
    with pytest.raises(ValueError, match="publisher must be"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "nats"}')
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True}, enable_prefix_caching=False)
    assert EngineConfig(kv_events_config={"publisher": "zmq"}).kv_events is None  # not enabled

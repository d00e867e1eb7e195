"""KV tiers under the prefix cache (issue 29): the host tier (LRU by bytes), the disk tier (checked files under a
fingerprint), lookups that continue a device match exactly, and the engine end to end: greedy and seeded outputs
identical with tiers off and on under chunked prefill and preemption, an int8 KV cache on two devices, a restart
over the disk tier, corrupted files, batched transfers, no compile after warm-up, and the metrics."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_disk import DiskTier, kv_fingerprint
from jaxserve.engine.kv_tiers import HostTier, KVTiers, TierPage
from jaxserve.engine.page_manager import page_key
from jaxserve.engine.stats import SchedulerStats
from jaxserve.server.metrics import ServerMetrics
from tests.conftest import random_prompts

SPECS = (("float32", (4, 2, 4, 8)), ("float32", (4, 2, 4)))  # values and scales of a 2-layer page of 4 tokens


def tier_page(tokens: list[int], seed: int, key: bytes | None = None) -> TierPage:
    rng = np.random.default_rng(seed)
    arrays = tuple(rng.standard_normal(shape).astype(dtype) for dtype, shape in SPECS)
    return TierPage(key if key is not None else bytes([seed]) * 32, np.asarray(tokens, np.int32), arrays)


def chain(tokens: list[int], page_size: int, hash_fn=page_key) -> list[bytes]:
    keys, parent = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = hash_fn(parent, tuple(tokens[start:start + page_size]))
        keys.append(parent)
    return keys


# -- host bookkeeping ------------------------------------------------------------------------------------------

def test_host_tier_evicts_least_recently_used_within_its_byte_bound():
    pages = [tier_page([i] * 4, i) for i in range(5)]
    tier = HostTier(3 * pages[0].nbytes)
    for page in pages[:3]:
        tier.put(page)
    tier.get(pages[0].key)  # now the most recently used
    tier.put(pages[3])
    assert tier.keys() == [pages[2].key, pages[0].key, pages[3].key] and tier.used_bytes <= tier.capacity_bytes
    tier.put(pages[4])
    assert tier.keys() == [pages[0].key, pages[3].key, pages[4].key]
    assert tier.used_bytes == 3 * pages[0].nbytes
    huge = TierPage(b"h" * 32, np.zeros(4, np.int32), (np.zeros(10**4, np.float32),))
    tier.put(huge)  # larger than the whole tier: not kept, nothing evicted for it
    assert huge.key not in tier and len(tier) == 3


def test_lookup_follows_the_chain_and_checks_every_token():
    """A page is taken only if its whole token prefix equals the sequence's: a key that collides (a weak hash
    here) is a miss, never another prefix's K/V."""
    def weak_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
        return bytes([sum(tokens) % 7])
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    tiers = KVTiers(HostTier(10**8), None, 4, weak_hash)
    keys = chain(tokens, 4, weak_hash)
    for index, key in enumerate(keys):
        tiers.host.put(tier_page(tokens[:4 * (index + 1)], index, key))
    found = tiers.lookup(tokens, 0, b"", 3)
    assert [page.key for page, tier in found] == keys and {tier for _, tier in found} == {"host"}
    assert [page.key for page, _ in tiers.lookup(tokens, 1, keys[0], 2)] == keys[1:]
    other = [4, 3, 2, 1] + tokens[4:]  # the same weak key for its first page, other tokens
    assert weak_hash(b"", tuple(other[:4])) == keys[0] and tiers.lookup(other, 0, b"", 3) == []
    assert len(tiers.lookup(tokens, 0, b"", 2)) == 2  # at most max_pages
    tiers.count(13, found)
    assert (tiers.counters["host"].queries, tiers.counters["host"].hits) == (13, 12)


# -- the disk tier ---------------------------------------------------------------------------------------------

def test_disk_tier_round_trip_and_every_bad_file_is_a_removed_miss(tmp_path):
    fingerprint = kv_fingerprint(model="a")
    disk = DiskTier(str(tmp_path), fingerprint, 10**8, SPECS)
    pages = [tier_page(list(range(4 * (i + 1))), i) for i in range(4)]
    for page in pages:
        disk.submit(page, 0.0)
    disk.flush()
    assert disk.num_written == 4
    read = disk.read(pages[0].key)
    assert np.array_equal(read.prefix, pages[0].prefix)
    assert all(np.array_equal(a, b) for a, b in zip(read.arrays, pages[0].arrays))
    files = {page.key: disk.directory / (page.key.hex() + ".kv") for page in pages}
    data = bytearray(files[pages[1].key].read_bytes())
    data[-5] ^= 0xFF  # one flipped payload byte
    files[pages[1].key].write_bytes(bytes(data))
    files[pages[2].key].write_bytes(files[pages[2].key].read_bytes()[:-100])  # truncated
    other = DiskTier(str(tmp_path), kv_fingerprint(model="b"), 10**8, SPECS)  # another model's file, moved in
    other.submit(pages[3], 0.0)
    other.flush()
    os.replace(other.directory / files[pages[3].key].name, files[pages[3].key])
    files[pages[0].key].rename(files[pages[0].key].with_name(pages[3].key.hex() + "x.kv"))
    for page in pages[1:]:
        assert disk.read(page.key) is None and not files[page.key].exists()
    assert disk.read(pages[0].key) is None  # renamed away: no file under its key
    disk.submit(TierPage(pages[0].key, pages[0].prefix, pages[0].arrays[:1]), 0.0)  # other shapes than the tier's
    disk.flush()
    assert disk.read(pages[0].key) is None and not files[pages[0].key].exists()


def test_disk_tier_keeps_its_size_bound_and_a_new_tier_sees_old_files(tmp_path):
    pages = [tier_page(list(range(4)), i) for i in range(6)]
    fingerprint = kv_fingerprint(model="a")
    disk = DiskTier(str(tmp_path), fingerprint, 10**8, SPECS)
    disk.submit(pages[0], 0.0)
    disk.flush()
    size = disk.used_bytes
    bounded = DiskTier(str(tmp_path), fingerprint, 3 * size, SPECS)  # finds the first file at start
    assert bounded.used_bytes == size
    for page in pages[1:]:
        bounded.submit(page, 0.0)
    bounded.flush()
    names = sorted(p.name for p in bounded.directory.glob("*.kv"))
    assert bounded.used_bytes <= 3 * size and names == sorted(p.key.hex() + ".kv" for p in pages[3:])
    assert not list(bounded.directory.glob("*.tmp"))


def test_engines_sharing_a_directory_never_read_a_torn_file(tmp_path):
    """Two tiers on one directory (two engines' worth) write the same pages at once while a third reads them: every
    read is a miss or the page exactly, and every file left is whole."""
    import threading

    fingerprint = kv_fingerprint(model="a")
    pages = [tier_page(list(range(4 * (i + 1))), i) for i in range(40)]
    writers = [DiskTier(str(tmp_path), fingerprint, 10**8, SPECS) for _ in range(2)]
    reader = DiskTier(str(tmp_path), fingerprint, 10**8, SPECS)
    seen, done = [], threading.Event()

    def read_all():
        while not done.is_set():
            for page in pages:
                got = reader.read(page.key)
                if got is not None:
                    seen.append(all(np.array_equal(a, b) for a, b in zip(got.arrays, page.arrays)))
    thread = threading.Thread(target=read_all)
    thread.start()
    for page in pages:
        for writer in writers:
            writer.submit(page, 0.0)
    for writer in writers:
        writer.flush()
    done.set()
    thread.join()
    assert all(seen) and reader.num_removed == 0
    assert all(reader.read(page.key) is not None for page in pages)
    assert not list(reader.directory.glob("*.tmp"))


# -- the engine ------------------------------------------------------------------------------------------------

OPTIONS = dict(num_kv_pages=12, page_size=16, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=32,
               smallest_prefill_bucket=32, decode_batch_buckets=(2,))
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(5, 500, 60, 100, seed=29)]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)] * 3


def two_rounds(llm: LLM) -> tuple[list, list]:
    """Outputs of the prompts twice over (the second round finds them in the tiers, the pool being too small), and
    the cached tokens of the second."""
    outputs, cached = [], []
    for _ in range(2):
        results = llm.generate(PROMPTS, PARAMS[:len(PROMPTS)], use_tqdm=False)
        outputs.append([result.outputs[0].token_ids for result in results])
        cached.append(sum(result.num_cached_tokens for result in results))
    return outputs, cached


@pytest.fixture(scope="module")
def untiered(tiny_llama_dir):
    return two_rounds(LLM(tiny_llama_dir, **OPTIONS))


def test_host_and_disk_tiers_give_identical_outputs_and_a_restart_hits(tiny_llama_dir, untiered, tmp_path, caplog):
    expected, cached_without = untiered
    llm = LLM(tiny_llama_dir, **OPTIONS, kv_offloading_size=0.05, kv_offloading_dir=str(tmp_path))
    engine = llm.llm_engine
    calls = []  # (engine step, transfer step, pages) of every transfer call
    run = engine.runner.steps.run

    def spy(name, inputs, **kwargs):
        if name.startswith("kv_"):
            calls.append((engine.phases.steps, name, int((np.asarray(inputs.pages) > 0).sum())))
        return run(name, inputs, **kwargs)
    engine.runner.steps.run = spy
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        outputs, cached = two_rounds(llm)
    assert [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()] == []
    assert outputs == expected
    assert engine.scheduler.num_preemptions > 0 and cached[1] > cached_without[1] + 100
    stats = engine.stats()
    host = dict((tier, (q, h)) for tier, q, h in stats.external_prefix_cache)["host"]
    assert host[1] > 0 and host[1] <= host[0]
    transfers = engine.runner.transfers
    largest = transfers.buckets[-1]
    for name in ("kv_store", "kv_restore"):  # batched: per step and direction, every call but one full
        by_step = {}
        for step, called, pages in calls:
            if called == name:
                by_step.setdefault(step, []).append(pages)
        assert by_step and max(max(pages) for pages in by_step.values()) > 1
        assert all(sorted(pages)[1:] == [largest] * (len(pages) - 1) for pages in by_step.values()), (name, by_step)
    assert sum(pages for _, called, pages in calls if called == "kv_store") == transfers.pages_stored
    engine.shutdown()  # flushes the disk tier (so does the end of the process)
    files = sorted(engine.page_manager.tiers.disk.directory.glob("*.kv"))
    assert len(files) == transfers.pages_stored
    for file in files[::3]:  # a third of the files corrupted: misses, removed, recomputed
        file.write_bytes(file.read_bytes()[:-1] + b"\0")

    restarted = LLM(tiny_llama_dir, **OPTIONS, kv_offloading_dir=str(tmp_path))  # no host tier: the disk's only
    first = restarted.generate(PROMPTS, PARAMS[:len(PROMPTS)], use_tqdm=False)
    assert [result.outputs[0].token_ids for result in first] == expected[0]
    disk = dict((tier, (q, h)) for tier, q, h in restarted.llm_engine.stats().external_prefix_cache)["disk"]
    assert disk[1] > 0 and sum(result.num_cached_tokens for result in first) > 0
    assert restarted.llm_engine.page_manager.tiers.disk.num_removed > 0


def test_int8_kv_cache_on_two_devices_with_a_host_tier(tiny_llama_dir):
    options = dict(OPTIONS, kv_cache_dtype="int8")
    expected, _ = two_rounds(LLM(tiny_llama_dir, **options))
    llm = LLM(tiny_llama_dir, **options, tensor_parallel_size=2, kv_offloading_size=0.05)
    outputs, cached = two_rounds(llm)
    assert outputs == expected and cached[1] > 0
    assert len(llm.llm_engine.runner.transfers.page_specs) == 2  # int8 values and their float32 scales


def test_ngram_speculation_with_a_host_tier(tiny_llama_dir):
    """Speculative steps (synchronous, drafts' room trimmed) register and restore pages like plain ones."""
    options = dict(OPTIONS, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    expected, _ = two_rounds(LLM(tiny_llama_dir, **options))
    outputs, cached = two_rounds(LLM(tiny_llama_dir, **options, kv_offloading_size=0.05))
    assert outputs == expected and cached[1] > 0


def test_tier_options_are_checked():
    with pytest.raises(ValueError, match="kv_offloading_size must be >= 0"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching must be on for the KV tiers"):
        EngineConfig(kv_offloading_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_disk_size must be > 0"):
        EngineConfig(kv_offloading_disk_size=0)
    for spec in ({"model": "x", "num_speculative_tokens": 2}, {"method": "eagle3", "model": "x",
                                                                "num_speculative_tokens": 2}):
        with pytest.raises(ValueError, match=f"speculative method '{spec.get('method', 'draft_model')}'"):
            EngineConfig(kv_offloading_size=1, speculative_config=spec).resolve(64)


def test_tier_metrics_are_exposed(caplog):
    stats = SchedulerStats(external_prefix_cache=(("host", 100, 64), ("disk", 36, 16)), prompt_tokens=10,
                           kv_tier_usage=(("host", 10, 20), ("disk", 5, 50)),
                           kv_transfers=(("device_to_host", 3, 300, 0.5), ("host_to_device", 2, 200, 0.25)),
                           kv_cache_fragmentation=0.125)
    text = ServerMetrics([lambda: stats], "m").exposition().decode()
    for line in ('jaxserve:external_prefix_cache_queries_total{model_name="m",tier="host"} 100.0',
                 'jaxserve:external_prefix_cache_hits_total{model_name="m",tier="disk"} 16.0',
                 'jaxserve:kv_offload_total_bytes_total{model_name="m",transfer_type="device_to_host"} 300.0',
                 'jaxserve:kv_tier_usage_bytes{model_name="m",tier="host"} 10.0',
                 'jaxserve:kv_cache_fragmentation_perc{model_name="m"} 0.125'):
        assert line in text
    assert "external_prefix_cache" not in ServerMetrics([lambda: SchedulerStats()], "m").exposition().decode()
    from jaxserve.server.metrics import StatLogger

    logger = StatLogger(lambda: stats)
    with caplog.at_level(logging.INFO):
        logger.log()
    assert "External prefix cache hit rate: host 64.0%, disk 44.4%, KV cache fragmentation: 12.5%" in caplog.text

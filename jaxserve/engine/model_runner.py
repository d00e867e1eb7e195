"""`ModelRunner`: the device side of the engine — params, the paged KV pool, the penalty state, and the jitted steps.

The narrow interface the host loop uses (after JetStream's engine_api):

* `insert(slot, token_ids, num_prompt_tokens, ban_ids)`: resets the slot's penalty statistics for a
  newly admitted sequence (only needed when it uses penalties or min_tokens).
* `prefill(slots, token_ids, starts, ...)`: computes K/V for chunks of one or several sequences and
  samples the token after each; one compiled shape per (rows, chunk-length) bucket.
* `decode(slots, tokens, positions, page_tables, ...)`: one token for each of a batch of sequences; one
  compiled shape per batch bucket (attention loops only over the pages in use).

Each forward is a pure jitted function (params, KV pool, inputs) -> (logits, their argmax, new KV pool)
with the pool donated, so no step copies it. A batch the host knows is plain (greedy, no penalties, no
pending min_tokens, no logprobs) takes the argmax; any other runs the sampler, a second small jitted
function (penalty state, logits, sampling parameters) -> (tokens, new penalty state) with the penalty
state donated. One forward per shape serves both, so start-up compiles each forward once.
Results stay on device until the host fetches them all at once (`fetch`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine.config import EngineConfig, power_of_two_buckets
from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.sampler import PenaltyState, SampleResult, SamplingBatch, argmax, sample
from jaxserve.models import forward

logger = logging.getLogger(__name__)
BAN_IDS_BUCKET = 16


def bucket_for(size: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")


def _prefill_step(config, backend, dtype, page_size, params, kv_cache, token_ids, starts, num_tokens, page_tables):
    """Chunks of `rows` sequences at once: `token_ids [rows, T]`, chunk i starting at position `starts[i]`."""
    rows, chunk = token_ids.shape
    positions = starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    valid = jnp.arange(chunk)[None, :] < num_tokens[:, None]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, page_index, axis=1)
    slot_mapping = jnp.where(valid, pages * page_size + positions % page_size, 0)
    meta = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, page_tables=page_tables,
                             context_lens=jnp.where(num_tokens > 0, starts + num_tokens, 0), query_lens=num_tokens)
    logits, kv_cache = forward(params, config, backend, token_ids, kv_cache, meta,
                               logits_indices=jnp.maximum(num_tokens - 1, 0), dtype=dtype)
    return logits, argmax(logits), kv_cache


def _decode_step(config, backend, dtype, page_size, params, kv_cache, token_ids, positions, page_tables, active):
    rows = token_ids.shape[0]
    page_index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    page = jnp.take_along_axis(page_tables, page_index[:, None], axis=1)[:, 0]
    slot_mapping = jnp.where(active, page * page_size + positions % page_size, 0)
    meta = AttentionMetadata(positions=positions[:, None], slot_mapping=slot_mapping[:, None], page_tables=page_tables,
                             context_lens=jnp.where(active, positions + 1, 0),
                             query_lens=jnp.ones((rows,), jnp.int32))
    logits, kv_cache = forward(params, config, backend, token_ids[:, None], kv_cache, meta,
                               logits_indices=jnp.zeros((rows,), jnp.int32), dtype=dtype)
    return logits, argmax(logits), kv_cache


def _sample_step(penalties: PenaltyState, logits, slots, sampling: SamplingBatch, counted):
    """The full sampler on a forward's logits; rows with `counted` add their token to the slot's output counts."""
    result = sample(logits, sampling, penalties, slots)
    counts = penalties.output_counts.at[slots, result.tokens].add(counted.astype(jnp.int32))
    return result, penalties.replace(output_counts=counts)


def _insert_step(vocab_size, penalties: PenaltyState, slot, token_ids, num_prompt_tokens, num_tokens, ban_ids):
    index = jnp.arange(token_ids.shape[0])
    prompt_ids = jnp.where(index < num_prompt_tokens, token_ids, vocab_size)  # out of range: dropped
    output_ids = jnp.where((index >= num_prompt_tokens) & (index < num_tokens), token_ids, vocab_size)
    prompt_row = jnp.zeros((vocab_size,), bool).at[prompt_ids].set(True, mode="drop")
    count_row = jnp.zeros((vocab_size,), jnp.int32).at[output_ids].add(1, mode="drop")
    ban_row = jnp.zeros((vocab_size,), bool).at[jnp.where(ban_ids >= 0, ban_ids, vocab_size)].set(True, mode="drop")
    return PenaltyState(prompt_mask=penalties.prompt_mask.at[slot].set(prompt_row),
                        output_counts=penalties.output_counts.at[slot].set(count_row),
                        min_tokens_ban=penalties.min_tokens_ban.at[slot].set(ban_row))


class ModelRunner:
    def __init__(self, config: ModelConfig, params, engine_config: EngineConfig):
        self.config = config
        self.engine_config = engine_config
        self.dtype = jnp.bfloat16 if engine_config.dtype == "bfloat16" else jnp.float32
        self.backend = AttentionBackend(engine_config.attention_backend)
        self.page_size = engine_config.page_size
        self.params = jax.tree.map(lambda x: jnp.asarray(x, self.dtype), params)
        self.num_pages = engine_config.num_kv_pages or self._pages_for_memory_budget()
        pool_shape = self.backend.pool_shape(self.num_pages, self.page_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = [(jnp.zeros(pool_shape, self.dtype), jnp.zeros(pool_shape, self.dtype))
                         for _ in range(config.num_layers)]
        slots, vocab = engine_config.max_num_seqs, config.vocab_size
        self.penalties = PenaltyState(prompt_mask=jnp.zeros((slots, vocab), bool),
                                      output_counts=jnp.zeros((slots, vocab), jnp.int32),
                                      min_tokens_ban=jnp.zeros((slots, vocab), bool))
        static = (config, self.backend, self.dtype, self.page_size)
        self._prefill = jax.jit(functools.partial(_prefill_step, *static), donate_argnums=(1,))
        self._decode = jax.jit(functools.partial(_decode_step, *static), donate_argnums=(1,))
        self._sample = jax.jit(_sample_step, donate_argnums=(0,))
        self._insert = jax.jit(functools.partial(_insert_step, vocab), donate_argnums=(0,))
        self._compiled: dict[tuple, object] = {}  # (kind, input shapes) -> executable compiled at start-up
        logger.info("KV pool: %d pages x %d tokens = %d tokens, %.1f MiB (%s, %s attention, per layer %s)", self.num_pages,
                    self.page_size, self.num_pages * self.page_size, self.kv_pool_bytes / 2**20,
                    engine_config.dtype, self.backend.name, pool_shape)

    @property
    def page_bytes(self) -> int:
        cfg = self.config
        return 2 * cfg.num_layers * self.page_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def _pages_for_memory_budget(self) -> int:
        ec = self.engine_config
        enough_for_all_slots = ec.max_num_seqs * ec.pages_per_seq + 1
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            return max(2, int(free * ec.kv_cache_memory_fraction) // self.page_bytes)
        cpu_budget = 4 * 2**30  # host memory: cap the pool at 4 GiB
        return max(2, min(enough_for_all_slots, cpu_budget // self.page_bytes))

    # -- the step interface ------------------------------------------------------------------------------------

    def insert(self, slot: int, token_ids: list[int], num_prompt_tokens: int, ban_ids: list[int]) -> None:
        ids = np.zeros(bucket_for(len(token_ids), self.insert_buckets), np.int32)
        ids[:len(token_ids)] = token_ids
        bans = np.full(max(BAN_IDS_BUCKET, 1 << (len(ban_ids) - 1).bit_length() if ban_ids else 0), -1, np.int32)
        bans[:len(ban_ids)] = ban_ids
        self.penalties = self._call("insert", self._insert, (self.penalties,),
                                    (np.int32(slot), ids, np.int32(num_prompt_tokens), np.int32(len(token_ids)), bans))

    def prefill(self, slots: np.ndarray, token_ids: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray,
                page_tables: np.ndarray, sampling: SamplingBatch, is_final: np.ndarray, plain: bool) -> SampleResult:
        """Chunks of several sequences, padded to a `(rows, tokens)` shape from `prefill_shapes` (empty rows: 0 tokens).

        `plain`: every row is greedy with no penalties, pending min_tokens or logprobs (the argmax is the token).
        """
        logits, greedy, self.kv_cache = self._call("prefill", self._prefill, (self.params, self.kv_cache),
                                                   (token_ids, starts, num_tokens, page_tables))
        return self._choose_tokens(logits, greedy, slots, sampling, is_final, plain)

    def decode(self, slots: np.ndarray, token_ids: np.ndarray, positions: np.ndarray, page_tables: np.ndarray,
               active: np.ndarray, sampling: SamplingBatch, plain: bool) -> SampleResult:
        """Inputs are already padded to a batch bucket; `page_tables` is `[rows, pages_per_seq]`; `plain` as in prefill."""
        logits, greedy, self.kv_cache = self._call("decode", self._decode, (self.params, self.kv_cache),
                                                   (token_ids, positions, page_tables, active))
        return self._choose_tokens(logits, greedy, slots, sampling, active, plain)

    def _choose_tokens(self, logits, greedy, slots, sampling, counted, plain: bool) -> SampleResult:
        if plain:  # the penalty statistics are only read by rows that use penalties, which are never plain
            return SampleResult(tokens=greedy, logprobs=None, top_ids=None, top_logprobs=None)
        result, self.penalties = self._call("sample", self._sample, (self.penalties,),
                                            (logits, slots, sampling, counted))
        return result

    @staticmethod
    def fetch(results):
        """One device->host transfer for everything a step produced."""
        return jax.device_get(results)

    def _call(self, kind: str, jitted, state: tuple, inputs: tuple):
        """Runs the executable compiled at start-up for these shapes, or (warm-up off) the lazily compiling jit."""
        executable = self._compiled.get((kind, _shape_key(inputs)))
        return (executable or jitted)(*state, *inputs)

    # -- start-up ----------------------------------------------------------------------------------------------

    @property
    def insert_buckets(self) -> tuple[int, ...]:
        return power_of_two_buckets(16, max(16, self.engine_config.max_model_len))

    def example_inputs(self, neutral_sampling):
        """`(kind, jitted, inputs)` for every shape the engine can run; they write only to the scratch page."""
        ec = self.engine_config
        for rows, tokens in ec.prefill_shapes:
            zeros = np.zeros(rows, np.int32)
            yield "prefill", self._prefill, (
                np.zeros((rows, tokens), np.int32), zeros, zeros, np.zeros((rows, ec.pages_per_seq), np.int32))
        for rows in ec.decode_batch_buckets:
            zeros = np.zeros(rows, np.int32)
            yield "decode", self._decode, (zeros, zeros, np.zeros((rows, ec.pages_per_seq), np.int32),
                                           np.zeros(rows, bool))
        for rows in sorted({rows for rows, _ in ec.prefill_shapes} | set(ec.decode_batch_buckets)):
            yield "sample", self._sample, (np.zeros((rows, self.config.vocab_size), np.float32),
                                           np.zeros(rows, np.int32), neutral_sampling(rows), np.zeros(rows, bool))
        for length in self.insert_buckets:
            yield "insert", self._insert, (
                np.int32(0), np.zeros(length, np.int32), np.int32(0), np.int32(0),
                np.full(BAN_IDS_BUCKET, -1, np.int32))

    def _state(self, kind: str) -> tuple:
        return (self.penalties,) if kind in ("insert", "sample") else (self.params, self.kv_cache)

    def _run_example(self, kind: str, jitted, inputs) -> None:
        outputs = self._call(kind, jitted, self._state(kind), inputs)
        if kind == "insert":
            self.penalties = outputs
        elif kind == "sample":
            self.penalties = outputs[1]
        else:
            self.kv_cache = outputs[-1]

    def warmup(self, neutral_sampling) -> float:
        """Compiles every shape ahead of time (lowered in turn, each compiled in a pool as soon as it is
        lowered), then runs each once: an executable's first run costs ~0.2 s more than later ones, which
        would land on a request."""
        started = time.perf_counter()
        compiling = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:  # compiling frees the GIL
            for kind, jitted, inputs in self.example_inputs(neutral_sampling):
                key = (kind, _shape_key(inputs))
                if key not in compiling:
                    compiling[key] = pool.submit(jitted.lower(*self._state(kind), *inputs).compile)
            self._compiled = {key: future.result() for key, future in compiling.items()}
        for kind, jitted, inputs in self.example_inputs(neutral_sampling):
            self._run_example(kind, jitted, inputs)
        jax.block_until_ready((self.kv_cache, self.penalties))
        return time.perf_counter() - started


def _shape_key(args) -> tuple:
    """The shapes and dtypes of a step's inputs past the state arguments: which executable serves them."""
    return tuple((leaf.shape, leaf.dtype.name) for leaf in jax.tree.leaves(args))

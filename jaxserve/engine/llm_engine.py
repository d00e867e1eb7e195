"""`LLMEngine`: requests in, outputs out. Owns the tokenizer, the scheduler, the block manager and the model runner.

`add_request` and `abort_request` may be called from any thread: they validate at once (raising
`ValueError` for bad input) and queue a command that the stepping thread applies at the start of
its next `step()`. `step()` runs one iteration: schedule, run prefill chunks and one decode step on
the device, fetch all sampled tokens in one transfer, then append tokens, detokenize, check stop
conditions, retire finished sequences and return the outputs of every request that changed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.config import PREFILL_ROWS, EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.model_runner import ModelRunner, bucket_for
from jaxserve.engine.scheduler import PrefillChunk, Scheduler, SchedulerOutput
from jaxserve.engine.request import Request
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.slot_params import SlotSamplingParams
from jaxserve.layers.sampler import SamplingBatch
from jaxserve.loading import LoadedModel, load_model
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
PromptType = str | list[int] | dict[str, Any]


@dataclasses.dataclass
class EngineStats:
    """Counters for metrics and logs; read by the server."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    steps: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None, **options: Any):
        self.config = config or EngineConfig(**options)
        _enable_compilation_cache(self.config.compilation_cache_dir)
        started = time.perf_counter()
        self.model = loaded or load_model(self.config.model, dtype=np.float32)
        self.tokenizer = self.model.tokenizer
        model_config = self.model.config
        self.config.resolve(model_config.max_position_embeddings)
        self.runner = ModelRunner(model_config, self.model.params, self.config)
        self.model.params = None  # the runner holds the device copy
        if self.runner.num_pages - 1 < self.config.pages_per_seq:
            raise ValueError(f"num_kv_pages={self.runner.num_pages} cannot hold one sequence of max_model_len="
                             f"{self.config.max_model_len} ({self.config.pages_per_seq} pages + 1 scratch page)")
        self.block_manager = BlockManager(self.runner.num_pages, self.config.page_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.eos_token_ids = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._new_commands = threading.Event()
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(self.config.seed)
        self._slot_params = SlotSamplingParams(self.config.max_num_seqs)
        logger.info("model %s loaded in %.1fs", self.model.name, time.perf_counter() - started)
        if self.config.warmup:
            seconds = self.runner.warmup(lambda rows: SlotSamplingParams(rows).batch(np.arange(rows), np.zeros(rows, np.int32)))
            logger.info("warm-up compiled %d prefill and %d decode shapes (and their samplers) in %.1fs",
                        len(self.config.prefill_shapes), len(self.config.decode_batch_buckets), seconds)
        self.ready = True

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # -- requests (any thread) ---------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        """Validates and queues a request; raises ValueError naming the problem. Returns the request id."""
        params = params or SamplingParams()
        prompt_text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        arrival_time = arrival_time or time.monotonic()
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seqs, detoks = [], []
        for index in range(params.n):
            seed = (base_seed + 0x9E3779B1 * index) % 2**32
            seqs.append(Sequence(request_id, index, token_ids, params, seed, arrival_time, priority))
            detoks.append(IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                                 params.include_stop_str_in_output))
        request = Request(request_id, prompt_text, token_ids, params, seqs, detoks, arrival_time)
        self._commands.put(("add", request))
        self._new_commands.set()
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._new_commands.set()

    def wait_for_requests(self, timeout: float | None = None) -> bool:
        """Blocks an idle stepping thread until a request or abort arrives (or `timeout`); True if work is pending."""
        if self.has_unfinished_requests():
            return True
        self._new_commands.wait(timeout)
        return self.has_unfinished_requests()

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, but max_model_len is {max_len}")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({max_len})")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return self.tokenize({"prompt_token_ids": list(prompt)})
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        return prompt, self.tokenizer.encode(prompt)

    # -- the loop (one thread) ---------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or not self._commands.empty()

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of the requests that changed (finished ones are then forgotten)."""
        touched = self._apply_commands()
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            self._run(plan)
            touched |= {seq.request_id for seq in plan.decodes} | {c.seq.request_id for c in plan.prefills}
        now = time.monotonic()
        outputs = []
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.finished:
                request.metrics.finished_time = now
                del self.requests[request_id]
            outputs.append(request.output())
        return outputs

    def _run(self, plan: SchedulerOutput) -> None:
        now = time.monotonic()
        for seq in plan.admitted:
            request = self.requests[seq.request_id]
            request.metrics.first_scheduled_time = request.metrics.first_scheduled_time or now
            self._slot_params.set(seq.slot, seq.params, seq.seed)
            if seq.params.uses_penalties or seq.params.min_tokens:
                bans = [] if seq.params.ignore_eos else sorted(self.eos_token_ids)
                self.runner.insert(seq.slot, seq.token_ids, seq.num_prompt_tokens, bans + seq.params.stop_token_ids)

        groups = self._prefill_groups(plan.prefills)
        prefill_results = [self._run_prefill(tokens, group) for tokens, group in groups]
        decode_result = self._run_decode(plan.decodes) if plan.decodes else None
        prefill_results, decode_result = self.runner.fetch((prefill_results, decode_result))

        self.stats.steps += 1
        now = time.monotonic()
        for (_, group), result in zip(groups, prefill_results):
            for row, chunk in enumerate(group):
                chunk.seq.num_computed_tokens += chunk.num_tokens
                self.block_manager.commit_full_pages(chunk.seq)
                if chunk.is_final:
                    self._append_token(chunk.seq, result, row, now)
        for row, seq in enumerate(plan.decodes):
            seq.num_computed_tokens += 1
            self.block_manager.commit_full_pages(seq)
            self._append_token(seq, decode_result, row, now)

    def _prefill_groups(self, chunks: list[PrefillChunk]) -> list[tuple[int, list[PrefillChunk]]]:
        """(token bucket, chunks) per prefill call: chunks sharing a bucket are packed PREFILL_ROWS at a time."""
        by_bucket: dict[int, list[PrefillChunk]] = {}
        for chunk in chunks:
            by_bucket.setdefault(bucket_for(chunk.num_tokens, self.config.prefill_buckets), []).append(chunk)
        groups = []
        for tokens, members in by_bucket.items():
            if (PREFILL_ROWS, tokens) not in self.config.prefill_shapes:
                groups += [(tokens, [chunk]) for chunk in members]
                continue
            while len(members) >= PREFILL_ROWS - 1:  # three share a call too: one empty row beats a second call
                groups.append((tokens, members[:PREFILL_ROWS]))
                members = members[PREFILL_ROWS:]
            groups += [(tokens, [chunk]) for chunk in members]
        return groups

    def _run_prefill(self, tokens: int, group: list[PrefillChunk]):
        rows = 1 if len(group) == 1 else PREFILL_ROWS
        slots = np.zeros(rows, np.int32)
        token_ids = np.zeros((rows, tokens), np.int32)
        starts = np.zeros(rows, np.int32)
        num_tokens = np.zeros(rows, np.int32)
        output_index = np.zeros(rows, np.int32)
        page_tables = np.zeros((rows, self.config.pages_per_seq), np.int32)
        is_final = np.zeros(rows, bool)
        for row, chunk in enumerate(group):
            seq = chunk.seq
            slots[row] = seq.slot
            token_ids[row, :chunk.num_tokens] = seq.token_ids[chunk.start:chunk.start + chunk.num_tokens]
            starts[row] = chunk.start
            num_tokens[row] = chunk.num_tokens
            output_index[row] = seq.num_output_tokens
            page_tables[row, :len(seq.page_table)] = seq.page_table
            is_final[row] = chunk.is_final
        batch = self._slot_params.batch(slots, output_index)
        return self.runner.prefill(slots, token_ids, starts, num_tokens, page_tables, batch, is_final,
                                   _is_plain(batch, len(group)))

    def _run_decode(self, seqs: list[Sequence]):
        rows = bucket_for(len(seqs), self.config.decode_batch_buckets)
        pages = self.config.pages_per_seq
        slots = np.zeros(rows, np.int32)
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        output_index = np.zeros(rows, np.int32)
        page_tables = np.zeros((rows, pages), np.int32)
        active = np.zeros(rows, bool)
        for row, seq in enumerate(seqs):
            slots[row] = seq.slot
            tokens[row] = seq.token_ids[-1]
            positions[row] = len(seq) - 1
            output_index[row] = seq.num_output_tokens
            page_tables[row, :len(seq.page_table)] = seq.page_table
        active[:len(seqs)] = True
        batch = self._slot_params.batch(slots, output_index)
        return self.runner.decode(slots, tokens, positions, page_tables, active, batch, _is_plain(batch, len(seqs)))

    def _append_token(self, seq: Sequence, result, row: int, now: float) -> None:
        token = int(result.tokens[row])
        request = self.requests[seq.request_id]
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        seq.token_ids.append(token)
        self.stats.generation_tokens += 1
        params = seq.params
        if seq.logprobs is not None:
            logprob = float(result.logprobs[row])
            seq.cumulative_logprob += logprob
            top = {int(i): float(v) for i, v in zip(result.top_ids[row][:params.logprobs],
                                                     result.top_logprobs[row][:params.logprobs])}
            top[token] = logprob
            seq.logprobs.append(top)
        detok = request.detokenizers[seq.index]
        long_enough = seq.num_output_tokens >= params.min_tokens
        if not params.ignore_eos and token in self.eos_token_ids and long_enough:
            return self._finish(seq, "stop", None)
        if token in params.stop_token_ids and long_enough:
            return self._finish(seq, "stop", token)
        stop_string = detok.add_token(token)
        if stop_string is not None and long_enough:
            return self._finish(seq, "stop", stop_string)
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return self._finish(seq, "length", None)
        if len(seq) >= self.config.max_model_len:
            return self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _apply_commands(self) -> set[str]:
        self._new_commands.clear()
        changed = set()
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return changed
            if command == "add":
                if payload.request_id in self.requests:
                    logger.warning("request id %s is already running; ignoring the duplicate", payload.request_id)
                    continue
                self.requests[payload.request_id] = payload
                self.stats.prompt_tokens += len(payload.prompt_token_ids) * len(payload.seqs)
                for seq in payload.seqs:
                    self.scheduler.add(seq)
            elif command == "abort" and payload in self.requests:
                request = self.requests[payload]
                for seq in request.seqs:
                    if not seq.is_finished:
                        self._finish(seq, "abort", None)
                changed.add(payload)


def _is_plain(batch: SamplingBatch, rows: int) -> bool:
    """True when the first `rows` rows are greedy with no penalties, pending min_tokens or logprobs: the
    forward's argmax is then every row's token and the sampler need not run."""
    live = slice(0, rows)
    return not (np.any(batch.temperature[live] > 0) or np.any(batch.repetition_penalty[live] != 1)
                or np.any(batch.presence_penalty[live] != 0) or np.any(batch.frequency_penalty[live] != 0)
                or np.any(batch.output_index[live] < batch.min_tokens[live]) or np.any(batch.wants_logprobs[live]))


def _enable_compilation_cache(directory: str | None) -> None:
    """Turns on jax's persistent compilation cache, so a second start skips most compiles."""
    if not directory:
        return
    directory = os.path.expanduser(directory)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

"""`LLMEngine`: requests in, outputs out. Owns the tokenizer, the scheduler, the page manager and the model runner.

`add_request` and `abort_request` may be called from any thread: they validate at once (raising
`ValueError` for bad input, including a request id already in use) and queue a command that the
stepping thread applies at the start of its next `step()`. `step()` reads as: take commands,
schedule, dispatch the plan to the device, post-process the tokens of the step before it (append
tokens, detokenize, check stop conditions, retire finished sequences) while the device runs this one,
and return a snapshot output for every request that changed. With `async_scheduling=False` a step
post-processes its own tokens instead. Prompt tokens scored by the prefills (prompt_logprobs) join their request
as the step's tokens are read; a request with max_tokens=0 finishes ("length") once its prompt is computed.
With `detokenizer_process` the token ids go to a worker process, whose texts and stop strings join their
requests at a later step (`detokenizer_process.py`); a completion shows only the tokens whose text is in.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxserve.distributed.tensor_parallel import make_mesh
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.detokenizer import DetokenizedText, IncrementalDetokenizer
from jaxserve.engine.detokenizer_process import DetokenizerProcess
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.prompt_logprobs import TokenTexts, prompt_logprob_entries
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.stats import IterationStats, SchedulerStats
from jaxserve.engine.step_output import InFlightStep, SampledToken
from jaxserve.loading import LoadedModel, load_model, model_config, resolve_model
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.spec_decode.draft import draft_model_config
from jaxserve.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)
TEXT_WAIT_SECONDS = 1.0  # an idle step's wait for the detokenizer process's answers
PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None, **options: Any):
        self.config = config or EngineConfig(**options)
        _enable_compilation_cache(self.config.compilation_cache_dir)
        started = time.perf_counter()
        self.mesh = make_mesh(self.config.tensor_parallel_size)
        draft_config = self._check_draft_model(loaded)
        self.model = loaded or load_model(self.config.model, dtype=self.config.jax_dtype,
                                          tokenizer=self.config.tokenizer,
                                          generation_config=self.config.generation_config, mesh=self.mesh,
                                          load_format=self.config.load_format)
        self.tokenizer = self.model.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)  # prompt_logprobs' decoded_token
        # sampling defaults from the model's generation_config.json (vLLM's --generation-config), for fields a
        # request leaves unset: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
        self.default_sampling_params: dict[str, Any] = dict(self.model.generation_config)
        model_config = self.model.config
        self.config.resolve(model_config.max_position_embeddings)
        self.eos_token_ids = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(model_config, self.model.params, self.config, self.eos_token_ids, self.mesh,
                                  draft_config)
        self.model.params = None  # the runner holds the device copy
        self.phases = self.runner.phases  # host seconds per step phase, for benchmarks
        if self.runner.num_pages - 1 < self.config.pages_per_seq:
            raise ValueError(f"num_kv_pages={self.runner.num_pages} cannot hold one sequence of max_model_len="
                             f"{self.config.max_model_len} ({self.config.pages_per_seq} pages + 1 scratch page)")
        self.page_manager = PageManager(self.runner.num_pages, self.config.page_size,
                                        self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.page_manager)
        self.requests: dict[str, Request] = {}  # owned by the stepping thread
        self.detokenizer_process = (DetokenizerProcess(self.tokenizer)
                                    if self.config.detokenizer_process and self.tokenizer is not None else None)
        self._texts: dict[int, tuple[Request, int]] = {}  # detokenizer process: key -> (request, completion index)
        self._text_keys = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._new_commands = threading.Event()
        self._ids_lock = threading.Lock()
        self._live_ids: set[str] = set()  # ids accepted and not yet finished (any thread)
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(self.config.seed)
        self._prompt_tokens = self._generation_tokens = self._steps = 0
        self._finished: dict[str, int] = {}
        self._stats = self._snapshot()
        self._first_token_latencies: list[float] = []
        self._inter_token_latencies: list[float] = []
        self._iteration = IterationStats()
        self._in_flight: InFlightStep | None = None  # async scheduling: the dispatched step not yet read
        logger.info("model %s loaded in %.1fs", self.model.name, time.perf_counter() - started)
        if self.config.warmup:
            seconds = self.runner.warmup()
            logger.info("warm-up compiled %d prefill and %d decode shapes (and their samplers) in %.1fs",
                        len(self.config.prefill_shapes), len(self.config.decode_batch_buckets), seconds)

    def _check_draft_model(self, loaded: LoadedModel | None):
        """A draft model's config, checked against the target's before either is loaded (None: no draft model)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        target = loaded.config if loaded is not None else model_config(resolve_model(self.config.model))
        self.config.resolve(target.max_position_embeddings)
        return draft_model_config(spec, target, self.config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def stats(self) -> SchedulerStats:
        """The snapshot published after the latest step (safe to read from any thread)."""
        return self._stats

    def iteration_stats(self) -> IterationStats:
        """The token latencies of the latest step (for the stepping thread, right after `step()`)."""
        return self._iteration

    # -- requests (any thread) ---------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        """Validates and queues a request; raises ValueError naming the problem. Returns the request id."""
        params = params or SamplingParams()
        prompt_text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids, params)
        self.validate_priority(priority)
        # the grammar compiles here (cached by its text), before the id is taken; each sequence gets its own copy
        grammar = self.grammars.matcher(params.guided_decoding) if params.guided_decoding is not None else None
        with self._ids_lock:
            if request_id is None:
                request_id = next(str(i) for i in self._request_counter if str(i) not in self._live_ids)
            elif request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
            self._live_ids.add(request_id)
        arrival_time = arrival_time or time.monotonic()
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seqs, detoks = [], []
        for index in range(params.n):
            seed = (base_seed + 0x9E3779B1 * index) % 2**32
            seqs.append(Sequence(request_id, index, token_ids, params, seed, arrival_time, priority))
            if grammar is not None:
                seqs[-1].grammar = grammar.deep_copy()
            if self.detokenizer_process is not None:
                detoks.append(DetokenizedText(params.stop))
            else:
                detoks.append(IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                                     params.skip_special_tokens, params.include_stop_str_in_output))
        request = Request(request_id, prompt_text, token_ids, params, seqs, detoks, arrival_time)
        if self.detokenizer_process is not None:
            request.text_keys = [next(self._text_keys) for _ in seqs]
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

    def validate_guided_decoding(self, params: SamplingParams) -> None:
        """Compiles a request's grammar (cached by its text); ValueError with llguidance's message if it fails."""
        if params.guided_decoding is not None:
            self.grammars.compile(params.guided_decoding)

    def validate_priority(self, priority: int) -> None:
        """vLLM's rule: a request priority other than 0 needs scheduling_policy="priority"."""
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} is set, but priority scheduling is not enabled "
                             "(scheduling_policy='priority', --scheduling-policy priority)")

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
        return bool(self.requests) or not self._commands.empty() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns an output for each request that changed (finished ones are then forgotten).

        Synchronous: schedule, dispatch, wait for the plan's tokens, post-process them. Async scheduling
        (the default) dispatches the plan first and then post-processes the previous step's tokens, so the
        device computes step t+1 while the host reads step t (a sequence that stopped at t computes one
        extra token, which is discarded)."""
        self.phases.start()
        self._first_token_latencies, self._inter_token_latencies = [], []
        touched = self._apply_commands()
        if self.detokenizer_process is not None:  # texts, and stop strings, of earlier steps' tokens
            touched |= self._read_texts(0.0)
        plan = self.scheduler.schedule()
        self.phases.lap("schedule")
        launched = self._dispatch(plan) if not plan.is_empty else None
        if self.config.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            self.runner.sample_pending(launched)  # synchronous: its constrained rows' masks (async: done before)
            touched |= self._collect(launched)
        if self._in_flight is not None:  # its forward runs meanwhile; its masks need the tokens just read
            self.runner.sample_pending(self._in_flight)
        if self.detokenizer_process is not None:
            self.detokenizer_process.flush()
            if plan.is_empty and self._in_flight is None and self.detokenizer_process.num_unanswered:
                touched |= self._read_texts(TEXT_WAIT_SECONDS)  # nothing else to do: wait for the texts
        outputs = []
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.finished:
                self._retire(request)
            elif request.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            output = request.output()
            if output is not None:
                outputs.append(output)
        self._stats = self._snapshot()
        self._iteration = IterationStats(tuple(self._first_token_latencies), tuple(self._inter_token_latencies))
        self.phases.lap("postprocess")
        return outputs

    def _dispatch(self, plan: SchedulerOutput) -> InFlightStep:
        now = time.monotonic()
        for seq in plan.admitted:
            request = self.requests[seq.request_id]
            request.first_scheduled_time = request.first_scheduled_time or now
        step = self.runner.dispatch(plan)
        self._steps += 1
        for chunk in plan.prefills:
            if chunk.scored:  # read by the runner's dispatch: each prompt token is scored once, recompute or not
                chunk.seq.num_scored = chunk.scored.stop - 1
            chunk.seq.num_computed_tokens += chunk.num_tokens
            chunk.seq.num_pending += chunk.is_final
            self.page_manager.commit_full_pages(chunk.seq)
        for seq in plan.decodes:
            seq.num_computed_tokens += 1
            seq.num_pending += 1
        return step

    def _collect(self, step: InFlightStep) -> set[str]:
        """Reads a dispatched step's tokens and appends them; a sequence that finished meanwhile drops its token."""
        sampled, scored = self.runner.collect(step)
        now = time.monotonic()
        touched = set()
        for scores in scored:
            request = self.requests.get(scores.seq.request_id)
            if request is not None and not scores.seq.is_finished:
                request.add_prompt_logprobs(scores.first, prompt_logprob_entries(scores, request.prompt_token_ids,
                                                                                 self.token_texts))
        caches_prefixes = self.config.enable_prefix_caching
        for sample in sampled:
            seq = sample.seq
            if sample.accepted_draft:  # a verify step wrote its KV; the sequence's sampled token comes after it
                if seq.is_finished:
                    continue
                seq.num_computed_tokens += 1
            else:
                seq.num_pending -= 1
                if seq.is_finished:
                    continue
            touched.add(seq.request_id)
            if seq.max_output_tokens == 0:  # only scores its prompt: the prefill's sample is no output
                self._finish(seq, "length", None)
                continue
            self._append_token(sample, now)
            if caches_prefixes and seq.page_table:
                self.page_manager.commit_full_pages(seq)
        if self.config.speculative_config is not None:
            for seq in {sample.seq for sample in sampled if sample.seq.num_lookahead}:  # the room made for drafts
                if not seq.is_finished:  # that were rejected (or not proposed) goes back to the pool
                    self.page_manager.trim(seq)
        return touched

    def _append_token(self, sample: SampledToken, now: float) -> None:
        """Appends a sampled token and applies vLLM's stop rules: none is checked before min_tokens outputs."""
        seq, token = sample.seq, sample.token
        request = self.requests[seq.request_id]
        if request.first_token_time is None:
            request.first_token_time = now
            self._first_token_latencies.append(now - request.arrival_time)
        elif request.last_token_time < now:  # once per request and step, though its n completions share it
            self._inter_token_latencies.append(now - request.last_token_time)
        request.last_token_time = now
        token_ids = seq.token_ids
        token_ids.append(token)
        self._generation_tokens += 1
        if seq.grammar is not None and not seq.grammar.consume_token(token):
            logger.warning("request %s: token %d does not fit its grammar: %s", seq.request_id, token,
                           seq.grammar.get_error())
        if seq.logprobs is not None:
            seq.cumulative_logprob += sample.logprob
            seq.logprobs.append(sample.top_logprobs)
        params = seq.params
        num_output_tokens = len(token_ids) - seq.num_prompt_tokens
        check_stop = num_output_tokens >= params.min_tokens
        if check_stop:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None)
            if params.stop_token_ids and token in params.stop_token_ids:
                return self._finish(seq, "stop", token)
        if self.detokenizer_process is not None:  # its stop strings come back a step or two later
            self.detokenizer_process.feed(request.text_keys[seq.index], token)
            request.num_fed[seq.index] += 1
        elif self.tokenizer is not None:
            stop_string = request.detokenizers[seq.index].add_token(token, check_stop)
            if stop_string is not None:
                return self._finish(seq, "stop", stop_string)
        if seq.at_length_limit(self.config.max_model_len):
            return self._finish(seq, "length", None)

    def _read_texts(self, timeout: float) -> set[str]:
        """Applies the detokenizer process's answers: new text, and stop strings, which end their completion at
        the token that completed them (tokens computed after it are dropped)."""
        touched = set()
        for key, new_text, length, stop, num_fed in self.detokenizer_process.answers(timeout):
            located = self._texts.get(key)
            if located is None:  # retired meanwhile (aborted)
                continue
            request, index = located
            text = request.detokenizers[index]
            if new_text:
                text.append(new_text)
            if length < len(text):
                text.cut(length)
            request.num_detokenized[index] = num_fed
            if stop is not None:
                self._stop_late(request, index, stop, num_fed)
            touched.add(request.request_id)
        return touched

    def _stop_late(self, request: Request, index: int, stop: str, num_output_tokens: int) -> None:
        """Ends completion `index` with stop string `stop`, completed by its output token `num_output_tokens`."""
        seq = request.seqs[index]
        if seq.finish_reason == "abort":
            return
        extra = seq.num_output_tokens - num_output_tokens
        if extra > 0:
            if seq.logprobs is not None:
                for token, top in zip(seq.token_ids[-extra:], seq.logprobs[-extra:]):
                    seq.cumulative_logprob -= top[token]
                del seq.logprobs[-extra:]
            del seq.token_ids[-extra:]
            self._generation_tokens -= extra
        request.num_fed[index] = num_output_tokens
        if seq.is_finished:  # by a later token (EOS, length): the stop string came first
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self._finish(seq, "stop", stop)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)

    def _retire(self, request: Request) -> None:
        """Forgets a finished request; its id may be used again."""
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        for key in request.text_keys:
            del self._texts[key]
            self.detokenizer_process.close(key)
        with self._ids_lock:
            self._live_ids.discard(request.request_id)
        reason = request.finish_reason
        self._finished[reason] = self._finished.get(reason, 0) + 1

    def _apply_commands(self) -> set[str]:
        self._new_commands.clear()
        changed = set()
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return changed
            if command == "add":
                self.requests[payload.request_id] = payload
                for index, key in enumerate(payload.text_keys):
                    self._texts[key] = (payload, index)
                    params = payload.params
                    self.detokenizer_process.open(key, payload.prompt_token_ids, params.stop,
                                                  params.skip_special_tokens, params.include_stop_str_in_output,
                                                  params.min_tokens)
                self._prompt_tokens += len(payload.prompt_token_ids)
                for seq in payload.seqs:
                    self.scheduler.add(seq)
            elif command == "abort" and payload in self.requests:
                for seq in self.requests[payload].seqs:
                    if not seq.is_finished:
                        self._finish(seq, "abort", None)
                changed.add(payload)

    def _snapshot(self) -> SchedulerStats:
        manager, spec = self.page_manager, self.runner.spec_counters
        return SchedulerStats(
            num_running_seqs=self.scheduler.num_running, num_waiting_seqs=self.scheduler.num_waiting,
            kv_cache_usage=manager.usage, prefix_cache_queries=manager.num_prefix_queries,
            prefix_cache_hits=manager.num_prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            request_success=tuple(sorted(self._finished.items())), num_steps=self._steps,
            kv_cache_capacity_tokens=self.runner.kv_capacity_tokens, kv_cache_dtype=self.config.kv_cache_dtype,
            kv_cache_storage_dtype=self.runner.kv_storage_dtype, spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens, spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_pos=tuple(spec.accepted_per_pos))


def _enable_compilation_cache(directory: str | None) -> None:
    """Turns on jax's persistent compilation cache, so a second start skips most compiles."""
    if not directory:
        return
    directory = os.path.expanduser(directory)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

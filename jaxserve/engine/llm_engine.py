"""`LLMEngine`: requests in, outputs out. It reads as its loop: commands -> schedule -> dispatch -> collect ->
outputs, over four parts it owns: the input processor (tokenize, validate, build requests: `input_processor.py`),
the scheduler (sequence state, pages through the page manager: `scheduler.py`), the model runner (the device:
`model_runner.py`) and the output processor (text, stop strings, snapshots: `output_processor.py`).

`add_request` and `abort_request` may be called from any thread: they validate at once (raising `ValueError` for
bad input, including a request id already in use) and queue a command that the stepping thread applies at the
start of its next `step()`. A step takes the commands, schedules, dispatches the plan to the device, and while the
device runs it reads the step before it (async scheduling): the scheduler applies its tokens, the output
processor their text, and every request that changed gets a snapshot output. With `async_scheduling=False` a step
reads its own tokens instead. Prompt tokens scored by the prefills (prompt_logprobs) join their request as the
step's tokens are read; a request with max_tokens=0 finishes ("length") once its prompt is computed.
"""

from __future__ import annotations


import logging
import os
import queue
import threading
import time
from typing import Any

import jax

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import make_mesh, replica_devices
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
from jaxserve.engine.input_processor import InputProcessor, PromptType, check_priority
from jaxserve.engine.jax_transfer_connector import attach_connector
from jaxserve.engine.kv_connector import transfer_kind
from jaxserve.engine.kv_events import KVEventLog, KVEventsConfig
from jaxserve.engine.kv_plan import check_plan
from jaxserve.engine.kv_tier_copies import attach_kv_tiers
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.runner_steps import measure_step_costs
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.state_checkpoints import StateCheckpoints
from jaxserve.engine.stats import IterationStats, SchedulerStats, fragmentation, pools_usage
from jaxserve.engine.window_manager import WindowManager
from jaxserve.engine.step_output import InFlightStep
from jaxserve.loading import LoadedModel, load_model, model_config, resolve_model
from jaxserve.lora.cache import AdapterCache
from jaxserve.lora.request import LoRARequest
from jaxserve.multimodal.vision import is_image_model
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode import proposer_config
from jaxserve.structured_output import GrammarCompiler
from jaxserve.structured_output.grammar import token_bitmask

logger = logging.getLogger(__name__)
__all__ = ["LLMEngine", "PromptType"]
PULL_POLL_SECONDS = 0.002  # a stepping thread with only pulls to wait for looks again this often


def check_image_model(target: ModelConfig, config: EngineConfig) -> None:
    """ValueError for what an image model is not served with yet: a speculative method other than n-gram (a draft
    model or head would need the images too)."""
    spec = config.speculative_config
    if is_image_model(target.model_type) and spec is not None and spec.method != "ngram":
        raise ValueError(f"speculative method {spec.method!r} is not supported for the image model "
                         f"{target.model_type!r} (n-gram speculation is)")



def make_publisher(config: KVEventsConfig, page_size: int, data_parallel_rank: int = 0):
    """The publisher `config` names (None for "null"); ValueError when pyzmq or msgspec are missing."""
    if config.publisher == "null":
        return None
    try:
        from jaxserve.engine.kv_event_publisher import ZmqEventPublisher
    except ImportError as error:
        raise ValueError(f"kv_events_config needs pyzmq and msgspec: pip install 'jaxserve[router]' ({error})") \
            from None
    return ZmqEventPublisher(config, page_size, data_parallel_rank)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None, **options: Any):
        config = config or EngineConfig(**options)
        config = config if loaded is not None else config.localized()  # a hub id's snapshot
        _enable_compilation_cache(config.compilation_cache_dir)
        started = time.perf_counter()
        target = loaded.config if loaded is not None else model_config(resolve_model(config.model))
        self.engine_config = config = config.resolve(target.max_position_embeddings)
        check_image_model(target, config)
        # a draft model or EAGLE-3 head is checked against the target before either is loaded
        proposer = proposer_config(config.speculative_config, target, config.max_model_len, config.model)
        self.mesh = make_mesh(config.tensor_parallel_size,
                              replica_devices(config.data_parallel_rank, config.tensor_parallel_size))
        self.model = loaded or load_model(config.model, dtype=config.jax_dtype, tokenizer=config.tokenizer,
                                          generation_config=config.generation_config, mesh=self.mesh,
                                          load_format=config.load_format, quantization=config.quantization,
                                          expert_parallel=config.enable_expert_parallel,
                                          mm_processor_kwargs=config.mm_processor_kwargs)
        self.tokenizer = self.model.tokenizer
        # sampling defaults from the model's generation_config.json (vLLM's --generation-config), for fields a
        # request leaves unset: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
        self.default_sampling_params: dict[str, Any] = dict(self.model.generation_config)
        loaded_config = self.model.config
        self.eos_token_ids = set(loaded_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, loaded_config.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(loaded_config, self.model.params, self.engine_config, self.eos_token_ids, self.mesh,
                                  proposer, vision=self.model.vision)
        self.model.params = None  # the runner holds the device copy
        self.phases = self.runner.phases  # host seconds per step phase, for benchmarks
        runner, plan = self.runner, self.runner.kv_plan
        check_plan(plan, self.engine_config)
        windows = tuple(WindowManager(group.num_pages, plan.page_size, group.spec.window, index)
                        for index, group in enumerate(plan.window_groups, 1))
        states = (StateCheckpoints(plan.state_checkpoints, self.engine_config.state_checkpoint_interval,
                                   plan.page_size) if plan.state_checkpoints else None)
        events = self.engine_config.kv_events
        self.page_manager = PageManager(plan.num_pages, plan.page_size, self.engine_config.enable_prefix_caching,
                                        tiers=attach_kv_tiers(self.engine_config, runner), windows=windows,
                                        states=states, events=KVEventLog() if events is not None else None)
        self.connector = attach_connector(self.engine_config, runner, self.model.name)
        self.kv_events = (make_publisher(events, plan.page_size, self.engine_config.data_parallel_rank)
                          if events is not None else None)
        encoder_cache = (EncoderCacheManager.for_model(self.engine_config.max_num_batched_tokens,
                                                       runner.encoder.vision.processor.max_tokens())
                         if runner.encoder is not None else None)
        self.scheduler = Scheduler(self.engine_config, self.page_manager, frozenset(self.eos_token_ids),
                                   loaded_config.rope_length_rule, encoder_cache=encoder_cache)
        detokenizer_process = self.engine_config.detokenizer_process and self.tokenizer is not None
        self.adapters = (AdapterCache(loaded_config, runner.tp, self.engine_config.max_lora_rank,
                                      self.engine_config.max_cpu_loras or self.engine_config.max_loras)
                         if self.engine_config.enable_lora else None)
        self.inputs = InputProcessor(self.engine_config, self.tokenizer, loaded_config.vocab_size, self.grammars,
                                     detokenizer_process, self.adapters,
                                     self.model.vision.processor if self.model.vision is not None else None)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler.stop,
                                       self.inputs.release, detokenizer_process)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._new_commands = threading.Event()
        self._prompt_tokens = self._steps = self._prompt_tokens_computed = 0
        self._stats = self._snapshot()
        self._iteration = IterationStats()
        self._in_flight: InFlightStep | None = None  # async scheduling: the dispatched step not yet read
        logger.info("model %s loaded in %.1fs", self.model.name, time.perf_counter() - started)
        if self.engine_config.warmup:
            seconds = self.runner.warmup()
            logger.info("warm-up compiled %d prefill and %d decode shapes (and their samplers) in %.1fs",
                        len(self.engine_config.prefill_shapes), len(self.engine_config.decode_batch_buckets), seconds)
            if self.scheduler.slo is not None:
                self.scheduler.slo.costs.seed(*measure_step_costs(self.runner))
                self.scheduler.slo.log_start()

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
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Validates and queues a request (with `lora_request`: run with that adapter); raises ValueError naming the
        problem. Returns the request id."""
        request = self.inputs.make_request(request_id, prompt, params or SamplingParams(), priority, arrival_time,
                                           lora_request)
        kv_transfer_params = (request.params.extra_args or {}).get("kv_transfer_params")
        request.kv_transfer = transfer_kind(kv_transfer_params, self.engine_config.kv_transfer)
        if request.kv_transfer == "pull":
            request.remote_prefill = self.connector.check(request, kv_transfer_params)
        self._commands.put(("add", request))
        self._new_commands.set()
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._new_commands.set()

    def wait_for_requests(self, timeout: float | None = None) -> bool:
        """Blocks an idle stepping thread until a request or abort arrives (or `timeout`); True if work is pending.
        While the only work is pages being pulled, it waits a little before saying so (their arrival is polled)."""
        if self.has_unfinished_requests():
            if self._only_pulling():
                self._new_commands.wait(PULL_POLL_SECONDS)
            return True
        self._new_commands.wait(timeout)
        return self.has_unfinished_requests()

    def _only_pulling(self) -> bool:
        return (self.connector is not None and self.connector.num_pulling > 0 and not self.scheduler.seqs
                and self._in_flight is None and self._commands.empty())

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.inputs.tokenize(prompt)

    def encode_chat(self, text: str) -> list[int]:
        return self.inputs.encode_chat(text)

    def prepare(self, prompt: PromptType) -> dict[str, Any]:
        """`InputProcessor.prepare`: tokenized, images read and processed (any thread)."""
        return self.inputs.prepare(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        self.inputs.validate_prompt(token_ids, params)

    def validate_guided_decoding(self, params: SamplingParams) -> None:
        self.inputs.validate_guided_decoding(params)

    def validate_lora(self, lora_request: LoRARequest | None) -> None:
        """Reads and checks the adapter into the host cache (ValueError naming the problem)."""
        self.inputs.adapter(lora_request)

    def validate_priority(self, priority: int) -> None:
        check_priority(priority, self.engine_config.scheduling_policy)

    # -- the loop (one thread) ---------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests) or not self._commands.empty() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns an output for each request that changed (finished ones are then forgotten).

        Synchronous: schedule, dispatch, wait for its tokens, read them. Async scheduling (the default)
        dispatches the step first and then reads the previous step's tokens, so the device computes step t+1
        while the host reads step t (a sequence that stopped at t computes one extra token, which is discarded)."""
        self.phases.start()
        self.outputs.start_step()
        touched = self._apply_commands()
        if self.connector is not None:
            self._schedule_pulled()
        touched |= self.outputs.read_texts()  # a detokenizer process's texts, and stop strings, of earlier steps
        scheduler_output = self.scheduler.schedule()
        self.phases.lap("schedule")
        launched = self._dispatch(scheduler_output) if not scheduler_output.is_empty else None
        if self.engine_config.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            self._sample_pending(launched)  # synchronous: its constrained rows' masks (async: done before)
            touched |= self._collect(launched)
        if self._in_flight is not None:  # its forward runs meanwhile; its masks need the tokens just read
            self._sample_pending(self._in_flight)
        touched |= self.outputs.end_step(idle=scheduler_output.is_empty and self._in_flight is None)
        if self.runner.transfers is not None:  # the pages registered this step, once its forwards are dispatched
            stored = self.page_manager.tiers.take_pending()
            if stored:
                self.runner.transfers.store(stored)
        if self.page_manager.events is not None:  # the step's prefix-cache changes, for KV-aware routers
            events = self.page_manager.events.take()
            if self.kv_events is not None:
                self.kv_events.publish(events)
        outputs = self.outputs.outputs(touched)
        self._stats = self._snapshot()
        self._iteration = IterationStats(
            tuple(self.outputs.first_token_latencies), tuple(self.outputs.inter_token_latencies),
            self.connector.take_pull_seconds() if self.connector is not None else ())
        self.phases.lap("postprocess")
        return outputs

    def _dispatch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        now = time.monotonic()
        for new in scheduler_output.new_seqs:
            request = self.outputs.requests[new.request_id]
            request.first_scheduled_time = request.first_scheduled_time or now
        step = self.runner.dispatch(scheduler_output)
        seqs = self.scheduler.seqs
        self._prompt_tokens_computed += sum(max(0, min(chunk.start + chunk.num_tokens,
                                                       seqs[chunk.seq_id].num_prompt_tokens) - chunk.start)
                                            for chunk in scheduler_output.prefills)
        if self.connector is not None:  # the prompts to send that this step computes, in its pages
            self.connector.after_dispatch(scheduler_output, seqs, self.outputs.requests, self.page_manager.page_table)
        self._steps += 1
        self.scheduler.update_after_dispatch(scheduler_output)
        return step

    def _schedule_pulled(self) -> None:
        """Hands the scheduler the requests whose pulls ended (with their pages, or to compute their prompts)."""
        for request, received in self.connector.take_pulled():
            for seq in request.seqs:
                self.scheduler.add(seq, received)

    def _collect(self, step: InFlightStep) -> set[str]:
        """Reads a dispatched step's tokens: the scheduler applies them, the output processor their text."""
        sampled, scored = self.runner.collect(step)
        self.outputs.add_prompt_scores(scored, self.scheduler.seqs)
        appended, touched = self.scheduler.update_from_output(sampled)
        self.outputs.process(appended)
        return touched

    def _sample_pending(self, step: InFlightStep) -> None:
        """Runs the samplers `step` left waiting, with their constrained rows' token masks (their grammars have
        consumed every token read so far)."""
        pending = step.pending()
        if pending:
            seqs = self.scheduler.seqs  # a row whose sequence finished meanwhile allows every token
            self.runner.sample_pending(step, [token_bitmask(
                len(sample.slots), self.vocab_size, [(seqs[row.seq_id].grammar, row.row) for row in sample.guided
                                                     if row.seq_id in seqs], self.eos_token_ids)
                for sample in pending])

    def _apply_commands(self) -> set[str]:
        self._new_commands.clear()
        changed = set()
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return changed
            if command == "add":
                self.outputs.add(payload)
                self._prompt_tokens += len(payload.prompt_token_ids)
                if payload.remote_prefill is not None:  # scheduled once its pages are in (`_schedule_pulled`)
                    self.connector.pull(payload, payload.remote_prefill)
                    continue
                for seq in payload.seqs:
                    self.scheduler.add(seq)
            elif command == "abort" and payload in self.outputs.requests:
                if self.connector is not None:
                    self.connector.cancel(payload)
                for seq in self.outputs.requests[payload].seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, "abort")
                changed.add(payload)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix page (vLLM's; KV-aware routers hear `AllBlocksCleared`); False, doing nothing,
        while requests are unfinished."""
        if self.scheduler.seqs:
            return False
        self.page_manager.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Flushes the KV tiers (every page stored so far reaches host memory and the disk tier's files) and stops
        their threads. The engine may not step afterwards."""
        if self.runner.transfers is not None:
            self.runner.transfers.close()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.connector is not None:
            self.connector.close()

    def _snapshot(self) -> SchedulerStats:
        manager, spec, plan = self.page_manager, self.runner.spec_counters, self.runner.kv_plan
        return SchedulerStats(
            num_running_seqs=self.scheduler.num_running, num_waiting_seqs=self.scheduler.num_waiting,
            kv_cache_usage=manager.usage, prefix_cache_queries=manager.num_prefix_queries,
            prefix_cache_hits=manager.num_prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens, prompt_tokens_computed=self._prompt_tokens_computed,
            generation_tokens=self.outputs.num_generation_tokens,
            request_success=tuple(sorted(self.outputs.finished_reasons.items())), num_steps=self._steps,
            kv_cache_capacity_tokens=plan.capacity_tokens, kv_cache_dtype=self.engine_config.kv_cache_dtype,
            kv_cache_storage_dtype=self.runner.kv_storage_dtype, spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens, spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_pos=tuple(spec.accepted_per_pos),
            spec_decode_method=(self.engine_config.speculative_config.method
                                if self.engine_config.speculative_config is not None else ""),
            kv_cache_fragmentation=fragmentation(self.scheduler.running, manager),
            kv_cache_window_capacity_tokens=sum(group.capacity_tokens for group in plan.window_groups),
            kv_cache_window_usage=pools_usage(window.pool for window in manager.windows),
            request_slo=tuple((kind, checked, self.outputs.slo_met[kind])
                              for kind, checked in self.outputs.slo_checked.items()),
            **(manager.tiers.stats(self.runner.transfers) if manager.tiers is not None else {}),
            **(self._lora_stats() if self.adapters is not None else {}),
            **(self.runner.encoder.stats() if self.runner.encoder is not None else {}),
            **(self.connector.stats() if self.connector is not None else {}))

    def _lora_stats(self) -> dict:
        slots = self.scheduler.adapter_slots
        return dict(max_loras=self.engine_config.max_loras, lora_running_adapters=slots.running_adapters(),
                    lora_waiting_adapters=slots.waiting_adapters(), lora_slot_loads=slots.num_loads,
                    lora_adapter_reads=self.adapters.num_reads)


def _enable_compilation_cache(directory: str | None) -> None:
    """Turns on jax's persistent compilation cache, so a second start skips most compiles."""
    if not directory:
        return
    directory = os.path.expanduser(directory)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # jax's own variable, as set: the tests' 0
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

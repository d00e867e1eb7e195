"""`ModelRunner`: the device side of the engine — params, the KV pools of the KV plan (`engine/kv_plan.py`), the
persistent per-slot batch (`InputBatch`: each slot's sequence, sampling parameters, slot state and penalty state),
the jitted steps, and turning a scheduler output (plain data: `engine/scheduler_output.py`) into their inputs.

The narrow interface the host loop uses (after JetStream's engine_api):

* `dispatch(scheduler_output)`: applies one `SchedulerOutput` to the per-slot batch (resetting the penalty state
  of newly admitted slots), copies in the pages it restores from the KV tiers (`transfers`, `engine/kv_tier_copies.py`)
  and those a decode worker pulled (`connector`, `engine/jax_transfer_connector.py`), and launches it without
  waiting — its prefill chunks (one compiled shape per (rows, chunk-length) bucket) and its decode batch (one per
  batch bucket) — returning an `InFlightStep` whose sampled tokens are still on the device.
  Decode rows read their input token from the device's `SlotState`, so the next step may be dispatched before
  this one's tokens reach the host (async scheduling). Under speculative decoding the decode batch is a verify
  call over each row's latest token and its drafts (the runner's `Speculator`, `engine/speculator.py`).
* `sample_pending(step, masks)`: the samplers of calls with constrained rows, which waited for the rows' token
  masks (`step.pending()`; their matchers need the previous step's tokens; the forward runs meanwhile).
* `collect(step)`: the token sampled for every sequence of a dispatched plan that produced one (a verify row's
  accepted drafts too), and the prompt tokens its prefills scored (prompt_logprobs), by sequence id, with one
  device->host transfer for the whole step.

Under tensor parallelism the runner holds the device mesh: params, the page pool and every step's inputs and
outputs are placed by the sharding table (`distributed/shardings.py`) and each jitted step is one SPMD program
over the mesh. The steps are pure functions (`engine/steps.py`): each forward maps (params, KV pools, inputs) ->
(logits, their argmax, new KV pools) with the pools donated, so no step copies them. A plain batch (greedy, no
penalties, pending min_tokens, logprobs or grammar) takes the argmax; any other runs the sampler, a second
jitted function with the penalty state donated. A prefill also returns its last layer's output, which a small
step scores for prompt_logprobs (`PromptScores`). Each jitted call is one `Step` record in the runner's `steps`
registry (`engine/step_registry.py`), with examples of every shape it can have, all compiled at start-up.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import REPLICATED
from jaxserve.models import param_shardings, serving_shardings
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.engine import runner_steps
from jaxserve.engine.allocator import Allocator, DeviceAllocator
from jaxserve.engine.buckets import bucket_for
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.input_batch import InputBatch
from jaxserve.engine.kv_budget import kv_budget_bytes, page_bytes, transfer_reserve
from jaxserve.engine.kv_plan import (empty_kv_cache, group_layers, kv_cache_shardings, layer_specs, log_kv_plan,
                                     plan_kv_cache)
from jaxserve.engine.kv_tiers import KVTiers
from jaxserve.engine.kv_tier_copies import TierCopies, transfer_buckets
from jaxserve.engine.prompt_logprobs import ScoredPrompt, scored_prompt
from jaxserve.engine.scheduler_output import NewSequence, SchedulerOutput
from jaxserve.engine.speculator import Speculator
from jaxserve.engine.stats import SpecDecodeCounters, StepPhases
from jaxserve.engine.step_inputs import DecodeInputs, PrefillInputs, decode_inputs, prefill_groups, \
    prefill_inputs
from jaxserve.engine.step_output import InFlightStep, PendingSample, RowSequence, SampledToken, sampled_token
from jaxserve.engine.encoder import Encoder
from jaxserve.engine.step_registry import Step, StepRegistry, assign, jit_step
from jaxserve.engine.steps import BanInputs, ResetInputs, SamplerInputs, ScoreInputs, SlotState
from jaxserve.layers.attention import make_attention_backend
from jaxserve.layers.prompt_logprobs import PromptScores
from jaxserve.layers.sampler import PenaltyState, SampleResult
from jaxserve.loading.placement import serving_params
from jaxserve.lora.weights import SlotWeights, empty_adapter, empty_stack, load_slot_step, stack_shapes
from jaxserve.multimodal.vision import VisionModel
from jaxserve.spec_decode.head_steps import Head
from jaxserve.structured_output.grammar import bitmask_words


class ModelRunner:
    """`params` is the checkpoint-layout tree (numpy or jax arrays, placed anywhere); the runner consumes it group
    by group into the serving layout on `mesh` (default: one device), so the device never holds both copies."""

    def __init__(self, config: ModelConfig, params: dict, engine_config: EngineConfig, eos_token_ids: set[int],
                 mesh: Mesh | None = None, proposer_config: ModelConfig | Head | None = None,
                 allocator: Allocator | None = None, vision: VisionModel | None = None):
        self.model_config = config
        self.allocator = allocator or DeviceAllocator()  # `jaxserve compile`'s makes abstract arrays
        self.engine_config = engine_config
        self.eos_token_ids = eos_token_ids
        self.dtype = engine_config.jax_dtype
        self.mesh = mesh if mesh is not None else make_mesh(engine_config.tensor_parallel_size)
        self.tp = TensorParallel(self.mesh.size, engine_config.enable_expert_parallel)
        self.tp.check(config)
        self.backend = make_attention_backend(engine_config.attention_backend, self.mesh, engine_config.kv_cache_dtype)
        self.page_size = engine_config.page_size
        self.backend.check_page_size(self.page_size, self.dtype)
        self.params = serving_params(params, config, self.tp, self.mesh, self.dtype, engine_config.quantization)
        self.lora_stack = None  # LoRA: the adapters' device stack (`lora/weights.py`), read by every forward
        if engine_config.enable_lora:
            shapes = stack_shapes(config, self.tp, engine_config.max_loras, engine_config.max_lora_rank, self.dtype)
            self.lora_stack = empty_stack(shapes, param_shardings({"lora": shapes}, config, self.tp,
                                                                  self.mesh)["lora"], self.allocator.full)
        replicated = NamedSharding(self.mesh, REPLICATED)
        vocab = config.vocab_size
        num_groups = len(group_layers(layer_specs(config), engine_config))  # the KV cache groups (`kv_plan`)
        self.batch = InputBatch(engine_config, vocab, replicated, self.allocator, num_groups,
                                mrope=config.mrope_section is not None)
        # an image + text model's vision side (None: text only)
        self.encoder = None if vision is None else Encoder(vision, self.mesh, config.hidden_size, self.dtype,
                                                           engine_config.max_num_batched_tokens,
                                                           config.deepstack_layers, config.bidirectional_images)
        spec = engine_config.speculative_config
        self.speculator = Speculator(self, spec, proposer_config) if spec is not None else None
        self.aux_layers = self.speculator.aux_layers if self.speculator is not None else ()
        self.spec_counters = self.speculator.counters if self.speculator is not None else SpecDecodeCounters(0)
        self.batch.sampling_table = self.allocator.put(self.batch.sampling.table(), replicated)
        # the constrained-decoding mask of a sampler call without constrained rows: all ones, kept on the device
        self.all_allowed = {rows: self.allocator.full((rows, bitmask_words(vocab)), jnp.int32, replicated, -1)
                            for rows in runner_steps.sampler_rows(engine_config)}
        self.kv_cache = None  # the page pools, sized by what the rest leaves
        budget = None  # the KV pools' bytes per device, decided with everything else in place
        if not engine_config.num_kv_pages:
            device = self.mesh.local_devices[0]
            budget = kv_budget_bytes(self.allocator.memory_stats(device, self.resident_state()), device.platform,
                                     config, engine_config,
                                     self.encoder.activation_bytes() if self.encoder is not None else 0,
                                     transfer_reserve(engine_config, self._largest_transfer_bytes()))
        speculator = self.speculator  # a proposer's own pool has group 0's pages
        self.kv_plan = plan_kv_cache(config, engine_config, self.tp, self.backend, self.dtype, budget,
                                     speculator.pool_page_bytes if speculator is not None else 0)
        if speculator is not None:
            speculator.allocate_pool(self.kv_plan.num_pages)
        self.kv_cache = empty_kv_cache(self.kv_plan.layer_pages, config, self.tp, self.backend, self.page_size,
                                       self.dtype, self.allocator, self.kv_plan.state_slots,
                                       self.kv_plan.state_checkpoints)
        self.batch.state_checkpoints = self.kv_plan.state_checkpoints > 0
        self.steps = StepRegistry()
        speculator_steps = self.speculator.steps() if self.speculator is not None else []
        encoder_steps = self.encoder.steps() if self.encoder is not None else []
        self.steps.add(runner_steps.runner_steps(self) + speculator_steps + encoder_steps)
        if self.lora_stack is not None:
            self.steps.add([self._lora_step()])
        self.transfers: TierCopies | None = None  # the KV tiers' copies (`attach_tiers`)
        self.connector = None  # prefill/decode disaggregation's pages in and out (`attach_connector`)
        self.phases = StepPhases()  # the engine's: dispatch() charges prepare and dispatch, collect() wait
        log_kv_plan(self.kv_plan, config, engine_config.kv_cache_dtype, self.kv_storage_dtype, self.backend,
                    self.tp.size)

    def resident_state(self) -> tuple:
        """Every array the runner keeps on its devices between steps (the KV pools once they exist)."""
        return (self.params, self.lora_stack, self.kv_cache, self.batch.slot_state,
                self.batch.penalties, self.batch.sampling_table, self.all_allowed,
                self.speculator.resident_state() if self.speculator is not None else None,
                self.encoder.vision.params if self.encoder is not None else None)

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Copies pages between the pool and the KV tiers from now on (before warm-up: its steps compile there)."""
        self.transfers = TierCopies(self, tiers)
        self.steps.add(self.transfers.steps())

    def _largest_transfer_bytes(self) -> int:
        """Per device, the pages a prefill/decode transfer of a longest prompt moves (padded to its bucket)."""
        ec = self.engine_config
        pages = bucket_for(ec.pages_per_seq, transfer_buckets(ec))
        return pages * page_bytes(self.model_config, self.tp, self.backend, ec.page_size, self.dtype) // self.tp.size

    def attach_connector(self, connector) -> None:
        """Sends and receives pages of prefill/decode disaggregation from now on (`jax_transfer_connector.py`;
        before warm-up: its steps compile there)."""
        self.connector = connector
        self.steps.add(connector.steps())

    def jit_forward(self, step_fn: Callable, **options) -> Callable:
        """A forward step of the target jitted over the mesh: params and pool sharded, pool and slot state donated."""
        kv_in = kv_cache_shardings(self.backend, self.model_config, self.kv_plan.state_checkpoints > 0)
        replicated = NamedSharding(self.mesh, REPLICATED)
        params_in = serving_shardings(self.forward_params, self.model_config, self.tp, self.mesh)
        static = (self.model_config, self.tp, self.backend, self.dtype, self.page_size)
        if len(self.kv_plan.groups) > 1:
            options["layer_groups"] = self.kv_plan.layer_groups
        return jit_step(functools.partial(step_fn, *static, **options), self.mesh, (params_in, kv_in, replicated),
                        (kv_in, replicated), donate=(1, 2))

    # -- the state the steps read and write --------------------------------------------------------------------

    @property
    def forward_params(self) -> dict:
        """What the forwards read as params: the model's, and under LoRA the adapter stack as `"lora"`."""
        return self.params if self.lora_stack is None else {**self.params, "lora": self.lora_stack}

    def forward_state(self) -> tuple:
        return self.forward_params, self.kv_cache, self.batch.slot_state

    def _lora_step(self) -> Step:
        """Writing one adapter into one slot of the stack (donated); warm-up writes zeros into slot 0."""
        shardings = param_shardings({"lora": self.lora_stack}, self.model_config, self.tp, self.mesh)["lora"]
        return Step("lora", jit_step(load_slot_step, self.mesh, (shardings,), (shardings,), donate=(0,)),
                    lambda: (self.lora_stack,), assign(self, "lora_stack"),
                    lambda: [SlotWeights(np.int32(0), empty_adapter(self.lora_stack))])

    def keep_forward_state(self, kv_cache, slot_state: SlotState) -> None:
        self.kv_cache, self.batch.slot_state = kv_cache, slot_state

    def sampler_state(self) -> tuple:
        return self.batch.penalties, self.batch.slot_state, self.batch.sampling_table

    def keep_sampler_state(self, penalties: PenaltyState, slot_state: SlotState) -> None:
        self.batch.penalties, self.batch.slot_state = penalties, slot_state

    def warmup(self) -> float:
        """Compiles and runs every shape of every step once; returns its seconds."""
        return self.steps.warmup()

    @property
    def kv_storage_dtype(self) -> str:
        """The dtype the K/V pages hold ("float32", "bfloat16", "int8", "float8_e4m3fn")."""
        return jnp.dtype(self.backend.storage_dtype(self.dtype)).name

    # -- the step interface ------------------------------------------------------------------------------------

    def dispatch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        """Launches one step; its sampled tokens stay on the device (and in each slot's state) until `collect`."""
        phases, batch = self.phases, self.batch
        batch.apply(scheduler_output)
        for slot, adapter in scheduler_output.lora_loads:
            self.steps.run("lora", SlotWeights(np.int32(slot), adapter.serving))
        if scheduler_output.restores:
            self.transfers.restore(list(scheduler_output.restores))
        if scheduler_output.receives:
            self.connector.receive(scheduler_output.receives)
        for new in scheduler_output.new_seqs:
            self._reset_penalties(new)
        by_sequence = (self.model_config.rope_length_rule or ("",))[0] == "sequence"
        calls = [prefill_inputs(batch, tokens, chunks, by_sequence)
                 for tokens, chunks in prefill_groups(scheduler_output.prefills, self.engine_config)]
        if self.encoder is not None:
            self.encoder.prepare(calls, batch, self.steps, scheduler_output.encoder_frees)
        decodes = scheduler_output.decodes
        verify = (self.speculator.verify_inputs(decodes)
                  if self.speculator is not None and any(decode.num_draft for decode in decodes) else None)
        decode = decode_inputs(batch, decodes, self.engine_config) if decodes and verify is None else None
        phases.lap("prepare")
        step = InFlightStep([])
        for inputs in calls:
            result, scores = self.prefill(inputs)
            step.calls.append((inputs.sampled, result))
            if scores is not None:
                step.scores.append((inputs.scored, inputs.batch.starts, scores))
        if decode is not None:
            step.calls.append((decode.rows, self.decode(decode)))
        if verify is not None:
            step.calls.append((verify.rows, self.speculator.verify(verify)))
            step.num_draft = verify.batch.num_draft
        phases.lap("dispatch")
        return step

    def collect(self, step: InFlightStep) -> tuple[list[SampledToken], list[ScoredPrompt]]:
        """Waits for a dispatched plan's tokens and prompt scores (one transfer for the whole step)."""
        results, scores = jax.device_get(([result for _, result in step.calls], [s for _, _, s in step.scores]))
        self.phases.lap("wait")
        scored = [scored_prompt(seq_id, k, tokens, int(starts[row]), call_scores, row)
                  for (rows, starts, _), call_scores in zip(step.scores, scores) for row, seq_id, k, tokens in rows]
        sampled = []
        for (rows, _), result in zip(step.calls, results):
            if result.num_accepted is not None:
                sampled += self.speculator.verified(rows, result, step.num_draft)
                continue
            tokens = result.tokens.tolist()
            sampled += [SampledToken(row.seq_id, tokens[row.row]) if row.num_logprobs is None
                        else sampled_token(row, result, row.row) for row in rows]
        return sampled, scored

    def _reset_penalties(self, new: NewSequence) -> None:
        """Writes a newly admitted (or re-admitted) sequence's penalty statistics."""
        params = new.params
        if not (params.uses_penalties or params.min_tokens):
            return  # the sampler reads a slot's statistics only for these
        length = len(new.token_ids)
        ids = np.zeros(bucket_for(length, runner_steps.reset_buckets(self.engine_config)), np.int32)
        ids[:length] = new.token_ids
        self.steps.run("reset", ResetInputs(np.int32(new.slot), ids, np.int32(new.num_prompt_tokens), np.int32(length)))
        bans = ([] if params.ignore_eos else sorted(self.eos_token_ids)) + params.stop_token_ids
        size = runner_steps.BAN_IDS_CHUNK
        for start in range(0, len(bans) if params.min_tokens else 0, size):
            chunk = np.full(size, -1, np.int32)
            chunk[:len(bans[start:start + size])] = bans[start:start + size]
            self.steps.run("ban", BanInputs(np.int32(new.slot), chunk))

    def prefill(self, inputs: PrefillInputs) -> tuple[SampleResult | PendingSample, PromptScores | None]:
        """One prefill call (K/V written to the pool, and to a draft model's); the sampled token of each row, and
        the prompt scores of a call with scored rows (else None), still on the device."""
        batch = inputs.batch
        forward = self.steps.run("prefill", batch, keep=("logits",) if inputs.guided else ())  # for sample_pending
        if self.speculator is not None:
            self.speculator.mirror_prefill(batch, forward)
        scores = None
        if inputs.scored:
            scores = self.steps.run("score", ScoreInputs(forward.hidden, batch.token_ids, batch.num_tokens,
                                                         batch.next_tokens))
        return self._choose_tokens(forward, batch.slots, inputs.output_index, batch.is_final, len(inputs.chunks),
                                   inputs.guided), scores

    def decode(self, inputs: DecodeInputs) -> SampleResult:
        """One decode step (K/V written to the pool); the sampled token of each row, still on the device."""
        batch = inputs.batch
        forward = self.steps.run("decode", batch, keep=("logits",) if inputs.guided else ())
        if self.speculator is not None:
            self.speculator.after_decode(batch, forward)
        return self._choose_tokens(forward, batch.slots, inputs.output_index, batch.active, len(inputs.rows),
                                   inputs.guided)

    def send_sampling_table(self) -> None:
        """Admissions since the last sampler call changed slots' parameters: one copy of every slot's columns."""
        if self.batch.sampling.changed:
            self.steps.run("table", self.batch.sampling.table())

    def _choose_tokens(self, forward, slots, output_index, counted, rows: int,
                       guided: list[RowSequence]) -> SampleResult | PendingSample:
        """The argmax for a plain greedy batch; otherwise the sampler, which also counts each row's token. A batch
        with constrained rows waits for their masks (`sample_pending`)."""
        if guided:
            return PendingSample(forward.logits, slots, output_index, counted, guided)
        if self.batch.sampling.is_plain_greedy(slots, output_index, rows):
            return SampleResult(tokens=forward.greedy, logprobs=None, top_ids=None, top_logprobs=None)
        return self._run_sampler(SamplerInputs(forward.logits, slots, output_index, counted,
                                               self.all_allowed[len(slots)]))

    def _run_sampler(self, inputs: SamplerInputs) -> SampleResult:
        self.send_sampling_table()
        return self.steps.run("sample", inputs)

    def sample_pending(self, step: InFlightStep, masks: list[np.ndarray]) -> None:
        """Runs the samplers a dispatched step left waiting (`step.pending()`, in order), each with its token mask
        (int32 [rows, words]: `structured_output.grammar.token_bitmask`)."""
        masks = iter(masks)
        for index, (rows, pending) in enumerate(step.calls):
            if isinstance(pending, PendingSample):
                step.calls[index] = (rows, self._run_sampler(SamplerInputs(
                    pending.logits, pending.slots, pending.output_index, pending.counted, next(masks))))

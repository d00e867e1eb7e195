"""`ModelRunner`: the device side of the engine — params, the paged KV pool, the penalty state, the jitted steps,
and turning a scheduler plan into their inputs.

The narrow interface the host loop uses (after JetStream's engine_api):

* `dispatch(plan)`: launches one scheduler plan without waiting for it — resets the penalty state of newly
  admitted slots, runs its prefill chunks (one compiled shape per (rows, chunk-length) bucket) and its decode
  batch (one per batch bucket) — and returns an `InFlightStep` whose sampled tokens are still on the device.
  Decode rows read their input token from the device's `SlotState`, so the next plan may be dispatched
  before this one's tokens reach the host (async scheduling).
  Under speculative decoding the decode batch is a verify call over each row's latest token and its drafts
  (`spec_decode/runner_steps.py`).
* `sample_pending(step)`: the samplers of calls with constrained rows, which waited for the rows' token masks
  (their matchers need the previous step's tokens; the forward runs meanwhile).
* `collect(step)`: the token sampled for every sequence of a dispatched plan that produced one (a verify row's
  accepted drafts too), and the prompt tokens its prefills scored (prompt_logprobs), with one device->host
  transfer for the whole step.

Under tensor parallelism the runner holds the device mesh: params, the page pool and every step's inputs and
outputs are placed by the sharding table (`distributed/shardings.py`) and each jitted step is one SPMD program
over the mesh. The steps are pure functions (`engine/steps.py`): each forward maps (params, KV pool, inputs) ->
(logits, their argmax, new KV pool) with the pool donated, so no step copies it. A batch the host knows is
plain (greedy, no penalties, no pending min_tokens, no logprobs, no grammar) takes the argmax; any other runs the
sampler, a second small jitted function (penalty state, logits, sampling parameters, token bitmask) -> (tokens,
new penalty state) with the penalty state donated. One forward per shape serves both, so start-up compiles each
forward once, and every shape a step can have is compiled at start-up (`warmup`, `engine/startup.py`). A prefill
also returns its last layer's output; after a call holding a chunk that scores its prompt tokens
(prompt_logprobs), a small jitted step runs the LM head over it and scores every position (`PromptScores`); other
calls skip it.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import REPLICATED, param_shardings
from jaxserve.loading.placement import serving_params
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_budget import kv_pages
from jaxserve.engine.prompt_logprobs import ScoredPrompt
from jaxserve.engine.input_batch import (DecodeInputs, PrefillInputs, bucket_for, decode_inputs, prefill_groups,
                                         prefill_inputs)
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.slot_params import SlotSamplingParams
from jaxserve.engine.stats import SpecDecodeCounters, StepPhases
from jaxserve.engine.step_output import InFlightStep, PendingSample, SampledToken, sampled_token
from jaxserve.engine.steps import (SlotState, ban_step, decode_step, prefill_step, prompt_scores_step,
                                   reset_penalties_step, sample_step, verify_sample_step, verify_step)
from jaxserve.layers.attention import AttentionBackend
from jaxserve.layers.prompt_logprobs import PromptScores
from jaxserve.layers.sampler import PenaltyState, SampleResult
from jaxserve.spec_decode.draft import DraftModel
from jaxserve.engine.startup import BAN_IDS_CHUNK, StartupSteps, shape_key
from jaxserve.spec_decode.runner_steps import SpeculativeSteps
from jaxserve.structured_output.grammar import bitmask_words, fill_bitmask

logger = logging.getLogger(__name__)


class ModelRunner(SpeculativeSteps, StartupSteps):
    """`params` is the checkpoint-layout tree (numpy or jax arrays, placed anywhere); the runner consumes it group
    by group into the serving layout on `mesh` (default: one device), so the device never holds both copies."""

    def __init__(self, config: ModelConfig, params: dict, engine_config: EngineConfig, eos_token_ids: set[int],
                 mesh: Mesh | None = None, draft_config: ModelConfig | None = None):
        self.config = config
        self.engine_config = engine_config
        self.eos_token_ids = eos_token_ids
        self.dtype = engine_config.jax_dtype
        self.mesh = mesh if mesh is not None else make_mesh(engine_config.tensor_parallel_size)
        self.tp = TensorParallel(self.mesh.size)
        self.tp.check(config)
        self.backend = AttentionBackend(engine_config.attention_backend, self.mesh, engine_config.kv_cache_dtype)
        self.page_size = engine_config.page_size
        self.params = serving_params(params, config, self.tp, self.mesh, self.dtype, engine_config.quantization)
        replicated = NamedSharding(self.mesh, REPLICATED)
        slots, vocab = engine_config.max_num_seqs, config.vocab_size
        self.penalties = PenaltyState(prompt_mask=jnp.zeros((slots, vocab), bool, device=replicated),
                                      output_counts=jnp.zeros((slots, vocab), jnp.int32, device=replicated),
                                      min_tokens_ban=jnp.zeros((slots, vocab), bool, device=replicated))
        self.slot_params = SlotSamplingParams(slots)
        self.slot_state = SlotState.empty(slots, engine_config.pages_per_seq, replicated)
        spec = engine_config.speculative_config
        self.ngram = spec if spec is not None and spec.method == "ngram" else None
        self.draft = (DraftModel(spec, draft_config, self.dtype, self.mesh, self.backend,
                                 self.page_size, slots, engine_config.pages_per_seq)
                      if spec is not None and spec.method == "draft_model" else None)
        self.spec_counters = SpecDecodeCounters(engine_config.num_speculative_tokens)
        self.num_pages = engine_config.num_kv_pages or kv_pages(self.mesh.local_devices[0], config, engine_config,
                                                                 self.page_bytes, self.device_page_bytes)
        if self.draft is not None:
            self.draft.allocate_pool(self.num_pages)
        pool_shape = self.backend.pool_shape(self.num_pages, self.page_size, self.tp.pool_heads(config),
                                             config.head_dim)
        # one (K, V) pair per layer: arrays, or QuantizedPages (values + per-token scales) for an int8/fp8 cache
        self.kv_cache = [tuple(self.backend.empty_pool(pool_shape, self.dtype) for _ in "kv")
                         for _ in range(config.num_layers)]
        pool = self.backend.pool_shardings()
        params_in, kv_in = param_shardings(self.params, config, self.tp, self.mesh), [(pool, pool)] * config.num_layers
        forward_shardings = dict(in_shardings=(params_in, kv_in, replicated) + (replicated,) * 4,
                                 out_shardings=(replicated, replicated, kv_in, replicated), donate_argnums=(1, 2))
        prefill_shardings = dict(forward_shardings, in_shardings=forward_shardings["in_shardings"] + (replicated,) * 3,
                                 out_shardings=forward_shardings["out_shardings"] + (replicated,))
        static = (config, self.tp, self.backend, self.dtype, self.page_size)
        self._prefill = jax.jit(functools.partial(prefill_step, *static, with_hidden=True), **prefill_shardings)
        self._score = jax.jit(functools.partial(prompt_scores_step, config, self.tp, self.dtype),
                              in_shardings=(params_in,) + (replicated,) * 4, out_shardings=replicated)
        self._decode = jax.jit(functools.partial(decode_step, *static), **forward_shardings)
        self._verify = jax.jit(functools.partial(verify_step, *static), **dict(
            forward_shardings, in_shardings=forward_shardings["in_shardings"] + (replicated,) * 2))
        self._verify_sample = jax.jit(verify_sample_step, in_shardings=replicated, out_shardings=replicated,
                                      donate_argnums=(0, 1))
        on_every_device = dict(in_shardings=replicated, out_shardings=replicated, donate_argnums=(0,))
        self._sample = jax.jit(sample_step, in_shardings=replicated, out_shardings=replicated, donate_argnums=(0, 1))
        self._send_table = jax.jit(lambda table: table, out_shardings=replicated)  # host columns -> device copy
        self._reset_penalties = jax.jit(functools.partial(reset_penalties_step, vocab), **on_every_device)
        self._ban = jax.jit(functools.partial(ban_step, vocab), **on_every_device)
        self.sampling_table = self._send_table(self.slot_params.table())  # every slot's sampling parameters
        # the constrained-decoding mask of a sampler call without constrained rows: all ones, kept on the device
        self._all_allowed = {rows: jnp.full((rows, bitmask_words(vocab)), -1, jnp.int32, device=replicated)
                             for rows in self.sampler_rows}
        self._jitted = {"prefill": self._prefill, "score": self._score, "decode": self._decode,
                        "sample": self._sample,
                        "reset": self._reset_penalties, "ban": self._ban, "table": self._send_table,
                        "verify": self._verify, "verify_sample": self._verify_sample}
        if self.draft is not None:
            self._jitted |= {"draft_prefill": self.draft.prefill_fn, "propose": self.draft.propose_fns[False],
                             "propose_probs": self.draft.propose_fns[True]}
        self._follower_logits = None  # a multi-host follower's latest forward logits (see `replay`)
        self._follower_hidden = None  # and its latest prefill's last-layer output
        self._warm = False  # after warm-up, a jitted step's cache growing means a compile while serving
        self._cache_sizes: dict[str, int] = {}
        # multi-host leader: told every call (kind, inputs) before it runs, so the followers run it too
        self.on_call: Callable[[str, tuple], None] | None = None
        self.phases = StepPhases()  # the engine's: dispatch() charges prepare and dispatch, collect() wait
        logger.info("KV pool: %d pages x %d tokens (%d usable tokens), %.1f MiB (kv_cache_dtype %s: %s pages%s, %s "
                    "attention, per layer %s, split over %d devices)", self.num_pages, self.page_size,
                    self.kv_capacity_tokens, self.kv_pool_bytes / 2**20, engine_config.kv_cache_dtype,
                    self.kv_storage_dtype, " + float32 per-token scales" if self.backend.quantized else "",
                    self.backend.name, pool_shape, self.tp.size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers and all devices (K and V; a quantized cache's scales included; a draft
        model's page too)."""
        cfg = self.config
        draft = self.draft.page_bytes if self.draft is not None else 0  # the draft's pool has as many pages
        return (2 * cfg.num_layers * self.page_size * self.tp.pool_heads(cfg)
                * self.backend.token_bytes(cfg.head_dim, self.dtype)) + draft

    @property
    def kv_storage_dtype(self) -> str:
        """The dtype the K/V pages hold ("float32", "bfloat16", "int8", "float8_e4m3fn")."""
        return jnp.dtype(self.backend.storage_dtype(self.dtype)).name

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the pool can hold for sequences (page 0 is the scratch page)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def device_page_bytes(self) -> int:
        """Bytes of one page held by each device: its heads' share."""
        return self.page_bytes // self.tp.size

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    # -- the step interface ------------------------------------------------------------------------------------

    def dispatch(self, plan: SchedulerOutput) -> InFlightStep:
        """Launches one plan; its sampled tokens stay on the device (and in each slot's state) until `collect`."""
        phases = self.phases
        for seq in plan.admitted:
            self._admit(seq)
        calls = [prefill_inputs(tokens, chunks, self.engine_config.pages_per_seq)
                 for tokens, chunks in prefill_groups(plan.prefills, self.engine_config)]
        verify = self._verify_inputs(plan.decodes) if plan.decodes else None
        decode = decode_inputs(plan.decodes, self.engine_config) if plan.decodes and verify is None else None
        phases.lap("prepare")
        step = InFlightStep([])
        for inputs in calls:
            result, scores = self.prefill(inputs)
            step.calls.append(([(row, chunk.seq) for row, chunk in enumerate(inputs.chunks) if chunk.is_final], result))
            if scores is not None:
                step.scores.append((inputs.scored, inputs.starts, scores))
        if decode is not None:
            step.calls.append((list(enumerate(decode.seqs)), self.decode(decode)))
        if verify is not None:
            step.calls.append((list(enumerate(verify.seqs)), self.verify(verify)))
            step.num_draft = verify.num_draft
        phases.lap("dispatch")
        return step

    def collect(self, step: InFlightStep) -> tuple[list[SampledToken], list[ScoredPrompt]]:
        """Waits for a dispatched plan's tokens and prompt scores (one transfer for the whole step)."""
        results, scores = jax.device_get(([result for _, result in step.calls], [s for _, _, s in step.scores]))
        self.phases.lap("wait")
        scored = [_scored(seq, tokens, int(starts[row]), call_scores, row)
                  for (rows, starts, _), call_scores in zip(step.scores, scores) for row, seq, tokens in rows]
        sampled = []
        for (rows, _), result in zip(step.calls, results):
            if result.num_accepted is not None:
                sampled += self._verified(rows, result, step.num_draft)
                continue
            tokens = result.tokens.tolist()
            sampled += [SampledToken(seq, tokens[row]) if seq.params.logprobs is None else sampled_token(seq, result, row)
                        for row, seq in rows]
        return sampled, scored

    def _admit(self, seq: Sequence) -> None:
        """Writes a newly admitted (or re-admitted) sequence's sampling parameters and penalty statistics."""
        params = seq.params
        self.slot_params.set(seq.slot, params, seq.seed)
        if not (params.uses_penalties or params.min_tokens):
            return  # the sampler reads a slot's statistics only for these
        ids = np.zeros(bucket_for(len(seq.token_ids), self.reset_buckets), np.int32)
        ids[:len(seq.token_ids)] = seq.token_ids
        self.penalties = self._call("reset", self._reset_penalties, (self.penalties,), (
            np.int32(seq.slot), ids, np.int32(seq.num_prompt_tokens), np.int32(len(seq.token_ids))))
        bans = ([] if params.ignore_eos else sorted(self.eos_token_ids)) + params.stop_token_ids
        for start in range(0, len(bans) if params.min_tokens else 0, BAN_IDS_CHUNK):
            chunk = np.full(BAN_IDS_CHUNK, -1, np.int32)
            chunk[:len(bans[start:start + BAN_IDS_CHUNK])] = bans[start:start + BAN_IDS_CHUNK]
            self.penalties = self._call("ban", self._ban, (self.penalties,), (np.int32(seq.slot), chunk))

    def prefill(self, inputs: PrefillInputs) -> tuple[SampleResult | PendingSample, PromptScores | None]:
        """One prefill call (K/V written to the pool, and to a draft model's); the sampled token of each row, and
        the prompt scores of a call with scored rows (else None), still on the device."""
        arrays = (inputs.token_ids, inputs.starts, inputs.num_tokens, inputs.page_tables, inputs.slots,
                  inputs.is_final, inputs.next_tokens)
        if self.draft is not None:
            _, _, self.draft.kv_cache, self.draft.slot_state = self._call(
                "draft_prefill", self.draft.prefill_fn, self._state("draft_prefill"), arrays)
        logits, greedy, self.kv_cache, self.slot_state, hidden = self._call(
            "prefill", self._prefill, (self.params, self.kv_cache, self.slot_state), arrays)
        scores = None
        if inputs.scored:
            scores = self._call("score", self._score, (self.params,),
                                (hidden, inputs.token_ids, inputs.num_tokens, inputs.next_tokens))
        guided = [(row, chunk.seq) for row, chunk in enumerate(inputs.chunks)
                  if chunk.is_final and chunk.seq.grammar is not None]
        return self._choose_tokens(logits, greedy, inputs.slots, inputs.output_index, inputs.is_final,
                                   len(inputs.chunks), guided), scores

    def decode(self, inputs: DecodeInputs) -> SampleResult:
        """One decode step (K/V written to the pool); the sampled token of each row, still on the device."""
        logits, greedy, self.kv_cache, self.slot_state = self._call(
            "decode", self._decode, (self.params, self.kv_cache, self.slot_state),
            (inputs.slots, inputs.positions, inputs.pages, inputs.active))
        guided = [(row, seq) for row, seq in enumerate(inputs.seqs) if seq.grammar is not None]
        return self._choose_tokens(logits, greedy, inputs.slots, inputs.output_index, inputs.active, len(inputs.seqs),
                                   guided)

    def _send_sampling_table(self) -> None:
        """Admissions since the last sampler call changed slots' parameters: one copy of every slot's columns."""
        if self.slot_params.changed:
            self.sampling_table = self._call("table", self._send_table, (), (self.slot_params.table(),))

    def _choose_tokens(self, logits, greedy, slots, output_index, counted, rows: int,
                       guided: list[tuple[int, Sequence]]) -> SampleResult | PendingSample:
        """The argmax for a plain greedy batch; otherwise the sampler, which also counts each row's token. A batch
        with constrained rows waits for their masks (`sample_pending`)."""
        if guided:
            return PendingSample(logits, slots, output_index, counted, guided)
        if self.slot_params.is_plain_greedy(slots, output_index, rows):
            return SampleResult(tokens=greedy, logprobs=None, top_ids=None, top_logprobs=None)
        return self._run_sampler(logits, slots, output_index, counted, self._all_allowed[len(slots)])

    def _run_sampler(self, logits, slots, output_index, counted, bitmask) -> SampleResult:
        self._send_sampling_table()
        result, self.penalties, self.slot_state = self._call(
            "sample", self._sample, (self.penalties, self.slot_state, self.sampling_table),
            (logits, slots, output_index, counted, bitmask))
        return result

    def sample_pending(self, step: InFlightStep) -> None:
        """Runs the samplers a dispatched step left waiting, with the token masks of its constrained rows (their
        matchers must have consumed every token before this step's: call after reading the previous step)."""
        for index, (rows, pending) in enumerate(step.calls):
            if not isinstance(pending, PendingSample):
                continue
            bitmask = np.full((len(pending.slots), bitmask_words(self.config.vocab_size)), -1, np.int32)
            fill_bitmask(bitmask, [(seq.grammar, row) for row, seq in pending.guided])
            words = bitmask.view(np.uint32)
            for row, seq in pending.guided:  # an EOS id that is also a text token ends nothing unfinished
                if not seq.grammar.is_accepting():
                    for eos in self.eos_token_ids:
                        words[row, eos // 32] &= ~np.uint32(1 << (eos % 32))
            device_mask = jax.device_put(bitmask, self._all_allowed[len(pending.slots)].sharding)
            step.calls[index] = (rows, self._run_sampler(pending.logits, pending.slots, pending.output_index,
                                                         pending.counted, device_mask))

    def _call(self, kind: str, jitted, state: tuple, inputs: tuple):
        """Runs a jitted step through jax's C++ dispatch path, which after warm-up finds every shape compiled (a
        miss is logged: it would compile while serving)."""
        if self.on_call is not None:  # a forward's outputs are not sent: followers hold their own (`replay`)
            self.on_call(kind, (None, *inputs[1:]) if kind in ("sample", "score") else inputs)
        outputs = jitted(*state, *inputs)
        if self._warm and jitted._cache_size() != self._cache_sizes[kind]:
            self._cache_sizes[kind] = jitted._cache_size()
            logger.warning("compiled a %s step for shapes %s while serving: warm-up missed it", kind,
                           shape_key(inputs))
        return outputs


def _scored(seq: Sequence, tokens: range, start: int, scores: PromptScores, row: int) -> ScoredPrompt:
    """The scores of prompt `tokens` from one row of a scoring prefill whose chunk starts at `start` (token j is
    predicted at position j - 1)."""
    k = seq.params.prompt_logprobs
    positions = slice(tokens.start - 1 - start, tokens.stop - 1 - start)
    return ScoredPrompt(seq, tokens.start, scores.logprobs[row, positions].tolist(),
                        scores.ranks[row, positions].tolist(), scores.top_ids[row, positions, :k].tolist(),
                        scores.top_logprobs[row, positions, :k].tolist())

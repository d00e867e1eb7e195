"""`Speculator`: speculative decoding on the runner's side, an object the runner holds. It runs a `DraftModel`'s or a
`SpeculativeHead`'s (EAGLE-3, MTP) proposals on the device (n-gram drafts come proposed in the scheduler's output),
the verify forward and its sampler, reads a verify call's tokens, and owns those steps' records (`Step`) with their
warm-up examples, the proposer's params and pool, and the acceptance counters. The pure parts live in `spec_decode/`
(n-gram index, proposals and acceptance)."""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import REPLICATED
from jaxserve.models import serving_shardings
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.allocator import Allocator
from jaxserve.engine.speculative_head import SpeculativeHead
from jaxserve.engine.kv_budget import page_bytes
from jaxserve.engine.kv_plan import empty_kv_cache, kv_cache_shardings
from jaxserve.engine.scheduler_output import ScheduledDecode
from jaxserve.engine.stats import SpecDecodeCounters
from jaxserve.engine.step_inputs import VerifyInputs, empty_prefill, empty_verify, verify_inputs
from jaxserve.engine.step_output import RowSequence, SampledToken, sampled_token
from jaxserve.engine.step_registry import RunnerState, Step, assign, jit_step
from jaxserve.engine.steps import (DecodeBatch, Forward, PrefillBatch, SlotState, VerifyBatch, VerifySamplerInputs,
                                   prefill_step, verify_sample_step, verify_step)
from jaxserve.layers.attention import PagedAttention
from jaxserve.layers.sampler import SampleResult
from jaxserve.loading.placement import serving_params
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.draft import ProposeInputs, propose_step
from jaxserve.spec_decode.head_steps import Head


class DraftModel:
    """The draft's params (serving layout on the target's mesh), its KV pool (as many pages as the target's, the
    same page tables) and the slot state its prefill writes (never read)."""

    def __init__(self, spec: SpeculativeConfig, config: ModelConfig, dtype, mesh: Mesh, backend: PagedAttention,
                 page_size: int, slots: int, pages_per_seq: int, allocator: Allocator):
        self.model_config = config
        self.tp = TensorParallel(mesh.size)
        self.tp.check(config)
        self.allocator = allocator
        self.params = serving_params(allocator.weights(spec.model, config, dtype, mesh), config, self.tp, mesh,
                                     dtype, None)
        self.backend, self.dtype, self.page_size = backend, dtype, page_size
        self.kv_cache = None
        self.slot_state = SlotState.empty(slots, pages_per_seq, NamedSharding(mesh, REPLICATED), allocator)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the draft's pool over all layers and devices (K and V)."""
        return page_bytes(self.model_config, self.tp, self.backend, self.page_size, self.dtype)

    def allocate_pool(self, num_pages: int) -> None:
        self.kv_cache = empty_kv_cache([num_pages] * self.model_config.num_layers, self.model_config, self.tp,
                                       self.backend, self.page_size, self.dtype, self.allocator)

    def jitted(self, mesh: Mesh) -> tuple:
        """Its prefill (the target's prefill step on the draft's params and pool) and its two proposals (greedy;
        with the drafts' distributions), jitted for `mesh`."""
        params_in = serving_shardings(self.params, self.model_config, self.tp, mesh)
        kv_in = kv_cache_shardings(self.backend, self.model_config)
        replicated = NamedSharding(mesh, REPLICATED)
        static = (self.model_config, self.tp, self.backend, self.dtype, self.page_size)
        prefill = jit_step(functools.partial(prefill_step, *static), mesh, (params_in, kv_in, replicated),
                           (kv_in, replicated), donate=(1, 2))
        propose = {with_probs: jit_step(functools.partial(propose_step, *static, with_probs), mesh,
                                        (params_in, kv_in, replicated, replicated), (kv_in,), donate=(1,))
                   for with_probs in (False, True)}
        return prefill, propose


class Speculator:
    """Reads and writes the target's pool, slot state and penalties through the runner's `forward_state` /
    `keep_forward_state` and `sampler_state` / `keep_sampler_state`, and runs its steps through the runner's
    `steps` registry (which it adds them to)."""

    def __init__(self, runner: RunnerState, spec: SpeculativeConfig,
                 proposer_config: ModelConfig | Head | None):
        ec = runner.engine_config
        self.runner = runner
        self.k = ec.num_speculative_tokens
        self.draft = (DraftModel(spec, proposer_config, runner.dtype, runner.mesh, runner.backend, ec.page_size,
                                 ec.max_num_seqs, ec.pages_per_seq, runner.allocator)
                      if spec.method == "draft_model" else None)
        self.head = (SpeculativeHead(spec.model or ec.model, proposer_config, runner) if spec.uses_head
                     else None)
        self.counters = SpecDecodeCounters(self.k)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the target's forwards return (`Forward.aux`): a head's."""
        return self.head.config.aux_layers if self.head is not None else ()

    @property
    def pool_page_bytes(self) -> int:
        """Bytes of one page of the proposer's own pool (0: none), which has as many pages as group 0."""
        proposer = self.draft or self.head
        return proposer.page_bytes if proposer is not None else 0

    def allocate_pool(self, num_pages: int) -> None:
        proposer = self.draft or self.head
        if proposer is not None:
            proposer.allocate_pool(num_pages)

    def resident_state(self) -> tuple:
        """The proposer's arrays kept on the devices between steps."""
        if self.draft is not None:
            return self.draft.params, self.draft.kv_cache, self.draft.slot_state
        return self.head.resident_state() if self.head is not None else ()

    def steps(self) -> list[Step]:
        """Its steps' records (call once the target's and the draft's pools exist)."""
        runner, mesh = self.runner, self.runner.mesh
        replicated = NamedSharding(mesh, REPLICATED)
        aux = dict(aux_layers=self.aux_layers) if self.head is not None else {}
        steps = [Step("verify", runner.jit_forward(verify_step, **aux), runner.forward_state,
                      runner.keep_forward_state, self._verify_examples, forwards=("logits", *(("aux",) if aux else ())),
                      forwarded=("draft_tokens",)),
                 Step("verify_sample", jit_step(verify_sample_step, mesh, (replicated,) * 3, (replicated,) * 2,
                                               donate=(0, 1)),
                      runner.sampler_state, runner.keep_sampler_state, self._verify_sample_examples,
                      forwarded=("logits", "draft_tokens", "draft_probs"))]
        draft = self.draft
        if draft is not None:
            prefill, propose = draft.jitted(mesh)
            steps.append(Step("draft_prefill", prefill, lambda: (draft.params, draft.kv_cache, draft.slot_state),
                              assign(draft, "kv_cache", "slot_state"), self._draft_prefill_examples))
            for name, with_probs in (("propose", False), ("propose_probs", True)):
                steps.append(Step(name, propose[with_probs],
                                  lambda: (draft.params, draft.kv_cache, runner.batch.slot_state,
                                           runner.batch.sampling_table),
                                  assign(draft, "kv_cache"), self._propose_examples,
                                  forwards=("draft_tokens", "draft_probs")))
        if self.head is not None:
            steps += self.head.steps()
        return steps

    # -- a step's decode batch -----------------------------------------------------------------------------

    def verify_inputs(self, decodes: tuple[ScheduledDecode, ...]) -> VerifyInputs:
        """The verify call for this step's decodes (some with drafts)."""
        return verify_inputs(self.runner.batch, decodes, self.runner.engine_config, self.k)

    def mirror_prefill(self, batch: PrefillBatch, forward: Forward) -> None:
        """Writes a target prefill call's chunks (`forward`: its outputs) into the proposer's pool too (no-op
        without one). The proposer runs without adapters: it only proposes, and the adapted target verifies."""
        if self.draft is not None:
            self.runner.steps.run("draft_prefill", batch.replace(lora_slots=None))
        if self.head is not None:
            self.head.after_prefill(batch, forward)

    def after_decode(self, batch: DecodeBatch, forward: Forward) -> None:
        """A plain decode call (a step without drafts): a head keeps its hidden states."""
        if self.head is not None:
            self.head.keep(batch, forward)

    def verify(self, inputs: VerifyInputs) -> SampleResult:
        """Proposes (a draft model, on the device) and verifies K drafts per row in one forward of the target; each
        row's output tokens, still on the device (`SampleResult.num_accepted`)."""
        runner, batch = self.runner, inputs.batch
        rows = len(inputs.rows)
        plain = runner.batch.sampling.is_plain_greedy(batch.slots, inputs.output_index, rows)
        proposal = None
        if self.draft is not None:
            runner.send_sampling_table()
            proposal = runner.steps.run("propose" if plain else "propose_probs", ProposeInputs(
                batch.slots, batch.positions, inputs.last_tokens, batch.pages[0], batch.num_draft, batch.active,
                inputs.output_index))
            batch = batch.replace(draft_tokens=proposal.draft_tokens)
        if self.head is not None:
            proposal = self.head.propose(batch)
            batch = batch.replace(draft_tokens=proposal.draft_tokens)
        forward = runner.steps.run("verify", batch)
        if self.head is not None:
            self.head.keep(batch, forward)
        if plain:
            return forward.greedy
        runner.send_sampling_table()
        return runner.steps.run("verify_sample", VerifySamplerInputs(
            forward.logits, batch.draft_tokens, batch.num_draft, proposal.draft_probs if proposal else None,
            batch.slots, inputs.output_index, batch.active))

    def verified(self, rows: list[RowSequence], result: SampleResult, num_draft: np.ndarray) -> list[SampledToken]:
        """A verify call's output tokens, row by row: the accepted drafts, then the token sampled after them."""
        accepted = np.minimum(result.num_accepted, num_draft)
        self.counters.count(num_draft[:len(rows)], accepted[:len(rows)])
        tokens = result.tokens.tolist()
        sampled = []
        for row in rows:
            count = int(accepted[row.row])
            for i in range(count + 1):
                sample = (SampledToken(row.seq_id, tokens[row.row][i]) if row.num_logprobs is None
                          else sampled_token(row, result, (row.row, i)))
                sample.accepted_draft = i < count
                sampled.append(sample)
        return sampled

    # -- warm-up examples: every batch bucket's shapes -------------------------------------------------------

    def _zeros_on_device(self, shape: tuple[int, ...], dtype) -> jax.Array:
        return self.runner.allocator.full(shape, dtype, NamedSharding(self.runner.mesh, REPLICATED))

    def _drafts(self, rows: int):
        """Example drafts: a draft model's and a head's come from its proposal, on the device."""
        shape = (rows, self.k)
        on_device = self.draft is not None or self.head is not None
        return self._zeros_on_device(shape, jnp.int32) if on_device else np.zeros(shape, np.int32)

    def _verify_examples(self) -> Iterator[VerifyBatch]:
        runner = self.runner
        for rows in runner.engine_config.decode_batch_buckets:
            batch = empty_verify(rows, self.k, runner.batch.fields)
            yield batch.replace(draft_tokens=self._drafts(rows))

    def _verify_sample_examples(self) -> Iterator[VerifySamplerInputs]:
        vocab = self.runner.model_config.vocab_size
        for rows in self.runner.engine_config.decode_batch_buckets:
            zeros = np.zeros(rows, np.int32)
            # a draft model's rows that sample have its distributions (its greedy rows skip this sampler)
            probs = None if self.draft is None else self._zeros_on_device((rows, self.k, vocab), jnp.float32)
            yield VerifySamplerInputs(self._zeros_on_device((rows, self.k + 1, vocab), jnp.float32),
                                      self._drafts(rows), zeros, probs, zeros, zeros, np.zeros(rows, bool))

    def _draft_prefill_examples(self) -> Iterator[PrefillBatch]:
        ec = self.runner.engine_config
        for rows, tokens in ec.prefill_shapes:
            yield empty_prefill(rows, tokens, ec.pages_per_seq)

    def _propose_examples(self) -> Iterator[ProposeInputs]:
        for rows in self.runner.engine_config.decode_batch_buckets:
            zeros = np.zeros(rows, np.int32)
            yield ProposeInputs(zeros, zeros, np.zeros((rows, 2), np.int32), np.zeros((rows, self.k + 1), np.int32),
                                zeros, np.zeros(rows, bool), zeros)

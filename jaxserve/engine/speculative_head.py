"""`SpeculativeHead`: a head proposing drafts from the target's hidden states (an EAGLE-3 head, a model's MTP layer:
`spec_decode/head_steps.Head`), on the runner's side, held by its `Speculator`: the head's params (on the target's
mesh, split as its config says), its one-layer KV pool (as many pages as the target's group 0, the same page
tables), the ring of the target's hidden states per slot, its steps (`spec_decode/head_steps.py`), and on the host
per slot the first position whose head KV is not written yet (`fed`): what the next proposal feeds first."""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.kv_budget import page_bytes
from jaxserve.engine.kv_plan import empty_kv_cache, kv_cache_shardings
from jaxserve.engine.step_registry import RunnerState, Step, assign, jit_step
from jaxserve.engine.steps import DecodeBatch, Forward, PrefillBatch, VerifyBatch
from jaxserve.models import serving_shardings
from jaxserve.spec_decode.draft import Proposal
from jaxserve.spec_decode.head_steps import (Head, HeadPrefillInputs, HeadProposeInputs, KeepInputs, head_keep_step,
                                             head_prefill_step, head_propose_step)


class SpeculativeHead:
    def __init__(self, model: str, head: Head, runner: RunnerState):
        ec, mesh = runner.engine_config, runner.mesh
        self.config, self.runner = head, runner
        self.tp = TensorParallel(mesh.size, ec.enable_expert_parallel)
        self.tp.check(head.layer)
        self.width = ec.num_speculative_tokens + 1  # the ring's positions per slot
        self.params = head.load(model, runner.allocator, mesh, self.tp, runner.dtype)
        self.kv = None
        self.ring = runner.allocator.full(
            (ec.max_num_seqs, self.width, len(head.aux_layers) * runner.model_config.hidden_size), runner.dtype,
            NamedSharding(mesh, REPLICATED))
        self.fed = np.zeros(ec.max_num_seqs, np.int64)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the head's pool over all devices."""
        runner = self.runner
        return page_bytes(self.config.layer, self.tp, runner.backend, runner.engine_config.page_size, runner.dtype)

    def allocate_pool(self, num_pages: int) -> None:
        runner = self.runner
        self.kv = empty_kv_cache([num_pages], self.config.layer, self.tp, runner.backend,
                                 runner.engine_config.page_size, runner.dtype, runner.allocator)[0]

    def resident_state(self) -> tuple:
        return self.params, self.kv, self.ring

    # -- steps ---------------------------------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        runner, mesh = self.runner, self.runner.mesh
        replicated = NamedSharding(mesh, REPLICATED)
        params_in = jax.tree.map(lambda leaf: leaf.sharding, self.params)
        target_in = serving_shardings(runner.params, runner.model_config, runner.tp, mesh)
        kv_in = kv_cache_shardings(runner.backend, self.config.layer)[0]
        static = (self.config, runner.model_config, self.tp, runner.backend, runner.dtype,
                  runner.engine_config.page_size)
        prefill = jit_step(functools.partial(head_prefill_step, *static), mesh,
                           (params_in, target_in, kv_in, replicated), (kv_in, replicated), donate=(2, 3))
        keep = jit_step(head_keep_step, mesh, (replicated,), (replicated,), donate=(0,))
        propose = jit_step(functools.partial(head_propose_step, *static), mesh,
                           (params_in, target_in, kv_in, replicated, replicated), (kv_in,), donate=(2,))
        return [Step("head_prefill", prefill, lambda: (self.params, runner.params, self.kv, self.ring),
                     assign(self, "kv", "ring"), self._prefill_examples, forwarded=("aux",)),
                Step("head_keep", keep, lambda: (self.ring,), assign(self, "ring"), self._keep_examples,
                     forwarded=("aux",)),
                Step("head_propose", propose,
                     lambda: (self.params, runner.params, self.kv, self.ring, runner.batch.slot_state),
                     assign(self, "kv"), self._propose_examples, forwards=("draft_tokens",))]

    def after_prefill(self, batch: PrefillBatch, forward: Forward) -> None:
        """The head's KV for a target prefill call's chunks (each but a final chunk's last position)."""
        self.runner.steps.run("head_prefill", HeadPrefillInputs(
            batch.token_ids, batch.starts, batch.num_tokens, batch.page_tables[0], batch.slots, batch.is_final,
            batch.next_tokens, forward.aux))
        for row in np.flatnonzero(batch.num_tokens):
            self.fed[batch.slots[row]] = batch.starts[row] + batch.num_tokens[row] - int(batch.is_final[row])

    def keep(self, batch: VerifyBatch | DecodeBatch, forward: Forward) -> None:
        """A verify or decode call's hidden states into the ring of each row's slot."""
        self.runner.steps.run("head_keep", KeepInputs(forward.aux, batch.slots, batch.positions, batch.active))

    def propose(self, batch: VerifyBatch) -> Proposal:
        """The drafts of a verify call's rows, on the device: O(rows * K) host work."""
        rows, width = len(batch.slots), self.width
        tokens = np.zeros((rows, width), np.int32)
        pending = np.zeros(rows, np.int32)
        for row in np.flatnonzero(batch.active):
            slot, position = batch.slots[row], int(batch.positions[row])
            count = int(min(max(position - self.fed[slot], 1), width))
            tokens[row, :count] = self.runner.batch.token_ids[slot][position - count + 1:position + 1]
            pending[row] = count
            self.fed[slot] = position
        return self.runner.steps.run("head_propose", HeadProposeInputs(
            batch.slots, batch.positions, tokens, pending, batch.pages[0], batch.num_draft, batch.active))

    # -- warm-up examples ----------------------------------------------------------------------------------------

    def _aux(self, rows: int, columns: int) -> jax.Array:
        runner = self.runner
        return runner.allocator.full((rows, columns, self.ring.shape[2]), runner.dtype,
                                     NamedSharding(runner.mesh, REPLICATED))

    def _prefill_examples(self) -> Iterator[HeadPrefillInputs]:
        ec = self.runner.engine_config
        for rows, tokens in ec.prefill_shapes:
            zeros = np.zeros(rows, np.int32)
            yield HeadPrefillInputs(np.zeros((rows, tokens), np.int32), zeros, zeros,
                                    np.zeros((rows, ec.pages_per_seq), np.int32), zeros, np.zeros(rows, bool), zeros,
                                    self._aux(rows, tokens))

    def _keep_examples(self) -> Iterator[KeepInputs]:
        for rows in self.runner.engine_config.decode_batch_buckets:
            zeros = np.zeros(rows, np.int32)
            for columns in (1, self.width):  # a decode call's, a verify call's
                yield KeepInputs(self._aux(rows, columns), zeros, zeros, np.zeros(rows, bool))

    def _propose_examples(self) -> Iterator[HeadProposeInputs]:
        for rows in self.runner.engine_config.decode_batch_buckets:
            zeros = np.zeros(rows, np.int32)
            wide = np.zeros((rows, self.width), np.int32)
            yield HeadProposeInputs(zeros, zeros, wide, zeros, wide, zeros, np.zeros(rows, bool))

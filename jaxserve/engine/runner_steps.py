"""The runner's own steps as `Step` records (`runner_steps`), and the shapes start-up compiles for them: for each,
example inputs of every shape it can have, writing only to the scratch page and to no slot (`Step.examples`;
warm-up compiles and runs each once)."""

from __future__ import annotations

import functools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.models import serving_shardings

from jaxserve.engine.allocator import Allocator
from jaxserve.engine.buckets import power_of_two_buckets
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.input_batch import SlotSamplingParams
from jaxserve.engine.step_inputs import empty_decode, empty_prefill
from jaxserve.engine.step_registry import RunnerState, Step, assign, jit_step
from jaxserve.engine.steps import (BanInputs, BatchFields, DecodeBatch, PrefillBatch, ResetInputs, SamplerInputs,
                                   ScoreInputs, ban_step, decode_step, prefill_step, prompt_scores_step,
                                   reset_penalties_step, sample_step, send_table_step)
from jaxserve.layers.sampler import SamplingBatch

BAN_IDS_CHUNK = 16  # banned ids (EOS, stop_token_ids) are written this many per call, so one shape serves any count


def runner_steps(runner: RunnerState) -> list[Step]:
    """The runner's own steps: its forwards read and write its params, pool and slot state, its samplers the
    penalty state, slot state and device sampling table (`forward_state`, `sampler_state`)."""
    ec, mesh, replicated = runner.engine_config, runner.mesh, NamedSharding(runner.mesh, REPLICATED)
    vocab = runner.model_config.vocab_size
    params_in = serving_shardings(runner.params, runner.model_config, runner.tp, mesh)
    penalties = (lambda: (runner.batch.penalties,)), assign(runner.batch, "penalties")
    on_every_device = dict(mesh=mesh, state_shardings=(replicated,), new_state_shardings=(replicated,),
                           donate=(0,))
    aux = dict(aux_layers=runner.aux_layers) if runner.aux_layers else {}  # an EAGLE-3 head reads them
    return [
        Step("prefill", runner.jit_forward(prefill_step, with_hidden=True, **aux), runner.forward_state,
             runner.keep_forward_state,
             functools.partial(prefill_examples, ec, runner.batch.fields, runner.encoder),
             forwards=("logits", "hidden", *(("aux",) if aux else ()))),
        Step("score", jit_step(functools.partial(prompt_scores_step, runner.model_config, runner.tp, runner.dtype), mesh,
                               (params_in,), (), donate=()),
             lambda: (runner.params,), assign(runner), functools.partial(
                 score_examples, ec, runner.model_config.hidden_size, runner.dtype, replicated, runner.allocator),
             forwarded=("hidden",)),
        Step("decode", runner.jit_forward(decode_step, **aux), runner.forward_state, runner.keep_forward_state,
             functools.partial(decode_examples, ec, runner.batch.fields),
             forwards=("logits", *(("aux",) if aux else ()))),
        Step("table", jit_step(send_table_step, mesh, (), (replicated,), donate=()), lambda: (),
             assign(runner.batch, "sampling_table"), functools.partial(table_examples, ec)),
        Step("sample", jit_step(sample_step, mesh, (replicated,) * 3, (replicated,) * 2, donate=(0, 1)),
             runner.sampler_state, runner.keep_sampler_state, functools.partial(
                 sample_examples, ec, vocab, runner.all_allowed, replicated, runner.allocator),
             forwarded=("logits",)),
        Step("reset", jit_step(functools.partial(reset_penalties_step, vocab), **on_every_device), *penalties,
             functools.partial(reset_examples, ec)),
        Step("ban", jit_step(functools.partial(ban_step, vocab), **on_every_device), *penalties,
             functools.partial(ban_examples, ec)),
    ]


def measure_step_costs(runner: RunnerState, repeats: int = 2) -> tuple[dict[int, float], float]:
    """What the forwards take on this device once warm (the fastest of `repeats` runs of each): seconds per decode
    step by decode bucket, and seconds per prefill token (the largest one-row prefill's time over its tokens). The
    slo policy's first estimates (`slo.StepCosts.seed`) until real steps are measured."""
    ec, fields = runner.engine_config, runner.batch.fields

    def seconds(name: str, inputs) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(runner.steps.run(name, inputs))
            times.append(time.perf_counter() - started)
        return min(times)

    decode = {rows: seconds("decode", empty_decode(rows, fields)) for rows in ec.decode_batch_buckets}
    tokens = ec.prefill_buckets[-1]
    prefill = seconds("prefill", empty_prefill(1, tokens, ec.pages_per_seq, fields))
    return decode, prefill / tokens


def sampler_rows(ec: EngineConfig) -> list[int]:
    """The row counts a sampler call can have: every prefill call's and decode bucket's."""
    return sorted({rows for rows, _ in ec.prefill_shapes} | set(ec.decode_batch_buckets))


def reset_buckets(ec: EngineConfig) -> tuple[int, ...]:
    """Token-count buckets of the penalty reset at admission (prompt + output so far, up to max_model_len)."""
    return power_of_two_buckets(16, max(16, ec.max_model_len))


def prefill_examples(ec: EngineConfig, fields: BatchFields, encoder=None) -> Iterator[PrefillBatch]:
    """Each prefill shape, and with an image model (`encoder`) each one again with room for image embeddings."""
    for rows, tokens in ec.prefill_shapes:
        batch = empty_prefill(rows, tokens, ec.pages_per_seq, fields)
        yield batch
        if encoder is not None:
            yield encoder.with_room(batch)


def score_examples(ec: EngineConfig, hidden_size: int, dtype, sharding, allocator: Allocator
                   ) -> Iterator[ScoreInputs]:
    """A scoring call's last-layer output is a prefill's, on the device."""
    for rows, tokens in ec.prefill_shapes:
        zeros = np.zeros(rows, np.int32)
        yield ScoreInputs(allocator.full((rows, tokens, hidden_size), dtype, sharding),
                          np.zeros((rows, tokens), np.int32), zeros, zeros)


def decode_examples(ec: EngineConfig, fields: BatchFields) -> Iterator[DecodeBatch]:
    for rows in ec.decode_batch_buckets:
        yield empty_decode(rows, fields)


def table_examples(ec: EngineConfig) -> Iterator[SamplingBatch]:
    yield SlotSamplingParams(ec.max_num_seqs).table()


def sample_examples(ec: EngineConfig, vocab_size: int, all_allowed: dict, sharding, allocator: Allocator
                    ) -> Iterator[SamplerInputs]:
    """A sampler's logits are a forward's, on the device; its bitmask the all-allowed one of its row count, kept on
    the device, or a host array (constrained rows' masks, and every mask a multi-host follower is sent)."""
    for rows in sampler_rows(ec):
        zeros = np.zeros(rows, np.int32)
        logits = allocator.full((rows, vocab_size), jnp.float32, sharding)
        for bitmask in (all_allowed[rows], np.full(all_allowed[rows].shape, -1, np.int32)):
            yield SamplerInputs(logits, zeros, zeros, np.zeros(rows, bool), bitmask)


def reset_examples(ec: EngineConfig) -> Iterator[ResetInputs]:
    for length in reset_buckets(ec):
        yield ResetInputs(np.int32(0), np.zeros(length, np.int32), np.int32(0), np.int32(0))


def ban_examples(ec: EngineConfig) -> Iterator[BanInputs]:
    yield BanInputs(np.int32(0), np.full(BAN_IDS_CHUNK, -1, np.int32))

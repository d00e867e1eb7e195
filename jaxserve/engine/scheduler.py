"""`Scheduler`: iteration-level scheduling of sequences into decode slots, with chunked prefill and preemption.

Each `schedule()` call plans one engine step: one decode token for every running sequence, plus prefill chunks
under a token budget (`max_num_batched_tokens`). Decodes run as their own call and are not charged; a prefill chunk
is charged its padded size (its length bucket), so a decode waits at most one budget's worth of prefill. In order:
1. every running sequence that is decoding gets one token (oldest first), and room for its drafts under
   speculative decoding (K tokens, fewer near its length limits); if the pool has no page for it, a running
   sequence is preempted by recompute (pages freed, requeued at the front) until it fits: the most recently
   admitted (priority: of the lowest priority; slo: the one with the most slack);
2. prefill work, under the budget and vLLM's long-prefill limits (`prefill_limits.py`): under fcfs and priority,
   running sequences still prefilling get their next chunk, then waiting sequences are admitted into free slots
   (FCFS, or by aged priority); under slo both are ordered together by slack (`slo.py`). With images, a chunk
   stops before an image past the step's encoder budget (`encoder_cache_manager.py`). An admitted sequence
   reuses its longest cached prefix (none for one that must score its prompt), continued in the KV tiers, whose
   pages the step restores first. Admission stops at the first sequence that finds no pages. A LoRA sequence waits
   while every device slot of the adapter stack serves other adapters' running sequences (`lora/slots.py`).

With a rope whose rotations change with the length (`rope_length_rule`, `layers/rotary.py`) a sequence past the
threshold is marked `rope_by_length` at admission (no prefix caching for it); under LongRoPE ("sequence") one that
outgrows the threshold while decoding is requeued to recompute every token rotated long, as transformers' Phi-3
does, and its drafts never cross the threshold.

The scheduler owns every sequence's state: `update_after_dispatch` advances a dispatched step's sequences,
`update_from_output` applies the tokens a step sampled (as vLLM v1's), `stop` serves the output
processor's stop strings, and `sent` records what the runner has of each. What it hands the runner is plain data
(`scheduler_output.py`); the runner's tokens come back by sequence id.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from jaxserve.engine.buckets import bucket_for, chunk_fitting
from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
from jaxserve.engine.kv_connector import receive_into
from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.prefill_limits import PrefillLimits
from jaxserve.engine.scheduler_output import (Plan, PrefillChunk, SchedulerOutput, Sent, scheduled_decodes,
                                              scheduler_output)
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.engine.slo import slo_policy
from jaxserve.engine.step_output import AppendedToken, SampledToken
from jaxserve.spec_decode.ngram import NgramDrafter
from jaxserve.lora.slots import AdapterSlots

if TYPE_CHECKING:  # the host core imports no jax (engine/config.py resolves against the backend)
    from jaxserve.engine.config import EngineConfig

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, page_manager: PageManager, eos_token_ids: frozenset[int] = frozenset(),
                 rope_length_rule: tuple[str, int] | None = None, clock: Callable[[], float] = time.monotonic,
                 encoder_cache: EncoderCacheManager | None = None):
        self.engine_config = config
        self.clock = clock  # the arrival times' clock (a fake one in tests)
        self.slo = slo_policy(config)
        self._dispatched: deque[tuple[float, int, int]] = deque()  # slo: (time, decodes, padded prefill tokens)
        self._last_read = -math.inf
        self.rope_length_rule = rope_length_rule  # ModelConfig.rope_length_rule
        self.page_manager = page_manager
        self.encoder_cache = encoder_cache or EncoderCacheManager(0, 0)  # an image model's (none: text only)
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self._left_slots: list[int] = []  # ids of the sequences that left their slots since the last output
        self.sent: dict[int, Sent] = {}  # seq id -> what the runner has of it, while it holds a slot
        self.free_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.adapter_slots = AdapterSlots(config.max_loras) if config.enable_lora else None  # LoRA: device slots
        spec = config.speculative_config
        self.drafter = (NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
                        if spec is not None and spec.method == "ngram" else None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence, received=None) -> None:
        """Queues `seq`; `received`: the KV a prefill/decode pull brought for its prompt (`kv_connector.Received`),
        written into the pages its admission allocates."""
        if received is not None:
            seq.received = received
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq
        if seq.lora is not None:
            self.adapter_slots.count(seq.lora, 1)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retires `seq` at once with its finish reason: its slot and pages are free for the next step (a finished
        sequence only takes the new reason)."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        if self.seqs.pop(seq.seq_id, None) is not None and seq.lora is not None:
            self.adapter_slots.count(seq.lora, -1)

    def stop(self, seq: Sequence, stop: str, num_output_tokens: int) -> int:
        """A stop string the output processor found, completed by output token `num_output_tokens`: the tokens
        after it and their logprobs are dropped, and `seq` finishes with it as its reason (a sequence a later token
        finished takes it as its reason; an aborted one stays as it is). Returns how many tokens were dropped."""
        if seq.finish_reason == "abort":
            return 0
        dropped = seq.cut_output(num_output_tokens)
        self.finish(seq, "stop", stop)
        return dropped

    def update_after_dispatch(self, scheduler_output: SchedulerOutput) -> None:
        """Advances a dispatched step's sequences: their chunks' and decodes' KV is computed once the step runs, and
        each final chunk and decode has a sampled token pending on the device."""
        for chunk in scheduler_output.prefills:
            seq = self.seqs[chunk.seq_id]
            if chunk.scored:  # read by the runner's dispatch: each prompt token is scored once, recompute or not
                seq.num_scored = chunk.scored.stop - 1
            seq.num_computed_tokens += chunk.num_tokens
            seq.num_pending += chunk.is_final
            self.page_manager.commit_full_pages(seq)
        for decode in scheduler_output.decodes:
            seq = self.seqs[decode.seq_id]
            seq.num_computed_tokens += 1
            seq.num_pending += 1
        if self.slo is not None:
            buckets = self.engine_config.prefill_buckets
            self._dispatched.append((self.clock(), len(scheduler_output.decodes),
                                     sum(bucket_for(chunk.num_tokens, buckets) for chunk in scheduler_output.prefills)))

    def update_from_output(self, sampled: list[SampledToken]) -> tuple[list[AppendedToken], set[str]]:
        """Applies a step's sampled tokens; a sequence that finished meanwhile drops its token. Returns the tokens
        appended, in order, and the ids of the requests that changed. vLLM's stop rules: none is checked before
        min_tokens outputs; EOS (unless ignore_eos) and stop_token_ids end a sequence, then max_tokens and
        max_model_len do (a stop string the output processor finds in the same token still wins)."""
        appended, touched = [], set()
        caches_prefixes, max_model_len = self.page_manager.enable_prefix_caching, self.engine_config.max_model_len
        now = self.clock()
        if self._dispatched:  # slo: the step these tokens come from is done
            dispatched, num_decodes, num_prefill_tokens = self._dispatched.popleft()
            self.slo.costs.observe(num_decodes, num_prefill_tokens, now - max(dispatched, self._last_read))
            self._last_read = now
        for sample in sampled:
            seq = self.seqs.get(sample.seq_id)
            if seq is None:  # finished meanwhile
                continue
            if sample.accepted_draft:  # a verify step wrote its KV; the sequence's sampled token comes after it
                seq.num_computed_tokens += 1
            else:
                seq.num_pending -= 1
            touched.add(seq.request_id)
            if seq.max_output_tokens == 0:  # only scores its prompt: the prefill's sample is no output
                self.finish(seq, "length")
                continue
            stopped = self._append(seq, sample.token, max_model_len)
            if seq.logprobs is not None:
                seq.cumulative_logprob += sample.logprob
                seq.logprobs.append(sample.top_logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            appended.append(AppendedToken(seq, sample, len(seq.token_ids) - seq.num_prompt_tokens, stopped))
            if caches_prefixes and self.page_manager.page_table(seq.seq_id):
                self.page_manager.commit_full_pages(seq)
        if self.engine_config.speculative_config is not None:
            for seq_id in {sample.seq_id for sample in sampled}:  # the room made for drafts that were rejected
                seq = self.seqs.get(seq_id)  # (or not proposed) goes back to the pool
                if seq is not None and seq.num_lookahead:
                    self.page_manager.trim(seq)
                    sent = self.sent.get(seq_id)
                    if sent is not None:  # (a preempted sequence's runner row is gone)
                        self.sent[seq_id] = sent._replace(
                            num_kept_pages=min(sent.num_kept_pages, len(self.page_manager.page_table(seq_id))))
        return appended, touched

    def _append(self, seq: Sequence, token: int, max_model_len: int) -> bool:
        """Appends `token` and applies the token stop rules and length limits; True if it is a stop token."""
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.consume_token(token):
            logger.warning("request %s: token %d does not fit its grammar: %s", seq.request_id, token,
                           seq.grammar.get_error())
        params = seq.params
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop")
                return True
            if params.stop_token_ids and token in params.stop_token_ids:
                self.finish(seq, "stop", token)
                return True
        if seq.at_length_limit(max_model_len):
            self.finish(seq, "length")
        return False

    def schedule(self) -> SchedulerOutput:
        """The next step's plan, as plain data for the runner."""
        plan = self._plan()
        plan.encoder_frees = self.encoder_cache.end_step()
        decodes = scheduled_decodes(plan.decodes, self.engine_config.speculative_config, self.drafter)
        decodes = self.page_manager.assign_states(plan.prefills, decodes, self.seqs)  # state checkpoints
        output, sent = scheduler_output(plan, tuple(self._left_slots), decodes, self.sent, self.page_manager.tables)
        self.sent.update(sent)
        self._left_slots = []
        return output

    def _plan(self) -> Plan:
        out = Plan([], [], [])
        speculate = self._speculates()
        max_model_len = self.engine_config.max_model_len
        for seq in list(self.running):  # admission order: sequences join at the end and only ever leave
            # a sequence whose every token is sampled only waits for the host to read them (async scheduling)
            if (seq.status is not SequenceStatus.RUNNING or seq.is_prefilling
                    or seq.at_length_limit(max_model_len, with_pending=True)):
                continue
            if seq.outgrows_rope(self.rope_length_rule):
                self._requeue(seq, out)  # recomputed whole, every token rotated by the longer length
                continue
            seq.num_lookahead = self._lookahead(seq) if speculate else 0
            if self._make_room(seq, seq.num_tokens + seq.num_lookahead, out):
                out.decodes.append(seq)
        self._schedule_prefills(out, self.engine_config.max_num_batched_tokens)
        return out

    def _schedule_prefills(self, out: Plan, budget: int) -> None:
        """Prefill chunks for running sequences still prefilling and for waiting ones admitted into free slots, in
        the policy's order, under the budget, the long-prefill limits and (slo) decode protection."""
        now = self.clock()
        running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING and seq.is_prefilling]
        slo, threshold, short, allowance = self.slo, None, None, math.inf
        if slo is not None:
            order = slo.order(running + list(self.waiting), now)
            allowance = slo.prefill_allowance(out.decodes, now)
            threshold, short = slo.long_prefills(out.decodes, order, now) if slo.floor else (None, None)
        else:
            order = running + self._waiting_order(now)
        limits = PrefillLimits(self.engine_config, order, threshold, short)
        prefilling = set(running)
        smallest = self.engine_config.prefill_buckets[0]
        admitting = bool(self.free_slots)
        for seq in order:
            if budget < smallest:
                break
            admit = seq.slot is None
            if admit and seq in prefilling:
                continue  # preempted this step to make room for an earlier chunk
            if (admit and not admitting) or not limits.allows(seq, admit):
                continue
            if admit and seq.lora is not None and not self.adapter_slots.can_acquire(seq.lora.key):
                continue  # every device slot serves other adapters' running sequences: it waits for one
            held = admit and not (slo is not None and slo.is_due(seq, now))  # decode protection holds admissions
            available = int(limits.share(min(budget, allowance) if held else budget))
            if available < smallest:
                continue
            long, cap = limits.is_long(seq), limits.chunk_cap(seq)
            if cap <= 0:  # the step's long prefills have their tokens
                continue
            if admit:
                chunk = self._admit(seq, available, cap, out)
                if chunk is None:  # no page: nothing after it is admitted this step (the order holds)
                    admitting = False
                    continue
                admitting = bool(self.free_slots)
            else:
                num_tokens = chunk_fitting(min(len(seq) - seq.num_computed_tokens, cap), available,
                                           self.engine_config.prefill_buckets)
                num_tokens = self.encoder_cache.chunk_tokens(seq, seq.num_computed_tokens, num_tokens)
                if not num_tokens or not self._make_room(seq, seq.num_computed_tokens + num_tokens, out):
                    continue
                chunk = PrefillChunk(seq, seq.num_computed_tokens, num_tokens)
                out.prefills.append(chunk)
            padded = bucket_for(chunk.num_tokens, self.engine_config.prefill_buckets)
            budget -= padded
            allowance -= padded
            limits.took(long, admit, chunk.num_tokens)
            self.encoder_cache.took(seq, chunk.start, chunk.num_tokens)

    def _admit(self, seq: Sequence, available: int, cap: int, out: Plan) -> PrefillChunk | None:
        """Admits waiting `seq` into a free slot with its first chunk (after its longest cached prefix, continued in
        the KV tiers); None if it cannot be admitted now."""
        if seq.num_pending:  # preempted with a token in flight: admitted once the host has read it
            return None
        seq.rope_by_length = seq.rotates_by_length(self.rope_length_rule)
        looks_up = not seq.scores_prompt  # a prompt to score is computed whole (vLLM skips the lookup too)
        manager = self.page_manager
        cached_pages = manager.match_prefix(seq) if looks_up else []
        found = manager.match_tiers(seq, cached_pages) if looks_up else []
        on_device = manager.admit(seq, cached_pages)
        seq.num_cached_tokens = on_device + len(found) * manager.page_size
        # a decode worker's pulled prompt (`kv_connector.py`): all but its last token
        seq.num_computed_tokens = max(seq.num_cached_tokens, seq.received.num_tokens if seq.received else 0)
        num_tokens = chunk_fitting(min(len(seq) - seq.num_computed_tokens, cap), available,
                                   self.engine_config.prefill_buckets)
        num_tokens = self.encoder_cache.chunk_tokens(seq, seq.num_computed_tokens, num_tokens)
        if not num_tokens or not manager.allocate(seq, seq.num_computed_tokens + num_tokens):
            manager.free(seq)
            seq.num_computed_tokens = 0
            return None
        if looks_up:
            manager.record_lookup(seq, on_device, found)
            out.restores += manager.restore(seq, found)
        if seq.received is not None:
            out.receives.append(receive_into(seq.received, manager.page_table(seq.seq_id),
                                             seq.num_cached_tokens // manager.page_size))
            seq.received = None
        self.waiting.remove(seq)
        if seq.lora is not None:
            seq.lora_slot, load = self.adapter_slots.acquire(seq.lora)
            if load:
                out.lora_loads.append((seq.lora_slot, seq.lora))
        seq.slot = self.free_slots.pop()
        seq.mark_admitted()
        self.running.append(seq)
        out.admitted.append(seq)
        chunk = PrefillChunk(seq, seq.num_computed_tokens, num_tokens)
        out.prefills.append(chunk)
        return chunk

    def _speculates(self) -> bool:
        """Whether this step's decodes get room for drafts: speculation is on and the batch is below
        `disable_by_batch_size`."""
        spec = self.engine_config.speculative_config
        return spec is not None and (spec.disable_by_batch_size is None
                                     or len(self.running) < spec.disable_by_batch_size)

    def _lookahead(self, seq: Sequence) -> int:
        """Drafts `seq` may have: K, fewer near max_model_len or max_tokens (a step yields drafts + 1 tokens), none
        for a constrained sequence (the verify sampler applies no token mask)."""
        if seq.grammar is not None:
            return 0
        room = self.engine_config.max_model_len - seq.num_tokens
        if self.rope_length_rule is not None and self.rope_length_rule[0] == "sequence" and not seq.rope_by_length:
            room = min(room, self.rope_length_rule[1] - seq.num_tokens)  # drafts stay within the short rope
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - seq.num_pending - 1)
        return max(0, min(self.engine_config.num_speculative_tokens, room))

    def _make_room(self, seq: Sequence, num_tokens: int, out: Plan) -> bool:
        """Allocates pages for `seq`, preempting newer sequences as needed; False if `seq` itself was preempted."""
        while not self.page_manager.allocate(seq, num_tokens):
            victim = max((s for s in self.running if s.status == SequenceStatus.RUNNING),
                         key=self._preemption_order)
            self.num_preemptions += 1
            self._requeue(victim, out)
            if victim is seq:
                return False
        return True

    def _preemption_order(self, seq: Sequence):
        """The largest is preempted first: the newest; with priorities, the lowest priority's newest; under slo,
        the one with the most slack."""
        if self.engine_config.scheduling_policy == "priority":
            return seq.priority, seq.admission_order
        if self.slo is not None:
            return self.slo.slack(seq, self.clock()), seq.admission_order
        return seq.admission_order

    def _requeue(self, seq: Sequence, out: Plan) -> None:
        """Frees `seq`'s pages and slot and puts it first in line, to be recomputed when admitted again."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.prefills = [chunk for chunk in out.prefills if chunk.seq is not seq]
        out.decodes = [s for s in out.decodes if s is not seq]
        out.admitted = [s for s in out.admitted if s is not seq]  # admitted earlier in this very step

    def _release(self, seq: Sequence) -> None:
        self.page_manager.free(seq)
        self.sent.pop(seq.seq_id, None)
        seq.num_computed_tokens = 0
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            self._left_slots.append(seq.seq_id)
            seq.slot = None
        if seq.lora_slot is not None:
            self.adapter_slots.release(seq.lora_slot)
            seq.lora_slot = None

    def _waiting_order(self, now: float) -> list[Sequence]:
        """The waiting sequences in admission order: FCFS (preempted ones first), or by aged priority."""
        if self.engine_config.scheduling_policy == "fcfs":
            return list(self.waiting)
        aging = self.engine_config.priority_aging_seconds
        return sorted(self.waiting, key=lambda s: (s.priority - (now - s.arrival_time) / aging, s.arrival_time))

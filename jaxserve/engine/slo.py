"""The "slo" scheduling policy's rules: what steps cost (measured while serving), each sequence's slack to its
latency targets, the order of prefill work, decode protection and the preemption victim. The scheduler owns the
sequences and asks; nothing here changes a sequence.

Times are seconds on the scheduler's clock. A sequence's targets are `ttft_slo` (arrival to first output token)
and `tpot_slo` (mean time per output token after the first), from its request or the engine's defaults.

- Step costs (`StepCosts`): a step of d decodes and p prefill tokens (padded to their buckets) is estimated at
  decode(d) + p * per_token: moving averages over measured steps, decode(d) by decode bucket, both scaled by
  steps with prefill that take longer or shorter than estimated. A step's time runs from its dispatch, or from
  the previous step's end if that is later, to its tokens being read.
- TTFT slack of a sequence without output: arrival + ttft_slo - now - per_token * (its tokens left to compute).
- Order of prefill work (running prefills and waiting sequences together), first to last:
  1. due: waiting, and waited `slo_max_wait` or more since arrival without output, or recomputing after a
     preemption that came after its first token; by arrival. This is the bound: while slots, pages and budget
     exist, no sequence waits longer than slo_max_wait plus the time to admit the due sequences that arrived
     before it (a running prefill is never held, so it needs no bound);
  2. those that can still make their TTFT target (slack >= 0), least slack first;
  3. the rest (target passed or out of reach, or none set), fewest tokens left first, then by arrival: best
     effort, never dropped (a short request that missed its target goes before a long prompt that never could
     make its own; the bound keeps the long ones from starving).
- Decode protection: a step admits new prefills as long as every decoding sequence with a TPOT target still
  meets it after the step: its time since its first token plus the step's estimated time (with the prefill chunks
  planned so far) stays within tpot_slo x its output tokens after the step (less one). Decode steps faster than
  the target build that room up, and prefills spend it. Without room, a step may still take the tightest TPOT
  target of its decodes: one that keeps up with its target stays there, and on a device that barely meets the
  target new prefills get what the decodes and long chunks leave of it instead of waiting for the aging bound.
  Running prefills are not held (they hold their slot and pages already), and due sequences are admitted
  whatever the room.
- Long prefills (when no `long_prefill_token_threshold` is set): a sequence is short when its prefill left takes
  at most half the tightest TTFT target in sight (the server's, and every waiting or prefilling sequence's); each
  step's threshold is the largest prefill bucket whose tokens, at the measured per-token cost, fit the time the
  step may give them besides its decodes: that half (a request arriving during a step waits for it and then runs
  in the next), half the TPOT target of every decoding sequence (a step shares the other half with short prompts
  admitted beside the long ones), and the TTFT slack of every short sequence that can still make its target (it
  goes in the same step, so the step must end before its deadline). A sequence with more tokens left that is not
  short is long; the long prefills of a step share that many tokens, and a short one's chunk is not capped. The
  threshold is never below `floor` (vLLM's 4% of max_model_len, at least the smallest bucket), so long prompts
  always progress; with no target anywhere there is none; with no measured cost yet it is the floor. Long
  prefills never spend the TPOT room that fast decode steps build up: that room is for admissions.
- Preemption victim: the running sequence with the most slack (TTFT slack before its first token, TPOT room
  after it, less the time to recompute what it loses; none set: unbounded), the newest among equals.
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import Callable, Iterable

from jaxserve.engine.config import LONG_PREFILL_FRACTION, EngineConfig
from jaxserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)

DECAY = 0.2  # weight of the newest measurement in the moving averages


class StepCosts:
    """Moving averages of what steps take: seconds per decode step by decode bucket, seconds per prefill token."""

    def __init__(self, decode_buckets: tuple[int, ...], prefill_buckets: tuple[int, ...]):
        self.decode_buckets = decode_buckets
        self.prefill_buckets = prefill_buckets
        self._decode: dict[int, float] = {}
        self.per_prefill_token = 0.0  # 0 until a step with prefill is measured

    def padded(self, num_tokens: int) -> int:
        """The prefill bucket a chunk of `num_tokens` runs in."""
        index = bisect.bisect_left(self.prefill_buckets, num_tokens)
        return self.prefill_buckets[min(index, len(self.prefill_buckets) - 1)]

    def decode_seconds(self, num_decodes: int) -> float:
        """A step's time for `num_decodes` decodes: its bucket's average, else the nearest smaller one measured."""
        if num_decodes == 0:
            return 0.0
        bucket = self.decode_buckets[min(bisect.bisect_left(self.decode_buckets, num_decodes),
                                         len(self.decode_buckets) - 1)]
        if bucket in self._decode:
            return self._decode[bucket]
        smaller = [b for b in self._decode if b < bucket]
        return self._decode[max(smaller)] if smaller else 0.0

    def estimate(self, num_decodes: int, num_prefill_tokens: int) -> float:
        return self.decode_seconds(num_decodes) + num_prefill_tokens * self.per_prefill_token

    def seed(self, decode_seconds: dict[int, float], per_prefill_token: float) -> None:
        """Start-up measurements (`runner_steps.measure_step_costs`), before any real step is observed."""
        self._decode.update(decode_seconds)
        self.per_prefill_token = per_prefill_token

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One measured step (`num_prefill_tokens` padded). A decode step updates its bucket's average; a step with
        prefill, once both costs are known, scales both by its measured over its estimated time (what slows one on
        a busier host slows the other), else gives the prefill tokens what the decodes did not take."""
        bucket = self.decode_buckets[min(bisect.bisect_left(self.decode_buckets, max(1, num_decodes)),
                                         len(self.decode_buckets) - 1)]
        if num_prefill_tokens == 0:
            if num_decodes:
                self._decode[bucket] = _average(self._decode.get(bucket), seconds)
            return
        decode = self.decode_seconds(num_decodes)
        if num_decodes and decode and self.per_prefill_token:
            ratio = seconds / self.estimate(num_decodes, num_prefill_tokens)
            self._decode[bucket] = _average(decode, decode * ratio)
            self.per_prefill_token = _average(self.per_prefill_token, self.per_prefill_token * ratio)
            return
        per_token = max(0.0, seconds - decode) / num_prefill_tokens
        self.per_prefill_token = _average(self.per_prefill_token or None, per_token)


def slo_policy(config: EngineConfig) -> "SloPolicy | None":
    """The policy `config` asks for (None: fcfs or priority). It sets each step's long-prefill threshold when
    `long_prefill_token_threshold` is not set, never below vLLM's default (4% of max_model_len, as a bucket)."""
    if config.scheduling_policy != "slo":
        return None
    buckets = config.prefill_buckets
    floor = None
    if config.long_prefill_token_threshold == 0:
        floor = max((b for b in buckets if b <= config.max_model_len * LONG_PREFILL_FRACTION), default=buckets[0])
    ttft, tpot = (ms / 1000 if ms is not None else None for ms in (config.ttft_slo_ms, config.tpot_slo_ms))
    return SloPolicy(config.slo_max_wait_ms / 1000, StepCosts(config.decode_batch_buckets, buckets), ttft, tpot,
                     floor)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - DECAY) * old + DECAY * new


class SloPolicy:
    """The rules above, over the scheduler's sequences, with `costs` measured by the scheduler. `ttft_slo`,
    `tpot_slo`: the server's targets in seconds (None: none); `floor`: the least long-prefill threshold, None when
    one is set (`long_prefill_token_threshold`) and the policy leaves long prefills to it."""

    def __init__(self, max_wait: float, costs: StepCosts, ttft_slo: float | None = None,
                 tpot_slo: float | None = None, floor: int | None = None):
        self.max_wait = max_wait
        self.costs = costs
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.floor = floor

    def is_due(self, seq: Sequence, now: float) -> bool:
        """Waited max_wait without output, or recomputing after a preemption that came after its first token."""
        return seq.first_token_time is not None or now - seq.arrival_time >= self.max_wait

    def ttft_slack(self, seq: Sequence, now: float) -> float:
        """Seconds to spare before its TTFT target if its prefill ran now (inf: no target)."""
        if seq.ttft_slo is None:
            return math.inf
        left = len(seq) - seq.num_computed_tokens
        return seq.arrival_time + seq.ttft_slo - now - left * self.costs.per_prefill_token

    def order(self, seqs: Iterable[Sequence], now: float) -> list[Sequence]:
        """Prefill work in the policy's order (due, can make it by slack, best effort)."""
        def key(seq: Sequence) -> tuple[int, float, float]:
            if seq.slot is None and self.is_due(seq, now):
                return 0, seq.arrival_time, 0.0
            slack = self.ttft_slack(seq, now)
            if 0 <= slack < math.inf:
                return 1, slack, seq.arrival_time
            return 2, len(seq) - seq.num_computed_tokens, seq.arrival_time
        return sorted(seqs, key=key)

    def prefill_allowance(self, decodes: list[Sequence], now: float) -> float:
        """Padded prefill tokens this step may carry: what the decoding sequences' TPOT room leaves, and never less
        than a step within the tightest TPOT target leaves (inf: no limit, or no measurement yet)."""
        per_token = self.costs.per_prefill_token
        room = min((self._tpot_room(seq, now) for seq in decodes), default=math.inf)
        if per_token == 0 or room == math.inf:
            return math.inf
        target = min(seq.tpot_slo for seq in decodes if seq.tpot_slo is not None)
        return max(0.0, max(room, target) - self.costs.decode_seconds(len(decodes))) / per_token

    def long_prefills(self, decodes: list[Sequence], prefills: list[Sequence], now: float
                      ) -> tuple[int, Callable[[Sequence], bool]]:
        """This step's long-prefill threshold and its test of a short sequence (see the module docstring);
        `prefills`: the running prefills and waiting sequences."""
        per_token = self.costs.per_prefill_token
        ttfts = [seq.ttft_slo for seq in prefills if seq.ttft_slo is not None]
        half = min([*ttfts, self.ttft_slo if self.ttft_slo is not None else math.inf]) / 2

        def is_short(seq: Sequence) -> bool:
            return (len(seq) - seq.num_computed_tokens) * per_token <= half

        seconds = min([half, *(seq.tpot_slo / 2 for seq in decodes if seq.tpot_slo is not None)])
        for seq in prefills:
            slack = self.ttft_slack(seq, now)
            if is_short(seq) and 0 <= slack < seconds:
                seconds = slack
        return self._threshold(seconds - self.costs.decode_seconds(len(decodes))), is_short

    def _threshold(self, seconds: float) -> int:
        """The largest prefill bucket whose tokens take at most `seconds`, at least the floor (inf: the largest)."""
        buckets, per_token = self.costs.prefill_buckets, self.costs.per_prefill_token
        if seconds == math.inf:
            return buckets[-1]
        fits = [bucket for bucket in buckets if bucket * per_token <= seconds] if per_token else []
        return max(self.floor, max(fits, default=0))

    def log_start(self) -> None:
        """Logs the costs measured at start-up and the long-prefill threshold they give with no request waiting."""
        costs = self.costs
        logger.info("slo scheduling: %.2f ms per prefill token, %.1f ms per decode step of %d rows (measured)",
                    1000 * costs.per_prefill_token, 1000 * costs.decode_seconds(costs.decode_buckets[-1]),
                    costs.decode_buckets[-1])
        if self.floor is None:
            return
        targets = {name: target for name, target in (("TTFT", self.ttft_slo), ("TPOT", self.tpot_slo))
                   if target is not None}
        full = costs.decode_buckets[-1]
        seconds = min(targets.values(), default=math.inf) / 2 - costs.decode_seconds(full)
        named = " and ".join(f"{name} {1000 * target:.0f} ms" for name, target in targets.items())
        logger.info("slo scheduling: long prefills take at most %d tokens a step beside %d decodes (from half the "
                    "server's targets: %s; lower while requests need it, never below %d; "
                    "--long-prefill-token-threshold sets one instead)", self._threshold(seconds), full,
                    named or "none set", self.floor)

    def _tpot_room(self, seq: Sequence, now: float) -> float:
        """How long the next step may take with `seq` still within its TPOT target (inf: no target yet)."""
        if seq.tpot_slo is None or seq.first_token_time is None:
            return math.inf
        return seq.tpot_slo * (seq.num_output_tokens + seq.num_pending) - (now - seq.first_token_time)

    def slack(self, seq: Sequence, now: float) -> float:
        """A running sequence's slack if preempted now (what it must recompute counted against it)."""
        if seq.first_token_time is None:
            if seq.ttft_slo is None:
                return math.inf
            return seq.arrival_time + seq.ttft_slo - now - len(seq) * self.costs.per_prefill_token
        room = self._tpot_room(seq, now)
        return room - len(seq) * self.costs.per_prefill_token if room < math.inf else math.inf

"""`SchedulerStats`: an immutable snapshot of the engine's gauges and counters, for metrics, logs and tests;
`IterationStats`: the token latencies of one step.

The stepping thread publishes a new snapshot after every step, so any thread can read one without
touching live engine state. Counters count requests as vLLM does: a request with `n` completions
adds its prompt tokens once and one `request_success` when it finishes. Latencies are measured in
the engine, whatever output kind a request asked for, so streamed and whole answers count alike.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running_seqs: int = 0  # sequences holding a decode slot (prefilling or decoding)
    num_waiting_seqs: int = 0  # sequences waiting for a slot (new or preempted)
    kv_cache_usage: float = 0.0  # fraction of usable KV pages held by running sequences
    prefix_cache_queries: int = 0  # prompt tokens looked up by admitted sequences
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    num_preemptions: int = 0
    prompt_tokens: int = 0  # per request, counted when it arrives
    generation_tokens: int = 0  # over all completions
    request_success: tuple[tuple[str, int], ...] = ()  # (finish reason, finished requests)
    num_steps: int = 0
    kv_cache_capacity_tokens: int = 0  # tokens the KV pool holds for sequences (set at start-up)
    kv_cache_dtype: str = "auto"  # the kv_cache_dtype option: "auto", "int8" or "fp8"
    kv_cache_storage_dtype: str = ""  # what the pages hold: "float32", "bfloat16", "int8", "float8_e4m3fn"

    def finished(self, reason: str) -> int:
        return dict(self.request_success).get(reason, 0)


@dataclasses.dataclass(frozen=True)
class IterationStats:
    """One step's token latencies, one sample per request that got tokens (its `n` completions share a step)."""

    time_to_first_tokens: tuple[float, ...] = ()  # arrival to first token, for requests whose first token came
    inter_token_latencies: tuple[float, ...] = ()  # since the request's previous token, for the others


class StepPhases:
    """Seconds the stepping thread spent in each phase of its steps, summed since start-up: where host time goes
    (benchmarks/host_overhead.py, gpu_check.sh). `lap(phase)` charges the time since the previous lap to `phase`."""

    PHASES = ("schedule", "prepare", "dispatch", "wait", "postprocess")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self._mark = time.perf_counter()

    def start(self) -> None:
        self.steps += 1
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def snapshot(self) -> dict[str, float]:
        return {"steps": self.steps, **self.seconds}

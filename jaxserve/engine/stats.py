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
    # the hybrid KV cache's sliding-window layers: tokens their own pool holds (0: none), and its usage
    kv_cache_window_capacity_tokens: int = 0
    kv_cache_window_usage: float = 0.0
    kv_cache_dtype: str = "auto"  # the kv_cache_dtype option: "auto", "int8" or "fp8"
    kv_cache_storage_dtype: str = ""  # what the pages hold: "float32", "bfloat16", "int8", "float8_e4m3fn"
    # speculative decoding (vLLM's spec_decode_* counters): verified rows that had drafts, their drafts, the
    # accepted ones, and per draft position how often it was accepted; the method proposing them
    spec_decode_method: str = ""
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()
    # KV tiers (engine/kv_tiers.py): per tier, prompt tokens looked up past the tiers above and found (vLLM's
    # external_prefix_cache_queries / _hits), and bytes held / its bound; per transfer type ("device_to_host",
    # "host_to_device", "host_to_disk", "disk_to_host"), the transfers, bytes and seconds so far
    external_prefix_cache: tuple[tuple[str, int, int], ...] = ()  # (tier, queries, hits)
    kv_tier_usage: tuple[tuple[str, int, int], ...] = ()  # (tier, bytes used, capacity bytes)
    kv_transfers: tuple[tuple[str, int, int, float], ...] = ()  # (transfer type, transfers, bytes, seconds)
    # slots of the pages running sequences hold that hold no token yet, over all their slots (0 to 1)
    kv_cache_fragmentation: float = 0.0
    # goodput: per kind ("ttft", "tpot", "both"), finished requests that had such latency targets, and met them
    request_slo: tuple[tuple[str, int, int], ...] = ()  # (kind, requests with targets, requests that met them)
    # LoRA (0 slots: not enabled): device slots, the adapters of running and of waiting sequences (names), adapters
    # written into a slot and read from disk so far
    max_loras: int = 0
    lora_running_adapters: tuple[str, ...] = ()
    lora_waiting_adapters: tuple[str, ...] = ()
    lora_slot_loads: int = 0
    lora_adapter_reads: int = 0
    # images (an image model's): image placeholders' embeddings looked up in the encoder cache and found there, the
    # images encoded and the seconds spent encoding them
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    images_encoded: int = 0
    encoder_seconds: float = 0.0
    prompt_tokens_computed: int = 0  # prompt tokens prefill chunks computed (recomputes after preemption too)
    # prefill/decode disaggregation (`engine/jax_transfer_connector.py`): a prefill worker's prompts sent, their pages
    # and bytes; a decode worker's pulls, the pages, bytes and prompt tokens that arrived, and failed pulls by reason
    kv_transfer_sends: int = 0
    kv_transfer_pages_sent: int = 0
    kv_transfer_bytes_sent: int = 0
    kv_transfer_pulls: int = 0
    kv_transfer_pages_received: int = 0
    kv_transfer_bytes_received: int = 0
    kv_transfer_tokens_received: int = 0
    kv_transfer_pull_failures: tuple[tuple[str, int], ...] = ()  # (reason: "error" or "timeout", pulls)

    def finished(self, reason: str) -> int:
        return dict(self.request_success).get(reason, 0)


@dataclasses.dataclass(frozen=True)
class IterationStats:
    """One step's token latencies, one sample per request that got tokens (its `n` completions share a step)."""

    time_to_first_tokens: tuple[float, ...] = ()  # arrival to first token, for requests whose first token came
    inter_token_latencies: tuple[float, ...] = ()  # since the request's previous token, for the others
    kv_pull_seconds: tuple[float, ...] = ()  # a decode worker's pulls that arrived, from start to arrival

    @property
    def is_empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.kv_pull_seconds)


class SpecDecodeCounters:
    """Running totals of speculative decoding, kept by the runner as verify calls are read."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def count(self, num_draft, num_accepted) -> None:
        """One verify call's rows: `num_draft` and `num_accepted` per row (numpy ints)."""
        self.num_drafts += int((num_draft > 0).sum())
        self.num_draft_tokens += int(num_draft.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        for position in range(len(self.accepted_per_pos)):
            self.accepted_per_pos[position] += int((num_accepted > position).sum())


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


def pools_usage(pools) -> float:
    """Fraction of the pools' usable pages held (0 without pools)."""
    usable = held = 0
    for pool in pools:
        usable += pool.num_usable_pages
        held += pool.num_usable_pages - pool.num_free_pages
    return held / usable if usable else 0.0


def fragmentation(running: list, page_manager) -> float:
    """Slots of the running sequences' pages (`page_manager`'s tables) that hold no token yet, over all their
    slots."""
    page_size = page_manager.page_size
    slots = [len(page_manager.page_table(seq.seq_id)) * page_size for seq in running]
    allocated = sum(slots)
    used = sum(min(seq.num_computed_tokens, held) for seq, held in zip(running, slots))
    return 1 - used / allocated if allocated else 0.0

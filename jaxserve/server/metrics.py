"""Prometheus metrics with vLLM's names under the `jaxserve:` prefix, in a private registry per server.

Gauges and counters are read at scrape time from the engine's `SchedulerStats` snapshot (and nothing
else of the engine), so they can never drift from the engine's own numbers; like vLLM's, prompt tokens
and request successes count requests, however many completions (`n`) each has. Time to first token
and inter-token latency come from the engine's per-step `IterationStats` (so whole answers count as
much as streams); queue time, TPOT and end-to-end latency from each finished request's metrics.
`StatLogger` writes a vLLM-like throughput line from the same snapshots periodically while there is
traffic.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.stats import IterationStats, SchedulerStats

if TYPE_CHECKING:
    from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)
PREFIX = "jaxserve:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class EngineCollector(Collector):
    """Reads the engines' `SchedulerStats` snapshots when Prometheus scrapes (zeros while an engine is loading):
    one engine's, or each data-parallel replica's under a `replica` label."""

    def __init__(self, replica_stats: Sequence[Callable[[], SchedulerStats | None]], model_name: str):
        self._replica_stats = list(replica_stats)
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for replica, get_stats in enumerate(self._replica_stats):
            labels, name = replica_labels(self._model_name, replica, len(self._replica_stats))
            for family in self._families(get_stats() or SchedulerStats(), labels, name):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()

    @staticmethod
    def _families(stats: SchedulerStats, labels: list[str], name: list[str]) -> Iterable[Metric]:

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=labels)
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + metric, doc, labels=labels)
            family.add_metric(name, value)
            return family

        yield gauge("num_requests_running", "Sequences in decode slots (prefilling or decoding).",
                    stats.num_running_seqs)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting_seqs)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (0 to 1).", stats.kv_cache_usage)
        capacity = GaugeMetricFamily(PREFIX + "kv_cache_capacity_tokens",
                                     "Tokens the KV-cache pool holds, by kv_cache_dtype and the dtype its pages store.",
                                     labels=labels + ["kv_cache_dtype", "storage_dtype"])
        capacity.add_metric(name + [stats.kv_cache_dtype, stats.kv_cache_storage_dtype],
                            stats.kv_cache_capacity_tokens)
        yield capacity
        if stats.kv_cache_window_capacity_tokens:
            yield gauge("kv_cache_window_capacity_tokens", "Tokens the sliding-window KV cache groups' own pools "
                        "hold (the hybrid KV cache).", stats.kv_cache_window_capacity_tokens)
            yield gauge("kv_cache_window_usage_perc", "Fraction of the sliding-window groups' KV pages in use.",
                        stats.kv_cache_window_usage)
        yield counter("prompt_tokens", "Prompt tokens received (once per request, whatever its n).",
                      stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated (over all completions).", stats.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                      labels=labels + ["finished_reason"])
        finished = dict(stats.request_success)
        for reason in sorted(set(FINISH_REASONS) | set(finished)):
            success.add_metric(name + [reason], finished.get(reason, 0))
        yield success
        yield counter("num_preemptions", "Sequences preempted (recomputed later) for lack of KV pages.",
                      stats.num_preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter("encoder_cache_queries", "Image embeddings looked up in the encoder cache (by prefill chunks).",
                      stats.encoder_cache_queries)
        yield counter("encoder_cache_hits", "Image embeddings found in the encoder cache.", stats.encoder_cache_hits)
        yield counter("images_encoded", "Images run through the vision encoder.", stats.images_encoded)
        yield counter("encoder_seconds", "Seconds spent encoding images.", stats.encoder_seconds)
        yield from tier_metrics(stats, labels, name)
        yield counter("prompt_tokens_computed", "Prompt tokens computed by prefills (recomputes too; not those found "
                      "in the prefix cache or received from a prefill worker).", stats.prompt_tokens_computed)
        if stats.kv_transfer_sends or stats.kv_transfer_pulls:
            yield from transfer_metrics(stats, labels, name)
        checked = CounterMetricFamily(PREFIX + "request_slo_checked", "Finished requests that had a latency target, "
                                      "by kind (ttft, tpot, both).", labels=labels + ["kind"])
        met = CounterMetricFamily(PREFIX + "request_slo_met", "Finished requests that met their latency target "
                                  "(goodput), by kind (ttft, tpot, both).", labels=labels + ["kind"])
        for kind, num_checked, num_met in stats.request_slo:
            checked.add_metric(name + [kind], num_checked)
            met.add_metric(name + [kind], num_met)
        yield checked
        yield met
        yield gauge("kv_cache_fragmentation_perc", "Slots of running sequences' KV pages holding no token yet, over "
                    "all their slots (0 to 1).", stats.kv_cache_fragmentation)
        yield counter("spec_decode_num_drafts", "Speculative decoding: sequence steps verified with drafts.",
                      stats.spec_decode_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed.",
                      stats.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                      stats.spec_decode_num_accepted_tokens)
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Speculative decoding: draft tokens accepted, by draft position.",
                                           labels=labels + ["position"])
        for position, accepted in enumerate(stats.spec_decode_accepted_per_pos):
            per_position.add_metric(name + [str(position)], accepted)
        yield per_position
        if stats.max_loras:
            yield from lora_metrics(stats, labels, name)


def lora_metrics(stats: SchedulerStats, labels: list[str], name: list[str]) -> Iterable[Metric]:
    """vLLM's `lora_requests_info` (the adapters of running and waiting requests, comma-separated, and max_lora in
    its labels; its value the time of the snapshot, as vLLM's), and the adapters written into device slots and read
    from disk."""
    info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                             labels=labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric(name + [str(stats.max_loras), ",".join(stats.lora_running_adapters),
                            ",".join(stats.lora_waiting_adapters)], time.time())
    yield info
    loads = CounterMetricFamily(PREFIX + "lora_slot_loads", "LoRA adapters written into a device slot.",
                                labels=labels)
    loads.add_metric(name, stats.lora_slot_loads)
    yield loads
    reads = CounterMetricFamily(PREFIX + "lora_adapter_reads", "LoRA adapters read from disk (host cache misses).",
                                labels=labels)
    reads.add_metric(name, stats.lora_adapter_reads)
    yield reads


def replica_labels(model_name: str, replica: int, num_replicas: int) -> tuple[list[str], list[str]]:
    """The label names and values of one engine's samples: `model_name`, and `replica` when there are several."""
    if num_replicas == 1:
        return ["model_name"], [model_name]
    return ["model_name", "replica"], [model_name, str(replica)]


def tier_metrics(stats: SchedulerStats, labels: list[str], name: list[str]) -> Iterable[Metric]:
    """The KV tiers' lookups (vLLM's external prefix cache counters, by tier), usage and transfers (none without
    tiers)."""
    families = {
        "external_prefix_cache_queries": ("Prompt tokens looked up in a KV tier (those the tiers above missed).",
                                          "tier"),
        "external_prefix_cache_hits": ("Prompt tokens found in a KV tier.", "tier"),
        "kv_offload_transfers": ("KV page transfers (batched copies, one file each for the disk).", "transfer_type"),
        "kv_offload_total_bytes": ("KV bytes moved, by transfer type.", "transfer_type"),
        "kv_offload_total_time": ("Seconds spent moving KV, by transfer type (from issue to done).",
                                  "transfer_type")}
    counters = {metric: CounterMetricFamily(PREFIX + metric, doc, labels=labels + [label])
                for metric, (doc, label) in families.items()}
    for tier, queries, hits in stats.external_prefix_cache:
        counters["external_prefix_cache_queries"].add_metric(name + [tier], queries)
        counters["external_prefix_cache_hits"].add_metric(name + [tier], hits)
    for kind, transfers, num_bytes, seconds in stats.kv_transfers:
        counters["kv_offload_transfers"].add_metric(name + [kind], transfers)
        counters["kv_offload_total_bytes"].add_metric(name + [kind], num_bytes)
        counters["kv_offload_total_time"].add_metric(name + [kind], seconds)
    used = GaugeMetricFamily(PREFIX + "kv_tier_usage_bytes", "Bytes of KV a tier holds.", labels=labels + ["tier"])
    capacity = GaugeMetricFamily(PREFIX + "kv_tier_capacity_bytes", "Bytes of KV a tier may hold.",
                                 labels=labels + ["tier"])
    for tier, used_bytes, capacity_bytes in stats.kv_tier_usage:
        used.add_metric(name + [tier], used_bytes)
        capacity.add_metric(name + [tier], capacity_bytes)
    if stats.kv_tier_usage:
        yield from (*counters.values(), used, capacity)


def transfer_metrics(stats: SchedulerStats, labels: list[str], name: list[str]) -> Iterable[Metric]:
    """Prefill/decode disaggregation: what a prefill worker sent and a decode worker received."""
    for metric, doc, value in (
            ("kv_transfer_sends", "Prompts whose KV a prefill worker offered to a decode worker.",
             stats.kv_transfer_sends),
            ("kv_transfer_pages_sent", "KV pages offered to decode workers.", stats.kv_transfer_pages_sent),
            ("kv_transfer_bytes_sent", "KV bytes offered to decode workers.", stats.kv_transfer_bytes_sent),
            ("kv_transfer_pulls", "Pulls of a prompt's KV started by a decode worker.", stats.kv_transfer_pulls),
            ("kv_transfer_pages_received", "KV pages pulled from prefill workers.", stats.kv_transfer_pages_received),
            ("kv_transfer_bytes_received", "KV bytes pulled from prefill workers.", stats.kv_transfer_bytes_received),
            ("kv_transfer_tokens_received", "Prompt tokens whose KV was pulled from prefill workers.",
             stats.kv_transfer_tokens_received)):
        family = CounterMetricFamily(PREFIX + metric, doc, labels=labels)
        family.add_metric(name, value)
        yield family
    failures = CounterMetricFamily(PREFIX + "kv_transfer_pull_failures", "Pulls that failed or timed out (the decode "
                                   "worker computed the prompt), by reason.", labels=labels + ["reason"])
    for reason, count in stats.kv_transfer_pull_failures:
        failures.add_metric(name + [reason], count)
    yield failures


class ServerMetrics:
    """The registry of one server: gauges/counters from the engine's stats plus request-latency histograms."""

    def __init__(self, replica_stats: Sequence[Callable[[], SchedulerStats | None]], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(replica_stats, model_name))
        self._label_values = [replica_labels(model_name, replica, len(replica_stats))[1]
                              for replica in range(len(replica_stats))]
        label_names = replica_labels(model_name, 0, len(replica_stats))[0]

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + metric, doc, labelnames=label_names, buckets=buckets, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first output token.",
                                             TTFT_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Mean time per output token after the first, per finished request.",
                                               TOKEN_LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between successive output tokens of a request.",
                                             TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish, per request.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                            REQUEST_LATENCY_BUCKETS)
        self.kv_transfer_pull_time = histogram("kv_transfer_pull_seconds", "A decode worker's pull of a prompt's KV, "
                                               "from start to arrival.", TTFT_BUCKETS)

    def observe_iteration(self, iteration: IterationStats, replica: int = 0) -> None:
        """One engine step's token latencies (measured in the engine, for every request whatever its output kind)."""
        labels = self._label_values[replica]
        for latency in iteration.time_to_first_tokens:
            self.time_to_first_token.labels(*labels).observe(latency)
        for latency in iteration.inter_token_latencies:
            self.inter_token_latency.labels(*labels).observe(latency)
        for seconds in iteration.kv_pull_seconds:
            self.kv_transfer_pull_time.labels(*labels).observe(seconds)

    def observe_finished(self, output: RequestOutput, num_tokens: int, replica: int = 0) -> None:
        """Called once per finished (not aborted) request; `num_tokens`: its longest completion's output tokens."""
        metrics = output.metrics
        if metrics is None:
            return
        labels = self._label_values[replica]
        finished = metrics.finished_time or time.monotonic()
        self.e2e_request_latency.labels(*labels).observe(finished - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.request_queue_time.labels(*labels).observe(metrics.first_scheduled_time - metrics.arrival_time)
        if num_tokens > 1 and metrics.first_token_time is not None and metrics.last_token_time is not None:
            self.time_per_output_token.labels(*labels).observe(
                (metrics.last_token_time - metrics.first_token_time) / (num_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class StatLogger:
    """Logs throughput and occupancy, like vLLM's periodic line, whenever there was traffic since the last one."""

    def __init__(self, get_stats: Callable[[], SchedulerStats | None], prefix: str = ""):
        self._get_stats = get_stats
        self._prefix = prefix  # "Replica 1: " for one replica of several
        self._last_time = time.monotonic()
        self._last = SchedulerStats()

    def log(self) -> None:
        stats = self._get_stats()
        if stats is None:
            return
        now = time.monotonic()
        last = self._last
        prompt = stats.prompt_tokens - last.prompt_tokens
        generation = stats.generation_tokens - last.generation_tokens
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        seconds = max(now - self._last_time, 1e-9)
        if prompt or generation or stats.num_running_seqs or stats.num_waiting_seqs:
            logger.info("%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        self._prefix, prompt / seconds, generation / seconds, stats.num_running_seqs,
                        stats.num_waiting_seqs, 100 * stats.kv_cache_usage, 100 * hits / queries if queries else 0.0)
            if stats.external_prefix_cache:
                before = {tier: (q, h) for tier, q, h in last.external_prefix_cache}
                rates = []
                for tier, tier_queries, tier_hits in stats.external_prefix_cache:
                    q, h = tier_queries - before.get(tier, (0, 0))[0], tier_hits - before.get(tier, (0, 0))[1]
                    rates.append(f"{tier} {100 * h / q if q else 0.0:.1f}%")
                logger.info("%sExternal prefix cache hit rate: %s, KV cache fragmentation: %.1f%%", self._prefix,
                            ", ".join(rates), 100 * stats.kv_cache_fragmentation)
            before = {kind: (checked, met) for kind, checked, met in last.request_slo}
            goodput = [(kind, checked - before.get(kind, (0, 0))[0], met - before.get(kind, (0, 0))[1])
                       for kind, checked, met in stats.request_slo]
            if any(checked for _, checked, _ in goodput):
                logger.info("%sGoodput: %s", self._prefix, ", ".join(
                    f"{kind} {met}/{checked} met" for kind, checked, met in goodput if checked))
            drafted = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
            if drafted:
                accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
                drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
                logger.info("%sSpecDecoding metrics (%s): Draft acceptance rate: %.1f%%, Mean acceptance length: "
                            "%.2f, Accepted: %d tokens, Drafted: %d tokens", self._prefix, stats.spec_decode_method,
                            100 * accepted / drafted, 1 + accepted / max(drafts, 1), accepted, drafted)
        self._last_time, self._last = now, stats

"""Serving metric math, pure and unit-tested: what one streamed request measured, and the `vllm bench serve` block.

Owns: `RequestResult` (one request as the client saw it), TPOT, percentiles, goodput SLO parsing and checking,
`compute_serving_metrics` (a list of results plus the run's duration into the summary `jaxserve bench serve`
prints), `vllm_result` (that summary under vLLM's flat result-JSON keys) and `output_timeline` (output chunks per
second). No I/O, no clocks: everything here is a function of its arguments.

Definitions (the same as vLLM's `vllm bench serve`):
* TTFT: from sending the request to the first streamed chunk that carries output text.
* ITL: the gaps between successive output chunks of one request (all requests' gaps pooled).
* TPOT: per request, (latency - TTFT) / (output_len - 1), for requests with more than one output token.
* E2E latency: from sending the request to its last chunk.
* Goodput: requests per second that met every given SLO (ttft, tpot, e2el in ms); a request with one
  output token has TPOT 0 for this check.
Percentiles use numpy's default (linear interpolation between closest ranks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclasses.dataclass
class RequestResult:
    """One request as the client measured it. Times are in seconds."""

    success: bool
    prompt_len: int
    output_len: int = 0  # output tokens (server-reported usage when available)
    ttft: float = 0.0
    latency: float = 0.0  # send -> last chunk
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between successive output chunks
    send_time: float = 0.0  # when the request was sent, relative to the run's start
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache (usage.prompt_tokens_details)
    generated_text: str = ""
    retries: int = 0  # sends again on a fresh connection after a reused one closed under it (`client.py`)


def tpot(result: RequestResult) -> float | None:
    """Time per output token excluding the first: (latency - ttft) / (output_len - 1); None if output_len <= 1."""
    if result.output_len <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation (numpy's default); nan for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def summarize_ms(values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean, median, std and the given percentiles of values in seconds, reported in milliseconds."""
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values.size == 0:
        stats = {"mean": math.nan, "median": math.nan, "std": math.nan}
    else:
        stats = {"mean": float(values.mean()), "median": float(np.median(values)), "std": float(values.std())}
    for p in percentiles:
        stats[f"p{_format_percentile(p)}"] = percentile(values, p)
    return stats


def _format_percentile(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """Parses `["ttft:500", "tpot:50"]` into {"ttft": 500.0, "tpot": 50.0} (milliseconds); raises ValueError."""
    slo: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput spec {spec!r} must be NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput spec {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"goodput spec {spec!r}: the SLO must be > 0 ms")
        slo[name] = ms
    return slo


def meets_slo(result: RequestResult, slo_ms: dict[str, float]) -> bool:
    """True if the successful request met every SLO (ms); TPOT counts as 0 for single-token outputs."""
    if not result.success:
        return False
    measured_s = {"ttft": result.ttft, "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all(measured_s[name] * 1000.0 <= limit for name, limit in slo_ms.items())


@dataclasses.dataclass
class ServingMetrics:
    """The `vllm bench serve` summary block. Latency stats are in ms, throughputs per second."""

    completed: int
    failed: int
    retries: int  # requests sent again on a fresh connection (a pooled one the server had closed)
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # req/s meeting the SLOs; None when no SLO was given
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]


def compute_serving_metrics(results: Sequence[RequestResult], duration_s: float,
                            goodput_slo_ms: dict[str, float] | None = None,
                            percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> ServingMetrics:
    """Aggregates per-request results of one run lasting `duration_s` seconds (first send to last completion)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    percentiles = tuple(percentiles)
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itl]
    goodput = None
    if goodput_slo_ms:
        goodput = sum(meets_slo(r, goodput_slo_ms) for r in done) / duration_s
    return ServingMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        retries=sum(r.retries for r in results),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        goodput=goodput,
        ttft_ms=summarize_ms([r.ttft for r in done], percentiles),
        tpot_ms=summarize_ms(tpots, percentiles),
        itl_ms=summarize_ms(itls, percentiles),
        e2el_ms=summarize_ms([r.latency for r in done], percentiles),
    )


def serving_report_rows(metrics: ServingMetrics, max_concurrency: int | None,
                        request_rate: float) -> list[tuple[str, str]]:
    """The rows of the human summary, in `vllm bench serve`'s order; section headers have an empty value."""

    def number(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    rows = [
        ("Successful requests:", str(metrics.completed)),
        ("Failed requests:", str(metrics.failed)),
        *((("Retried on a fresh connection:", str(metrics.retries)),) if metrics.retries else ()),
        ("Maximum request concurrency:", str(max_concurrency) if max_concurrency else "unlimited"),
        ("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else number(request_rate)),
        ("Benchmark duration (s):", number(metrics.duration_s)),
        ("Total input tokens:", str(metrics.total_input_tokens)),
        ("Total generated tokens:", str(metrics.total_output_tokens)),
        ("Request throughput (req/s):", number(metrics.request_throughput)),
    ]
    if metrics.goodput is not None:
        rows.append(("Request goodput (req/s):", number(metrics.goodput)))
    rows += [
        ("Output token throughput (tok/s):", number(metrics.output_throughput)),
        ("Total token throughput (tok/s):", number(metrics.total_token_throughput)),
    ]
    sections = [("Time to First Token", "TTFT", metrics.ttft_ms),
                ("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot_ms),
                ("Inter-token Latency", "ITL", metrics.itl_ms),
                ("End-to-end Latency", "E2EL", metrics.e2el_ms)]
    for title, short, stats in sections:
        rows.append((title, ""))
        rows.append((f"Mean {short} (ms):", number(stats["mean"])))
        rows.append((f"Median {short} (ms):", number(stats["median"])))
        for key, value in stats.items():
            if key.startswith("p") and key != "p50":  # the median row already shows it
                rows.append((f"P{key[1:]} {short} (ms):", number(value)))
    return rows


def output_timeline(results: Sequence[RequestResult], bucket_s: float = 1.0) -> tuple[list[int], list[int]]:
    """Per `bucket_s` of the run: output chunks that arrived, and requests in flight (sent, not yet finished).

    A chunk is one token when the server streams token by token (vLLM's `max_output_tokens_per_s` counts the same).
    """
    done = [r for r in results if r.success]
    if not done:
        return [], []
    end = max(r.send_time + r.latency for r in done)
    buckets = int(end // bucket_s) + 1
    chunks = np.zeros(buckets, dtype=np.int64)
    active = np.zeros(buckets, dtype=np.int64)
    for r in done:
        times = r.send_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(chunks, np.minimum((times // bucket_s).astype(np.int64), buckets - 1), 1)
        first, last = int(r.send_time // bucket_s), int((r.send_time + r.latency) // bucket_s)
        active[first:min(last, buckets - 1) + 1] += 1
    return chunks.tolist(), active.tolist()


def vllm_result(summary: ServingMetrics, results: Sequence[RequestResult],
                percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
                percentiles: Iterable[float] = DEFAULT_PERCENTILES, detailed: bool = False) -> dict:
    """The run under `vllm bench serve`'s result keys: duration, completed, failed, token totals, throughputs,
    `mean/median/std/pNN_<metric>_ms` for each of `percentile_metrics`, and the output peak; `detailed` adds the
    per-request lists (input_lens, output_lens, ttfts, itls, latencies, start_times, generated_texts, errors)."""
    chunks, active = output_timeline(results)
    peak = int(np.argmax(chunks)) if chunks else 0
    result = {
        "duration": summary.duration_s,
        "completed": summary.completed,
        "failed": summary.failed,
        "retries": summary.retries,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "max_output_tokens_per_s": float(chunks[peak]) if chunks else 0.0,
        "max_concurrent_requests": int(active[peak]) if active else 0,
    }
    stats_of = {"ttft": summary.ttft_ms, "tpot": summary.tpot_ms, "itl": summary.itl_ms, "e2el": summary.e2el_ms}
    for metric in percentile_metrics:
        stats = stats_of[metric]
        result[f"mean_{metric}_ms"] = stats["mean"]
        result[f"median_{metric}_ms"] = stats["median"]
        result[f"std_{metric}_ms"] = stats["std"]
        for p in percentiles:
            key = f"p{_format_percentile(p)}"
            result[f"{key}_{metric}_ms"] = stats[key]
    if detailed:
        result.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_len for r in results],
                      ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                      latencies=[r.latency for r in results],
                      start_times=[r.send_time for r in results],
                      generated_texts=[r.generated_text for r in results], errors=[r.error for r in results])
    return result

"""Offline throughput of jaxserve through `LLM.generate`: tok/s, req/s, peak KV usage, prefix hit rate.

Owns the offline measurement other scripts reuse (`compare.py`, `run_default_suite.py`):
* `run_offline`: one `LLM.generate` call over the whole workload, timed from the call to its return
  (engine start-up is measured and reported separately). A `StepProbe` wraps `engine.step` to sample the
  KV-cache usage around every step and count steps; prefix hit rate is the change of the block manager's
  hit/query token counters over the run.
* `run_closed_loop`: the same engine kept at exactly `c` requests in flight (a new request as soon as one
  finishes), for the throughput-vs-concurrency curve without restarting the engine per level.
* `single_stream_decode`: batch-1 decode speed, (n - 1) tokens over first-to-last token time.

    python benchmarks/throughput.py --dataset random --num-prompts 64 --input-len 128 --output-len 64
    python benchmarks/throughput.py --dataset shared-prefix --num-prompts 64 --prefix-len 256
    python benchmarks/throughput.py --concurrency 1 4 16 64   # adds a closed-loop sweep and its plot
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench import dataset_args, datasets
from jaxserve.bench.datasets import RequestRecord

NAME = "throughput"


class StepProbe:
    """Wraps `llm.llm_engine.step` while active: KV usage before and after every step, and each step's duration,
    split into pure decode steps (every running sequence decoding, nothing waiting or being admitted) and
    steps that also prefill. Reads scheduler state only; changes nothing."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.samples: list[float] = []
        self.steps = 0
        self.decode_step_s: list[float] = []
        self.decode_step_batch: list[int] = []
        self.other_step_s: list[float] = []

    def _decode_only(self) -> tuple[bool, int]:
        scheduler = self.engine.scheduler
        running = list(scheduler.running)
        commands = getattr(self.engine, "_commands", None)
        pending = commands is not None and not commands.empty()
        decoding = all(seq.num_computed_tokens >= len(seq) - 1 for seq in running)
        return bool(running) and decoding and not scheduler.waiting and not pending, len(running)

    def __enter__(self) -> "StepProbe":
        original = self.engine.step
        page_manager = self.engine.page_manager

        def probed_step():
            decode_only, batch = self._decode_only()
            self.samples.append(page_manager.usage)
            started = time.perf_counter()
            outputs = original()
            seconds = time.perf_counter() - started
            self.samples.append(page_manager.usage)
            self.steps += 1
            if decode_only:
                self.decode_step_s.append(seconds)
                self.decode_step_batch.append(batch)
            else:
                self.other_step_s.append(seconds)
            return outputs

        self.engine.step = probed_step
        return self

    def __exit__(self, *exc_info: Any) -> None:
        del self.engine.step  # the instance attribute goes; the class method is back

    @property
    def peak_usage(self) -> float:
        return max(self.samples, default=0.0)

    @property
    def mean_usage(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0

    def breakdown(self, elapsed_s: float) -> dict[str, float | int | None]:
        """Where the run's time went: pure decode steps, steps with prefill, and host time between steps."""
        decode_s, other_s = sum(self.decode_step_s), sum(self.other_step_s)
        tokens = sum(self.decode_step_batch)
        return {"decode_steps": len(self.decode_step_s), "decode_steps_s": decode_s,
                "mean_decode_batch": tokens / len(self.decode_step_batch) if self.decode_step_batch else None,
                "mean_decode_step_s": decode_s / len(self.decode_step_s) if self.decode_step_s else None,
                "decode_only_tok_s": tokens / decode_s if decode_s else None,
                "prefill_steps": len(self.other_step_s), "prefill_steps_s": other_s,
                "longest_prefill_step_s": max(self.other_step_s, default=None),
                "outside_steps_s": max(0.0, elapsed_s - decode_s - other_s)}


@dataclasses.dataclass
class OfflineResult(common.OfflineThroughput):
    """One offline run. Throughputs are per second of generation time (start-up excluded)."""

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    steps: int
    peak_kv_usage: float
    mean_kv_usage: float
    prefix_hit_rate: float | None  # cached prompt tokens / prompt tokens looked up; None if caching is off
    preemptions: int
    time_breakdown: dict[str, Any] = dataclasses.field(default_factory=dict)
    output_token_ids: list[list[int]] = dataclasses.field(repr=False, default_factory=list)


def sampling_params_for(records: Sequence[RequestRecord], temperature: float = 0.0, ignore_eos: bool = True,
                        seed: int = 0) -> list:
    from jaxserve import SamplingParams

    return [SamplingParams(temperature=temperature, max_tokens=r.expected_output_len, ignore_eos=ignore_eos,
                           seed=seed + i if temperature > 0 else None) for i, r in enumerate(records)]


def _counters(llm: Any) -> tuple[int, int, int]:
    """Prefix-cache queries and hits (tokens) and preemptions so far; a run reports the change."""
    stats = llm.llm_engine.stats()
    return stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions


def _offline_result(llm: Any, outputs: Sequence[Any], elapsed: float, probe: StepProbe,
                    counters_before: tuple[int, int, int]) -> OfflineResult:
    queries, hits, preemptions = (after - before for after, before in zip(_counters(llm), counters_before))
    return OfflineResult(
        elapsed_s=elapsed, num_requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        steps=probe.steps, peak_kv_usage=probe.peak_usage, mean_kv_usage=probe.mean_usage,
        prefix_hit_rate=hits / queries if llm.llm_engine.engine_config.enable_prefix_caching and queries else None,
        preemptions=preemptions, time_breakdown=probe.breakdown(elapsed),
        output_token_ids=[list(o.outputs[0].token_ids) for o in outputs])


def run_offline(llm: Any, records: Sequence[RequestRecord], temperature: float = 0.0, ignore_eos: bool = True,
                seed: int = 0, use_tqdm: bool = True) -> OfflineResult:
    """One `llm.generate` over all records; times only the call."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in records]
    params = sampling_params_for(records, temperature, ignore_eos, seed)
    counters = _counters(llm)
    with StepProbe(llm.llm_engine) as probe:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - started
    return _offline_result(llm, outputs, elapsed, probe, counters)


def run_closed_loop(llm: Any, records: Sequence[RequestRecord], concurrency: int, temperature: float = 0.0,
                    ignore_eos: bool = True, seed: int = 0, use_tqdm: bool = True) -> OfflineResult:
    """Keeps `concurrency` requests in flight (refilled as they finish) by driving `engine.step` directly.

    Also times, per request, the gaps between successive tokens as the engine hands them out (the stall a
    streaming client would see, without any HTTP in between): `time_breakdown["token_gap_*_s"]`.
    """
    from tqdm.auto import tqdm

    engine = llm.llm_engine
    params = sampling_params_for(records, temperature, ignore_eos, seed)
    pending = list(range(len(records)))[::-1]
    in_flight: set[str] = set()
    finished: dict[str, Any] = {}
    counters = _counters(llm)
    progress = tqdm(total=len(records), desc=f"concurrency {concurrency}", disable=not use_tqdm, dynamic_ncols=True)
    last_token: dict[str, tuple[int, float | None]] = {}  # request -> (tokens so far, when the last came)
    gaps: list[float] = []
    with StepProbe(engine) as probe:
        started = time.perf_counter()
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                index = pending.pop()
                request_id = f"closed-{concurrency}-{index}"
                engine.add_request(request_id, {"prompt_token_ids": records[index].prompt_token_ids}, params[index])
                in_flight.add(request_id)
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                produced = sum(len(completion.token_ids) for completion in output.outputs)
                tokens_before, last_time = last_token.get(output.request_id, (0, None))
                if produced > tokens_before:
                    if last_time is not None:
                        gaps.append(now - last_time)
                    last_token[output.request_id] = (produced, now)
                if output.finished and output.request_id in in_flight:
                    in_flight.discard(output.request_id)
                    finished[output.request_id] = output
                    progress.update(1)
        elapsed = time.perf_counter() - started
    progress.close()
    result = _offline_result(llm, list(finished.values()), elapsed, probe, counters)
    result.time_breakdown.update(token_gap_median_s=float(np.median(gaps)) if gaps else None,
                                 token_gap_p99_s=float(np.percentile(gaps, 99)) if gaps else None,
                                 token_gap_max_s=max(gaps, default=None))
    return result


def single_stream_decode(llm: Any, prompt_token_ids: list[int], output_len: int) -> dict[str, float]:
    """Batch-1 decode: tok/s over the first-to-last token interval (prefill excluded), plus end-to-end tok/s."""
    from jaxserve import SamplingParams

    if output_len < 2:
        raise ValueError("single-stream decode needs output_len >= 2")
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    output = llm.generate({"prompt_token_ids": prompt_token_ids}, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - started
    metrics = output.metrics
    tokens = len(output.outputs[0].token_ids)
    decode_s = metrics.last_token_time - metrics.first_token_time
    return {"prompt_len": len(prompt_token_ids), "output_tokens": tokens, "elapsed_s": elapsed,
            "ttft_s": metrics.first_token_time - metrics.arrival_time,
            "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else float("nan"),
            "end_to_end_tok_s": tokens / elapsed}


def warm_up(llm: Any, vocab_size: int, num_requests: int = 2, seed: int = 12345) -> None:
    """A tiny generate before timing, so first-call overheads outside the compiled steps are not timed."""
    if num_requests <= 0:
        return
    records = datasets.random_dataset(num_requests, 16, 4, vocab_size, seed=seed)
    run_offline(llm, records, use_tqdm=False)


def start_engine(options: dict[str, Any]) -> tuple[Any, float]:
    """`LLM(**options)` and its start-up seconds (load + warm-up compiles)."""
    from jaxserve import LLM

    started = time.perf_counter()
    llm = LLM(**options)
    return llm, time.perf_counter() - started


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_workload_args(parser)
    common.add_engine_args(parser)
    common.add_common_args(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly the expected output length")
    parser.add_argument("--num-warmup-requests", type=int, default=2, help="untimed tiny requests first")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[],
                        help="also run a closed-loop sweep at these in-flight request counts (same engine)")
    parser.add_argument("--sweep-waves", type=int, default=2,
                        help="closed-loop sweep: requests per level = concurrency x waves")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    load_before = common.load_average()
    llm, startup_s = start_engine(common.engine_options(args))
    config = llm.llm_engine.engine_config
    tokenizer, vocab = llm.get_tokenizer(), llm.llm_engine.vocab_size
    records = dataset_args.build_requests(args, tokenizer, vocab, config.max_model_len)
    warm_up(llm, vocab, args.num_warmup_requests)
    result = run_offline(llm, records, args.temperature, args.ignore_eos, args.seed, not args.disable_tqdm)

    sweep = []
    if args.concurrency:
        sweep_args = argparse.Namespace(**{**vars(args), "num_prompts": max(args.concurrency) * args.sweep_waves})
        sweep_records = dataset_args.build_requests(sweep_args, tokenizer, vocab, config.max_model_len)
        for level in args.concurrency:
            if level > config.max_num_seqs:
                print(f"concurrency {level} > max_num_seqs {config.max_num_seqs}: requests will queue")
            point = run_closed_loop(llm, sweep_records[:level * args.sweep_waves], level, args.temperature,
                                    args.ignore_eos, args.seed, not args.disable_tqdm)
            sweep.append({"concurrency": level, **point.summary()})

    payload = {
        "model": common.model_label(args.model),
        "engine": {k: v for k, v in vars(config).items() if not k.startswith("_")},
        "workload": {**dataset_args.describe(args), **datasets.length_stats(records)},
        "startup_s": startup_s,
        "result": result.summary(),
        "closed_loop_sweep": sweep,
        "load_average_before": load_before,
        "load_average_after": common.load_average(),
    }
    path = common.write_result(f"{NAME}-{args.dataset_name}", payload, args.result_file, argv)
    if sweep and not args.no_plot:
        from benchmarks import plots

        png = plots.throughput_vs_concurrency(
            {"offline closed loop": [(p["concurrency"], p["output_throughput"]) for p in sweep]},
            path.with_suffix(".png"), f"jaxserve offline, {payload['model']}, {common.machine_label(common.machine_info())}")
        print(f"plot: {png}")
    report(payload)
    print(f"result: {path}")
    return payload


def report(payload: dict[str, Any]) -> None:
    res, work = payload["result"], payload["workload"]
    hit = res["prefix_hit_rate"]
    rows = [
        ("Model:", payload["model"]),
        ("Workload:", f"{work['dataset_name']} x{work['requests']}"),
        ("Engine start-up (s):", common.fmt(payload["startup_s"], 1)),
        ("Generation time (s):", common.fmt(res["elapsed_s"])),
        ("Prompt tokens:", str(res["prompt_tokens"])),
        ("Output tokens:", str(res["output_tokens"])),
        ("Request throughput (req/s):", common.fmt(res["request_throughput"])),
        ("Output token throughput (tok/s):", common.fmt(res["output_throughput"])),
        ("Total token throughput (tok/s):", common.fmt(res["total_throughput"])),
        ("Peak KV cache usage (%):", common.fmt(100 * res["peak_kv_usage"], 1)),
        ("Mean KV cache usage (%):", common.fmt(100 * res["mean_kv_usage"], 1)),
        ("Prefix cache hit rate (%):", "off" if hit is None else common.fmt(100 * hit, 1)),
        ("Engine steps:", str(res["steps"])),
        ("Preemptions:", str(res["preemptions"])),
    ]
    split = res.get("time_breakdown") or {}
    if split:
        rows += [
            ("Where the time went", ""),
            ("Pure decode steps:", str(split["decode_steps"])),
            ("  time (s):", common.fmt(split["decode_steps_s"])),
            ("  mean batch:", common.fmt(split["mean_decode_batch"], 1)),
            ("  mean step (ms):", common.fmt(None if split["mean_decode_step_s"] is None
                                             else 1000 * split["mean_decode_step_s"], 1)),
            ("  decode tok/s:", common.fmt(split["decode_only_tok_s"])),
            ("Steps with prefill:", str(split["prefill_steps"])),
            ("  time (s):", common.fmt(split["prefill_steps_s"])),
            ("Host time outside steps (s):", common.fmt(split["outside_steps_s"])),
        ]
    common.print_block("Offline Throughput Result", rows)
    if payload["closed_loop_sweep"]:
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else 1000 * seconds

        print(common.format_table(
            ["concurrency", "requests", "output tok/s", "total tok/s", "req/s", "peak KV %",
             "token gap median / p99 / max (ms)", "longest step with prefill (ms)"],
            [[p["concurrency"], p["num_requests"], p["output_throughput"], p["total_throughput"],
              p["request_throughput"], 100 * p["peak_kv_usage"],
              " / ".join(common.fmt(ms(p["time_breakdown"].get(f"token_gap_{k}_s")), 0) for k in ("median", "p99", "max")),
              ms(p["time_breakdown"].get("longest_prefill_step_s"))]
             for p in payload["closed_loop_sweep"]]))


if __name__ == "__main__":
    main()

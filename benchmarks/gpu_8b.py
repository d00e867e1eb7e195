"""An 8B-shaped model (or another `--shape`: `gpu_check.sh` also serves the Qwen3-30B-A3B mixture of experts) served
through the real engine (`LLM`), with random weights drawn on the device.

The stand-in is a published model's config alone (`random_model.write_config`, default `llama-3.1-8b`) served
with `load_format="dummy"`: nothing but the config travels, the weights are drawn in the serving dtype on the
device. It has no tokenizer (its vocabulary is not the default model's), so prompts are random token ids and
no text is detokenized. Parts, most important first; each is written to the JSON as soon as it is measured, and
a part that would start past `--time-limit-s` is skipped and marked so:

1. sanity: a greedy generate with logprobs; every logprob must be finite (random weights overflow nowhere);
2. decode: the engine's decode step at `--batch-sizes` and `--context` against the bandwidth and compute
   roofline, with the device's ceilings measured (`roofline.measure_ceilings`, `roofline.roofline_point`);
   then warmup: the engine's remaining shapes compiled (the engine starts without, so the above come first);
3. throughput: offline, a closed loop keeping each `--concurrency` requests in flight (`throughput.run_closed_loop`)
   over `--waves` x concurrency requests of `--input-len` prompt and `--output-len` output tokens, EOS ignored,
   temperature 1 (as vLLM's benchmark_throughput samples);
4. single-stream: batch-1 decode tok/s of one `--input-len` prompt (`throughput.single_stream_decode`);
5. ttft: time to first token of a `--ttft-len` prompt, median over `--ttft-repeats` distinct prompts;
6. variants: each `--variants` mode (named as in `quality.py`: int8 weights, kv-fp8 pages) in its own engine once
   the first is freed: its sanity check, its decode step at `--variant-batch-sizes` and its speed-up over the
   first engine's.

    python benchmarks/gpu_8b.py --result-file /tmp/gpu-8b.json                      # the GPU stage (H200)
    python benchmarks/gpu_8b.py --num-layers 2 --vocab-size 4096 --dtype float32 \\
        --batch-sizes 1 4 --context 32 --concurrency 2 4 --input-len 16 --output-len 4 --ttft-len 64   # CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, random_model, roofline, throughput
from jaxserve.bench.datasets import RequestRecord

NAME = "gpu_8b"
PUBLISHED = {  # vLLM's published figures for the real models, for comparison only: never measured here
    "llama-3.1-8b": [
        {"figure": "decode step, Llama-3.1-8B, one H200, batch 8", "value": "about 6.5 ms", "source": "vLLM CI"},
        {"figure": "output throughput at saturation, Llama-3.1-8B, one H100", "value": "about 5,300 tok/s",
         "source": "vLLM published benchmark"}],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--shape", default="llama-3.1-8b", choices=list(random_model.SHAPES))
    model.add_argument("--num-layers", type=int, default=None, help="fewer layers than published (dry runs)")
    model.add_argument("--vocab-size", type=int, default=None, help="a smaller vocabulary (dry runs)")
    model.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    model.add_argument("--attention-backend", default=None, help="engine default: pallas on GPU, xla on CPU")
    model.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill tokens per step")
    work = parser.add_argument_group("workloads")
    work.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256], help="decode-step batches")
    work.add_argument("--context", type=int, default=512, help="tokens each decode-step sequence attends over")
    work.add_argument("--repeats", type=int, default=5, help="timed decode steps per batch size (median)")
    work.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="offline requests in flight")
    work.add_argument("--waves", type=int, default=2, help="requests per concurrency level, in multiples of it")
    work.add_argument("--input-len", type=int, default=128)
    work.add_argument("--output-len", type=int, default=128)
    work.add_argument("--ttft-len", type=int, default=2048, help="prompt tokens of the TTFT part")
    work.add_argument("--ttft-repeats", type=int, default=3)
    work.add_argument("--variants", nargs="*", default=["int8", "kv-fp8"], help="quality.py mode names")
    work.add_argument("--variant-batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--time-limit-s", type=float, default=None, help="skip parts that would start after this")
    parser.add_argument("--seed", type=int, default=common.DEFAULT_SEED)
    parser.add_argument("--result-file", default=None, help="JSON path (default benchmarks/results/gpu_8b.json); "
                                                             "the table goes next to it as .txt")
    return parser


def pages(tokens: int, page_size: int = 16) -> int:
    return -(-tokens // page_size)


def engine_options(args: argparse.Namespace, model_dir: str, batch_sizes: Sequence[int],
                   concurrency: Sequence[int] = ()) -> dict[str, Any]:
    """One engine for every part: slots and decode buckets for exactly these batch sizes, and KV pages for the
    largest of the decode-step batch, the offline runs and one TTFT prompt (no preemption)."""
    max_model_len = max(args.ttft_len + 8, args.context, args.input_len + args.output_len)
    needed = max(max(batch_sizes) * pages(args.context), max(concurrency, default=0) *
                 pages(args.input_len + args.output_len), pages(max_model_len))
    slots = max([*batch_sizes, *concurrency])
    options = dict(model=model_dir, load_format="dummy", dtype=args.dtype, max_num_seqs=slots,
                   max_model_len=max_model_len, num_kv_pages=needed + 1,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   decode_batch_buckets=tuple(sorted({1, *batch_sizes, *concurrency})), seed=args.seed)
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    return options


def random_tokens(rng: np.random.Generator, count: int, length: int, vocab_size: int) -> list[list[int]]:
    return rng.integers(0, vocab_size, (count, length)).tolist()


# -- the parts -----------------------------------------------------------------------------------------------


def sanity(llm: Any, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    from jaxserve import SamplingParams

    prompt = random_tokens(rng, 1, args.input_len, llm.llm_engine.vocab_size)[0]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    values = [value for step in completion.logprobs for value in step.values()]
    if not np.isfinite(values).all():
        raise FloatingPointError(f"non-finite logprobs from the random-weight model: {values}")
    return {"tokens": list(completion.token_ids), "finite_logprobs": True, "min_logprob": min(values)}


def decode(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    ceilings = roofline.measure_ceilings(args.dtype)
    points = [roofline.roofline_point(llm, ceilings, batch, args.context, args.repeats) for batch in args.batch_sizes]
    return {"ceilings": ceilings, "points": points}


def offline(llm: Any, args: argparse.Namespace, rng: np.random.Generator) -> list[dict[str, Any]]:
    runs = []
    for concurrency in args.concurrency:
        prompts = random_tokens(rng, args.waves * concurrency, args.input_len, llm.llm_engine.vocab_size)
        records = [RequestRecord(prompt, args.output_len) for prompt in prompts]
        result = throughput.run_closed_loop(llm, records, concurrency, temperature=1.0, seed=args.seed, use_tqdm=False)
        runs.append({"concurrency": concurrency, **result.summary()})
    return runs


def single_stream(llm: Any, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    prompt = random_tokens(rng, 1, args.input_len, llm.llm_engine.vocab_size)[0]
    return throughput.single_stream_decode(llm, prompt, args.output_len)


def ttft(llm: Any, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    prompts = random_tokens(rng, args.ttft_repeats, args.ttft_len, llm.llm_engine.vocab_size)
    seconds = [throughput.single_stream_decode(llm, prompt, 2)["ttft_s"] for prompt in prompts]
    return {"prompt_len": args.ttft_len, "ttft_s": statistics.median(seconds), "samples_s": seconds}


def variant(model_dir: str, mode: str, args: argparse.Namespace, baseline: dict[int, float]) -> dict[str, Any]:
    from benchmarks.quality import build_engine, parse_mode

    gc.collect()  # the engine before this one is gone, cycles included
    options = engine_options(args, model_dir, args.variant_batch_sizes)
    max_model_len = max(args.context, args.input_len + 8)  # decode steps and the sanity check only
    options.update(max_num_batched_tokens=16, max_model_len=max_model_len,  # 16: one prefill shape to compile
                   num_kv_pages=max(max(args.variant_batch_sizes) * pages(args.context), pages(max_model_len)) + 1)
    started = time.perf_counter()
    llm = build_engine(options, parse_mode(mode)[1])
    llm.llm_engine.runner.warmup()  # its few shapes compiled side by side, not one by one as the timing meets them
    startup = time.perf_counter() - started
    checked = sanity(llm, args, np.random.default_rng(args.seed))
    points = []
    for batch in args.variant_batch_sizes:
        step = roofline.time_decode_step(llm, batch, args.context, args.repeats)["step_s"]
        points.append({"batch": batch, "step_s": step, "tok_s": batch / step,
                       "speedup": baseline[batch] / step if batch in baseline else None})
    config = llm.llm_engine.engine_config
    return {"mode": mode, "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
            "startup_s": startup, "sanity": checked, "points": points}


# -- the run -------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    deadline = time.monotonic() + args.time_limit_s if args.time_limit_s else float("inf")
    overrides = {key: value for key, value in (("num_hidden_layers", args.num_layers),
                                               ("vocab_size", args.vocab_size)) if value is not None}
    payload: dict[str, Any] = {"shape": args.shape, "overrides": overrides, "dtype": args.dtype,
                               "load_format": "dummy", "published_reference": PUBLISHED.get(args.shape, []),
                               "parts": {}, "skipped": [],
                               "errors": {}}
    path = common.write_result(NAME, payload, args.result_file, argv)
    rng = np.random.default_rng(args.seed)

    def part(name: str, run: Callable[[], Any], reserve_s: float = 5.0) -> Any:
        """Runs one part unless too little time is left; records its result or error and rewrites the JSON."""
        if time.monotonic() + reserve_s > deadline:
            payload["skipped"].append(name)
        else:
            started = time.perf_counter()
            try:
                payload["parts"][name] = run()
                payload.setdefault("part_seconds", {})[name] = time.perf_counter() - started
            except Exception as err:  # one part's failure must not lose the others' numbers
                payload["errors"][name] = f"{type(err).__name__}: {err}"
                print(f"{name} failed: {payload['errors'][name]}", flush=True)
        common.write_result(NAME, payload, path, argv)
        return payload["parts"].get(name)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = random_model.write_config(scratch, args.shape, **overrides)
        from jaxserve import LLM

        started = time.perf_counter()
        # no warm-up at start: the decode steps compile only their own shapes and come first; the rest of the
        # shapes compile (side by side) in the "warmup" part, before the parts that need them
        try:
            llm = LLM(**engine_options(args, model_dir, args.batch_sizes, args.concurrency), warmup=False)
        except Exception as err:
            payload["errors"]["startup"] = f"{type(err).__name__}: {err}"
            common.write_result(NAME, payload, path, argv)
            raise
        payload["startup_s"] = time.perf_counter() - started
        payload["engine"] = {k: v for k, v in vars(llm.llm_engine.engine_config).items() if not k.startswith("_")}
        payload["model_config"] = llm.llm_engine.model.config
        part("sanity", lambda: sanity(llm, args, rng))
        part("decode", lambda: decode(llm, args))
        part("warmup", lambda: {"compile_s": llm.llm_engine.runner.warmup()})
        part("throughput", lambda: offline(llm, args, rng))
        part("single_stream", lambda: single_stream(llm, args, rng))
        part("ttft", lambda: ttft(llm, args, rng))
        payload["device_memory"] = device_memory()
        llm = None  # the engine, its weights and KV pages go before the variants' engines come
        gc.collect()
        points = payload["parts"].get("decode", {}).get("points", [])
        baseline = {p["batch"]: p["step_s"] for p in points if p["context"] == args.context}
        for mode in args.variants:
            part(f"variant {mode}", lambda: variant(model_dir, mode, args, baseline), reserve_s=60.0)
    table = report(payload)
    path.with_suffix(".txt").write_text(table + "\n")
    print(table)
    print(f"result: {path}")
    return payload


def device_memory() -> dict[str, Any] | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return {key: stats[key] for key in ("peak_bytes_in_use", "bytes_limit") if key in stats} if stats else None


def report(payload: dict[str, Any]) -> str:
    """The short table: one line per measured number, the published reference last."""
    parts, rows = payload["parts"], []
    model = payload["shape"] + "".join(f", {k}={v}" for k, v in payload["overrides"].items())
    for p in parts.get("decode", {}).get("points", []):
        rows.append([f"decode step, batch {p['batch']}, ctx {p['context']}", f"{1000 * p['step_s']:.2f} ms",
                     f"floor {1000 * p['floor_s']:.2f} ms ({p['bound']}), {p['percent_of_roofline']:.0f}% of roofline"])
    for run in parts.get("throughput", []):
        rows.append([f"offline, {run['concurrency']} in flight, {run['num_requests']} requests",
                     f"{run['output_throughput']:.0f} out tok/s", f"{run['total_throughput']:.0f} total tok/s"])
    if "single_stream" in parts:
        rows.append(["single stream decode", f"{parts['single_stream']['decode_tok_s']:.1f} tok/s", ""])
    if "ttft" in parts:
        rows.append([f"TTFT, {parts['ttft']['prompt_len']}-token prompt", f"{1000 * parts['ttft']['ttft_s']:.1f} ms",
                     ""])
    for name, result in parts.items():
        for p in result.get("points", []) if name.startswith("variant") else []:
            speedup = f"x{p['speedup']:.2f} vs {payload['dtype']}" if p["speedup"] else ""
            rows.append([f"{result['mode']} decode step, batch {p['batch']}", f"{1000 * p['step_s']:.2f} ms", speedup])
    rows += [[f"published (not measured here): {ref['figure']}", ref["value"], ref["source"]]
             for ref in payload["published_reference"]]
    compile_s = parts.get("warmup", {}).get("compile_s")
    lines = [f"{model} (random weights, load_format=dummy), {payload['dtype']}, load {payload['startup_s']:.1f} s"
             + (f", warm-up compiles {compile_s:.1f} s" if compile_s is not None else ""),
             common.format_table(["what", "measured", "against"], rows)]
    lines += [f"skipped (time): {name}" for name in payload["skipped"]]
    lines += [f"FAILED {name}: {error}" for name, error in payload["errors"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Host overhead of the engine loop: a tiny random-weight model (device work is then small) served offline, with the
stepping thread's time split into its phases.

For each batch size B: an engine with `max_num_seqs=B` generates `max(num_requests, B)` requests of
`--output-len` tokens (EOS ignored) from random `--input-len`-token prompts through `LLM.generate`. Reported:
output tokens/s over the generate call, wall time per step, and the host seconds per step in each phase the
engine records (`LLMEngine.phases`: schedule, prepare, dispatch, wait, postprocess), and how busy that keeps
the device: the decode step timed alone, back to back (`roofline.time_decode_step`, at the run's mean context),
over the mean wall time per step (prefill steps included, so this is a lower bound). "wait" is time the host
blocks reading a step's tokens; with async scheduling a launch may also block in "dispatch" until the
device takes the step (XLA:CPU). Engine start-up is not timed.

    python benchmarks/host_overhead.py --batch-sizes 1 8 64 256
    python benchmarks/host_overhead.py --batch-sizes 64 --no-async-scheduling   # the synchronous loop
    python benchmarks/host_overhead.py --batch-sizes 64 --profile 15   # and the loop's top functions by own time
    python benchmarks/host_overhead.py --tokenizer checkpoints/SmolLM2-135M-Instruct --vocab-size 8192 --stop zqzq
        # with detokenization (and a stop string that never matches): the default model's tokenizer, whose
        # first 8,192 ids are its most frequent tokens (the store `make demo` converts holds it)
    python benchmarks/host_overhead.py --tokenizer ... --detokenizer-process   # detokenized in a second process
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline

NAME = "host_overhead"
TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def build_tiny_model(path: str, vocab_size: int) -> str:
    from benchmarks import random_model

    return random_model.build(path, seed=0, vocab_size=vocab_size, **TINY_SHAPES)


def run_batch(model: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import LLM, SamplingParams

    options = dict(max_num_seqs=batch, max_model_len=args.input_len + args.output_len + 16,
                   max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                   compilation_cache_dir=None)
    if args.no_async_scheduling:
        options["async_scheduling"] = False
    if args.tokenizer:
        options["tokenizer"] = args.tokenizer
    if args.detokenizer_process is not None:
        options["detokenizer_process"] = args.detokenizer_process
    llm = LLM(model, **options)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, args.vocab_size, args.input_len).tolist()}
               for _ in range(max(args.num_requests, batch))]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature, seed=0,
                            stop=args.stop)
    engine = llm.llm_engine
    before = engine.phases.snapshot()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    after = engine.phases.snapshot()
    steps = after["steps"] - before["steps"]
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    per_step = {phase: (after[phase] - before[phase]) / steps * 1e3 for phase in engine.phases.PHASES}
    host = sum(v for phase, v in per_step.items() if phase != "wait")
    if args.profile:  # a second, identical call under cProfile: where the host's time goes, by function
        profile = cProfile.Profile()
        profile.runcall(llm.generate, prompts, params, use_tqdm=False)
        print(f"batch {batch}: the top {args.profile} functions by own time (cProfile)")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    # the device alone: the same decode step timed back to back, at the run's mean context
    device = roofline.time_decode_step(llm, batch, args.input_len + args.output_len // 2)["step_s"] * 1e3
    return dict(batch=batch, requests=len(prompts), output_tokens=tokens, seconds=wall, tokens_per_s=tokens / wall,
                steps=steps, step_ms=wall / steps * 1e3, host_ms=host, phases_ms=per_step, device_step_ms=device,
                device_busy=device / (wall / steps * 1e3))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--num-requests", type=int, default=64, help="at least the batch size is run")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (chunked prefill)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-async-scheduling", action="store_true", help="the synchronous loop")
    parser.add_argument("--model", help="a checkpoint to use instead of the tiny random one")
    parser.add_argument("--tokenizer", help="a tokenizer directory: outputs are then detokenized (without one, the "
                        "tiny model has none and outputs are token ids only)")
    parser.add_argument("--detokenizer-process", action=argparse.BooleanOptionalAction, default=None,
                        help="detokenize in a second process (default: the engine's, off on a CPU)")
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings every request carries")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also run each batch's workload again under cProfile and print its top N functions")
    parser.add_argument("--seed", type=int, default=common.DEFAULT_SEED)
    parser.add_argument("--result-file", help="result JSON path (default benchmarks/results/host_overhead.json)")
    argv, args = common.start(parser, argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_tiny_model(scratch, args.vocab_size)
        runs = [run_batch(model, batch, args) for batch in args.batch_sizes]
    headers = ["batch", "tok/s", "step ms", "device ms", "busy", "host ms"] + [f"{p} ms" for p in runs[0]["phases_ms"]]
    rows = [[r["batch"], f"{r['tokens_per_s']:.0f}", f"{r['step_ms']:.3f}", f"{r['device_step_ms']:.3f}",
             f"{r['device_busy']:.0%}", f"{r['host_ms']:.3f}"]
            + [f"{v:.3f}" for v in r["phases_ms"].values()] for r in runs]
    print(common.format_table(headers, rows))
    payload = dict(args=vars(args), runs=runs)
    path = common.write_result(NAME, payload, args.result_file, argv)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()

"""`jaxserve compile --target T [serve's engine flags]`: compiles every step `jaxserve serve` would compile at start-up
for an accelerator that is not attached, prints the steps and the memory plan, and exits 0 only when every step
compiles and the plan fits (1 otherwise, with one line saying why)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.aot.targets import TARGETS
    from jaxserve.server.cli_args import add_engine_args

    parser = argparse.ArgumentParser(
        prog="jaxserve compile", description="Compile every step the engine would compile at start-up for a GPU or "
        "TPU that is not attached (no device, no weights: the model may be a directory holding only config.json), "
        "and plan its memory. Proves the steps compile and fit; says nothing of speed or numerics.")
    parser.add_argument("--target", required=True, choices=sorted(TARGETS), metavar="TARGET",
                        help=f"the accelerator: {', '.join(TARGETS)}")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="write the result as JSON")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="threads compiling at once (default: one per core, as the server's warm-up; "
                             "one for a TPU target, whose compiler crashed on two)")
    parser.add_argument("--steps", default=None, metavar="NAMES",
                        help="only these steps, comma-separated (prefill, decode, sample, ...; default: all)")
    add_engine_args(parser)
    return parser


def compile_main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    # the compile-only devices need no runtime: CPU only, so the CUDA plugin never looks for a GPU; and jax's GPU
    # allocator as `jaxserve serve` sets it, which the memory plan follows
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.gpu_memory_utilization))
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
    for noisy in ("jaxserve.engine.model_runner", "jaxserve.engine.config"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxserve.aot.compile import compile_engine
    from jaxserve.aot.report import memory_plan, result_json, table
    from jaxserve.aot.targets import CompilerMissing
    from jaxserve.server.cli_args import engine_config

    try:
        result = compile_engine(engine_config(args), args.target,
                                set(args.steps.split(",")) if args.steps else None, max(1, args.jobs))
    except (ValueError, CompilerMissing) as err:
        print(f"jaxserve compile: {err}", file=sys.stderr)
        sys.exit(1 if isinstance(err, CompilerMissing) else 2)
    steps = result.steps
    if steps:
        print(table(result))
    print(memory_plan(result))
    print(result.verdict())
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as file:
            json.dump(result_json(result), file, indent=1)
    sys.exit(0 if result.ok else 1)

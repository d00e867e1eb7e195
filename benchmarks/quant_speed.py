"""Decode speed of quantization modes (weights or KV pages) against float, in one process: the engine's jitted decode step
(`roofline.time_decode_step`) at each batch size, the modes' engines timed in turn, round after round, so a noisy
shared machine slows them alike; medians over the rounds and each mode's speed-up over the first mode.

    python benchmarks/quant_speed.py --modes float int8 kv-fp8 --batch-sizes 1 64 --context 256 --rounds 5

Modes are named as in `quality.py` (built in: float, int8, int8-float-embedding, kv-int8, kv-fp8, or
NAME:key=value,...).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from benchmarks import common
from benchmarks.quality import build_engine, parse_mode
from benchmarks.roofline import decode_options, time_decode_step

NAME = "quant_speed"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["float", "int8"],
                        help="engine of each mode, as quality.py names them; the first is the baseline")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence attends over")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all modes (median reported)")
    parser.add_argument("--repeats", type=int, default=3, help="timed samples per mode, batch size and round")
    common.add_engine_args(parser)
    common.add_common_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    options = decode_options(args)
    options.pop("quantization", None)  # each mode says its own
    engines = {mode: build_engine(options, parse_mode(mode)[1]) for mode in args.modes}
    samples: dict[tuple[str, int], list[float]] = {(m, b): [] for m in args.modes for b in args.batch_sizes}
    for _ in range(args.rounds):
        for batch in args.batch_sizes:
            for mode, llm in engines.items():
                samples[mode, batch].append(time_decode_step(llm, batch, args.context, args.repeats)["step_s"])
    base = args.modes[0]
    points = []
    for batch in args.batch_sizes:
        for mode in args.modes:
            step = statistics.median(samples[mode, batch])
            points.append({"mode": mode, "batch": batch, "step_s": step, "tok_s": batch / step,
                           "samples_s": samples[mode, batch],
                           "speedup": statistics.median(samples[base, batch]) / step})
    payload = {"model": common.model_label(args.model), "context": args.context, "dtype": args.dtype,
               "modes": args.modes, "points": points, "load_average_after": common.load_average()}
    path = common.write_result(NAME, payload, args.result_file, argv)
    print(common.format_table(["mode", "batch", "step ms", "tok/s", f"x {base}"],
                              [[p["mode"], p["batch"], 1000 * p["step_s"], p["tok_s"], p["speedup"]] for p in points]))
    print(f"result: {path}")
    return payload


if __name__ == "__main__":
    main()

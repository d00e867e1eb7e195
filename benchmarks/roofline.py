"""Roofline of one decode step: measured device ceilings, the model's FLOPs and bytes, and the engine's step time.

Owns:
* `measure_ceilings`: the device's read and copy bandwidth (`benchmarks/timing.py`) and large-matmul FLOP/s.
* `decode_cost`: per decode step at batch B and context C, counted from the loaded parameter tree:
  bytes = every weight read once (a tied embedding is read whole as the LM head; an untied one only for B
  rows) + the KV cache read (B * C tokens x layers x 2 x kv_heads x head_dim, window-limited for sliding
  layers) + the new K/V written; FLOPs = 2 x matmul params x B + attention 4 x layers x q_heads x head_dim x C x B.
  A mixture of experts' expert weights count as each token uses them: FLOPs for `top_k` of the `num_experts`
  per token; bytes for the experts a batch of B tokens is expected to reach, E x (1 - (1 - top_k / E)^B) of
  each layer's E if routing were uniform (a random model's router is near that; a trained one is less even).
* `time_decode_step`: the engine's jitted decode step (`llm.llm_engine.runner.decode`) on a filled batch of B
  sequences at context C, with the engine's own batch bucket and page-table width; the K/V tokens the step
  really attends over per sequence are reported (padding beyond C is work the floor does not count).
The floor is max(bytes / read bandwidth, FLOPs / matmul rate) (a decode step reads weights and KV and writes
next to nothing, so the read figure applies, not the copy one); percent of roofline = floor / measured x 100.

    python benchmarks/roofline.py --batch-sizes 1 4 16 64 --context 256
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common

NAME = "roofline"


# -- device ceilings -----------------------------------------------------------------------------------------


def measure_matmul_flops(size: int, dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s of a jitted square matmul (size^3 x 2 FLOPs) in `dtype`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import time_fn

    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(key_b, (size, size), jnp.float32).astype(dtype)
    timing = time_fn(jax.jit(jnp.matmul), a, b, warmup=2, repeats=repeats, min_sample_s=0.05)
    return 2.0 * size**3 / timing.median_s


def measure_ceilings(dtype: str = "float32", bandwidth_bytes: int | None = None, matmul_size: int | None = None,
                     bandwidth_override: float | None = None, flops_override: float | None = None) -> dict[str, Any]:
    """Read bandwidth (bytes/s), copy bandwidth (bytes/s, read + write) and matmul FLOP/s on the default device.

    An override (bytes/s or FLOP/s, e.g. figures measured on a quiet machine) replaces the measurement and is
    marked as given in the result.
    """
    import jax

    from benchmarks.timing import device_summary, measure_copy_bandwidth, measure_read_bandwidth

    on_cpu = jax.default_backend() == "cpu"
    bandwidth_bytes = bandwidth_bytes or (256 << 20 if on_cpu else 1 << 30)
    matmul_size = matmul_size or (2048 if on_cpu else 8192)
    return {"device": device_summary(),
            "read_bandwidth_bytes_s": bandwidth_override or measure_read_bandwidth(bandwidth_bytes, repeats=5),
            "bandwidth_source": "given" if bandwidth_override else f"measured, sum over {bandwidth_bytes} bytes",
            "copy_bandwidth_bytes_s": measure_copy_bandwidth(bandwidth_bytes, repeats=5),
            "matmul_flops_s": flops_override or measure_matmul_flops(matmul_size, dtype),
            "matmul_source": "given" if flops_override else f"measured, {matmul_size}^3 matmul",
            "matmul_size": matmul_size, "dtype": dtype}


# -- the model's cost ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    matmul: int  # every weight used in a matmul, LM head included (a tied embedding counts here as the LM head)
    embedding: int  # the input embedding table
    other: int  # norms and the like, read once per step
    tied_embeddings: bool
    experts: int = 0  # the part of `matmul` in experts' kernels (each token uses top_k / num_experts of it)


def param_counts(params: Any) -> ParamCounts:
    """Classifies the loaded parameter tree by path: embedding, norms, matmul weights (kernels and biases)."""
    import jax

    matmul = embedding = other = experts = 0
    has_lm_head = False
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = "/".join(str(getattr(key, "key", key)) for key in path).lower()
        size = int(math.prod(leaf.shape))
        if "embed" in name:
            embedding += size
        elif "norm" in name or name.endswith("scale"):
            other += size
        else:
            matmul += size
            experts += size if "/experts/" in name else 0
            has_lm_head |= "lm_head" in name
    if not has_lm_head:
        matmul += embedding
    return ParamCounts(matmul=matmul, embedding=embedding, other=other, tied_embeddings=not has_lm_head,
                       experts=experts)


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    batch: int
    context: int
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes


def decode_cost(model_config: Any, counts: ParamCounts, batch: int, context: int, dtype_bytes: int) -> DecodeCost:
    """FLOPs and bytes of one decode step for `batch` sequences that each attend over `context` tokens."""
    cfg = model_config
    hidden = cfg.hidden_size
    moe = getattr(cfg, "moe", None)
    used, reached = 1.0, 1.0  # of the expert weights: the share one token uses, and the share the batch reads
    if moe is not None:
        used = moe.top_k / moe.num_experts
        reached = 1.0 - (1.0 - used) ** batch
    dense = counts.matmul - counts.experts
    weights = (dense + counts.experts * reached + counts.other) * dtype_bytes
    if not counts.tied_embeddings:
        weights += batch * hidden * dtype_bytes  # the embedding rows looked up
    windows = cfg.layer_sliding_windows or (None,) * cfg.num_layers
    attended = sum(min(context, window) if window else context for window in windows)  # summed over layers
    kv_read = batch * attended * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    kv_write = batch * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    flops = 2.0 * (dense + counts.experts * used) * batch + 4.0 * cfg.num_q_heads * cfg.head_dim * attended * batch
    return DecodeCost(batch=batch, context=context, flops=flops, weight_bytes=float(weights),
                      kv_bytes=float(kv_read + kv_write))


def offline_floor_seconds(model_config: Any, counts: ParamCounts, prompt_tokens: int, output_tokens: int,
                          requests: int, flops_rate: float) -> float:
    """The fewest seconds any engine needs for an offline run at `flops_rate`, counting matmul FLOPs only.

    Every prompt token runs the layers; the LM head runs once per output token (the first one from the
    prompt's last position); every output token but the last of each request runs the layers again. At the
    batch sizes of an offline run the step is compute-bound, so weight reads and attention are left out:
    the floor is optimistic, and `expected ratio <= floor tok/s / peer tok/s` bounds what tuning can reach.
    """
    lm_head = model_config.vocab_size * model_config.hidden_size
    layers = counts.matmul - lm_head
    layer_tokens = prompt_tokens + max(0, output_tokens - requests)
    return 2.0 * (layers * layer_tokens + lm_head * output_tokens) / flops_rate


def floor_seconds(cost: DecodeCost, bandwidth: float, flops_rate: float) -> tuple[float, str]:
    memory_s, compute_s = cost.bytes / bandwidth, cost.flops / flops_rate
    return (memory_s, "memory") if memory_s >= compute_s else (compute_s, "compute")


# -- the engine's step ---------------------------------------------------------------------------------------


def time_decode_step(llm: Any, batch: int, context: int, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Seconds per `runner.decode` for `batch` sequences at position `context - 1`, engine buckets applied.

    Writes K/V into pages the engine may hold as cached prefixes, so it resets the prefix cache afterwards;
    call it only while the engine has no requests.
    """
    import numpy as np

    from benchmarks.timing import time_fn
    from jaxserve.engine.step_inputs import DecodeInputs, bucket_for
    from jaxserve.engine.steps import DecodeBatch
    from jaxserve.sampling_params import SamplingParams

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("time_decode_step needs an idle engine")
    config, runner = engine.engine_config, engine.runner
    if batch > config.max_num_seqs:
        raise ValueError(f"batch {batch} > max_num_seqs {config.max_num_seqs}")
    if not 1 <= context <= config.max_model_len:
        raise ValueError(f"context {context} must be in [1, max_model_len={config.max_model_len}]")
    pages_per_seq = -(-context // config.page_size)
    if batch * pages_per_seq > runner.kv_plan.num_pages - 1:
        raise ValueError(f"batch {batch} x {pages_per_seq} pages exceeds the pool ({runner.kv_plan.num_pages - 1} "
                         "pages)")
    rows = bucket_for(batch, config.decode_batch_buckets)
    page_tables = np.zeros((rows, config.pages_per_seq), np.int32)
    for row in range(batch):
        page_tables[row, :pages_per_seq] = 1 + row * pages_per_seq + np.arange(pages_per_seq)
    slots = np.arange(rows, dtype=np.int32)
    tokens = np.random.default_rng(seed).integers(0, engine.vocab_size, rows).astype(np.int32)
    positions = np.full(rows, context - 1, np.int32)
    active = np.arange(rows) < batch
    for slot in slots:  # greedy rows: the step takes the forward's argmax, as a plain greedy batch does
        runner.batch.sampling.set(int(slot), SamplingParams(temperature=0), seed=0)
    state = runner.batch.slot_state  # the device keeps each slot's page table and input token
    runner.batch.slot_state = state.replace(tokens=state.tokens.at[slots].set(tokens),
                                      page_tables=state.page_tables.at[:, slots].set(page_tables))
    groups = state.page_tables.shape[0]  # every KV cache group gets the same pages (its pool is as large here)
    pages = np.tile(page_tables[np.arange(rows), (context - 1) // config.page_size], (groups, 1))
    # no host sequences: the step is timed alone, and every slot is a plain greedy one (the forward's argmax)
    inputs = DecodeInputs([], [], DecodeBatch(slots, positions, pages, active), np.zeros(rows, np.int32))
    timing = time_fn(lambda: runner.decode(inputs), warmup=2, repeats=repeats, min_sample_s=0.02)
    engine.page_manager.reset_prefix_cache()
    return {"step_s": timing.median_s, "step_min_s": timing.min_s, "step_max_s": timing.max_s,
            "batch_bucket": rows, "page_table_width": config.pages_per_seq,
            "attended_tokens_per_seq": _attended_tokens(config, pages_per_seq)}


def _attended_tokens(config: Any, pages_per_seq: int) -> int:
    """K/V tokens per sequence the decode step attends over: its pages, read in whole `DECODE_BLOCK_TOKENS` blocks."""
    from jaxserve.layers.attention_xla import DECODE_BLOCK_TOKENS

    tokens = pages_per_seq * config.page_size
    return -(-tokens // DECODE_BLOCK_TOKENS) * DECODE_BLOCK_TOKENS


def roofline_point(llm: Any, ceilings: dict[str, Any], batch: int, context: int, repeats: int = 5) -> dict[str, Any]:
    """Cost, floor and measured step for one batch size; the row `roofline.py` prints."""
    runner = llm.llm_engine.runner
    counts = param_counts(runner.params)
    dtype_bytes = 2 if llm.llm_engine.engine_config.dtype == "bfloat16" else 4
    cost = decode_cost(llm.llm_engine.model.config, counts, batch, context, dtype_bytes)
    floor_s, bound = floor_seconds(cost, ceilings["read_bandwidth_bytes_s"], ceilings["matmul_flops_s"])
    measured = time_decode_step(llm, batch, context, repeats)
    return {"batch": batch, "context": context, "gflop": cost.flops / 1e9, "weight_mb": cost.weight_bytes / 1e6,
            "kv_mb": cost.kv_bytes / 1e6, "arithmetic_intensity": cost.arithmetic_intensity,
            "floor_s": floor_s, "bound": bound, **measured,
            "percent_of_roofline": 100.0 * floor_s / measured["step_s"],
            "measured_tok_s": batch / measured["step_s"], "floor_tok_s": batch / floor_s,
            "params": dataclasses.asdict(counts)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence attends over")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per batch size (median reported)")
    parser.add_argument("--bandwidth-bytes", type=int, default=None,
                        help="read and copy probe size (default 256 MiB on CPU)")
    parser.add_argument("--matmul-size", type=int, default=None, help="square matmul probe (default 2048 on CPU)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="use this read bandwidth (GB/s) for the floor instead of measuring it")
    parser.add_argument("--matmul-gflops", type=float, default=None,
                        help="use this matmul rate (GFLOP/s) instead of measuring it")
    common.add_engine_args(parser)
    common.add_common_args(parser)
    return parser


def decode_options(args) -> dict[str, Any]:
    """Engine options for timing decode steps: enough slots for the largest batch and room for the context."""
    options = common.engine_options(args)
    options["max_num_seqs"] = max(args.max_num_seqs, max(args.batch_sizes))
    options["max_model_len"] = max(args.max_model_len, args.context)
    return options


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    from tqdm.auto import tqdm

    from jaxserve import LLM

    options = decode_options(args)
    llm = LLM(**options, warmup=False)  # only the measured shapes compile (in the timing warm-up)
    ceilings = measure_ceilings(args.dtype, args.bandwidth_bytes, args.matmul_size,
                                args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else None,
                                args.matmul_gflops * 1e9 if args.matmul_gflops else None)
    points = [roofline_point(llm, ceilings, batch, args.context, args.repeats)
              for batch in tqdm(args.batch_sizes, desc="batch sizes", disable=args.disable_tqdm)]
    payload = {"model": common.model_label(args.model), "context": args.context, "ceilings": ceilings,
               "engine": {k: v for k, v in vars(llm.llm_engine.engine_config).items() if not k.startswith("_")},
               "points": points, "load_average_after": common.load_average()}
    path = common.write_result(NAME, payload, args.result_file, argv)
    if not args.no_plot:
        from benchmarks import plots

        png = plots.roofline_percentage([(p["batch"], p["percent_of_roofline"]) for p in points],
                                        path.with_suffix(".png"),
                                        f"decode step vs roofline, {payload['model']}, ctx {args.context}, "
                                        f"{common.machine_label(common.machine_info())}")
        print(f"plot: {png}")
    report(payload)
    print(f"result: {path}")
    return payload


def report(payload: dict[str, Any]) -> None:
    ceilings = payload["ceilings"]
    print(f"device: {ceilings['device']['device_kind']} ({ceilings['device']['backend']}); read bandwidth "
          f"{ceilings['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s ({ceilings['bandwidth_source']}; copy, read + write: "
          f"{ceilings['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s); {ceilings['dtype']} "
          f"matmul {ceilings['matmul_flops_s'] / 1e9:.1f} GFLOP/s ({ceilings['matmul_source']})")
    print(common.format_table(
        ["batch", "rows", "ctx", "attended", "GFLOP", "MB moved", "FLOP/B", "floor ms", "bound", "step ms", "% roofline",
         "tok/s", "floor tok/s"],
        [[p["batch"], p["batch_bucket"], p["context"], p["attended_tokens_per_seq"], p["gflop"], p["weight_mb"] + p["kv_mb"],
          p["arithmetic_intensity"], 1000 * p["floor_s"], p["bound"], 1000 * p["step_s"], p["percent_of_roofline"],
          p["measured_tok_s"], p["floor_tok_s"]] for p in payload["points"]]))


if __name__ == "__main__":
    main()

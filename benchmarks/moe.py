"""A mixture of experts against the dense model with the same active parameters, on the same machine in one run.

The MoE is a published shape (`random_model.SHAPES`, default `qwen3-30b-a3b`) cut to `--num-layers` layers and a
`--vocab-size` vocabulary; its dense twin is the same decoder (attention, norms, vocabulary) with one SwiGLU of
`top_k x moe_intermediate_size` columns (plus the shared expert's) in each sparse layer, so a token reads the
same number of weights in both. Both are served with random weights (`load_format="dummy"`) through `LLM`:

1. offline throughput: `--num-prompts` random prompts of `--input-len` tokens and `--output-len` outputs each;
2. the decode step at `--batch-sizes` (`roofline.time_decode_step`);
3. the experts' work at those batch sizes: the rows the grouped matmul computes (whole tiles, from the routing
   of a batch of random hidden states through the first sparse layer's router) against the rows routed
   (tokens x top_k), i.e. the executed expert FLOPs over the active-parameter floor. On CPU the tile loop
   computes `tile_rows`-row tiles; on TPU/GPU ragged_dot computes the routed rows.

    python benchmarks/moe.py --num-layers 2 --vocab-size 8192 --num-prompts 16 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence


if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, random_model, roofline, throughput
from jaxserve.bench.datasets import random_dataset

NAME = "moe"
DENSE_TYPES = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
MOE_FIELDS = ("moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size")


def dense_twin(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the dense model a token of `config`'s MoE reads as many weights in: the same decoder
    with one SwiGLU of top_k x the expert width (plus the shared expert's) per layer."""
    expert_width = config.get("moe_intermediate_size", config["intermediate_size"])
    width = config["num_experts_per_tok"] * expert_width + config.get("shared_expert_intermediate_size", 0)
    dense = {key: value for key, value in config.items() if key not in MOE_FIELDS}
    return {**dense, "model_type": DENSE_TYPES[config["model_type"]], "intermediate_size": width,
            "architectures": [f"{DENSE_TYPES[config['model_type']].capitalize()}ForCausalLM"]}


def expert_rows(llm: Any, batch: int, seed: int = 0) -> dict[str, float]:
    """Rows the experts compute for `batch` tokens routed by the first sparse layer's router (random unit-RMS
    hidden states), against the rows routed: the grouped matmul's work over the active floor."""
    import jax
    import jax.numpy as jnp

    from jaxserve.layers import matmul_blocks
    from jaxserve.layers.moe import route, tile_rows, tile_schedule

    runner = llm.llm_engine.runner
    cfg, moe = runner.model_config, runner.model_config.moe
    layer = next(i for i, spec in enumerate(cfg.layers) if spec.feed_forward == "moe")
    router = jnp.asarray(runner.params[f"layers_{layer}"]["mlp"]["router"]["kernel"], jnp.float32)
    hidden = jax.random.normal(jax.random.key(seed), (batch, cfg.hidden_size), jnp.float32)
    _, experts = route(hidden @ router, moe)
    sizes = jnp.bincount(experts.reshape(-1), length=moe.num_experts)
    routed = batch * moe.top_k
    if not matmul_blocks.blocked_matmuls():  # ragged_dot computes the routed rows
        computed = routed
    else:
        rows = tile_rows(routed, moe.num_experts)
        computed = int(tile_schedule(sizes, routed, rows)[0]) * rows
    return {"batch": batch, "routed_rows": routed, "computed_rows": computed, "experts_reached":
            int(jnp.count_nonzero(sizes)), "executed_over_floor": computed / routed}


def measure(model_dir: str, args: argparse.Namespace, records: list) -> dict[str, Any]:
    llm, startup_s = throughput.start_engine(dict(
        model=model_dir, load_format="dummy", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_model_len=args.input_len + args.output_len + 16, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, seed=args.seed))
    result = throughput.run_offline(llm, records, use_tqdm=False)
    decode = [{"batch": b, **roofline.time_decode_step(llm, b, args.input_len)} for b in args.batch_sizes]
    work = [expert_rows(llm, b, args.seed) for b in args.batch_sizes] if llm.llm_engine.runner.model_config.moe else []
    return {"startup_s": startup_s, "output_tok_s": result.output_tokens / result.elapsed_s,
            "elapsed_s": result.elapsed_s, "steps": result.steps, "decode": decode, "expert_work": work,
            "params": dataclasses.asdict(roofline.param_counts(llm.llm_engine.runner.params))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    moe_shapes = [name for name, shape in random_model.SHAPES.items() if shape["model_type"] in DENSE_TYPES]
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=moe_shapes)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    moe_config = random_model.shape_config(args.shape, num_hidden_layers=args.num_layers, vocab_size=args.vocab_size)
    configs = {"moe": moe_config, "dense": dense_twin(moe_config)}
    records = random_dataset(args.num_prompts, args.input_len, args.output_len, args.vocab_size, seed=args.seed)
    payload: dict[str, Any] = {"benchmark": NAME, "argv": argv, "machine": common.machine_info(),
                               "commit": common.commit_at_start(), "shape": args.shape, "configs": configs}
    with tempfile.TemporaryDirectory() as root:
        for name, config in configs.items():
            directory = Path(root) / name
            directory.mkdir()
            (directory / "config.json").write_text(json.dumps(config))
            payload[name] = measure(str(directory), args, records)
    payload["moe_over_dense_throughput"] = payload["moe"]["output_tok_s"] / payload["dense"]["output_tok_s"]
    payload["moe_over_dense_step"] = {
        m["batch"]: m["step_s"] / d["step_s"] for m, d in zip(payload["moe"]["decode"], payload["dense"]["decode"])}
    common.write_result(NAME, payload, args.result_file)
    report(payload)
    return payload


def report(payload: dict[str, Any]) -> None:
    moe, dense = payload["moe"], payload["dense"]
    rows = [["offline output tok/s", common.fmt(moe["output_tok_s"], 1), common.fmt(dense["output_tok_s"], 1),
             common.fmt(payload["moe_over_dense_throughput"])]]
    for m, d in zip(moe["decode"], dense["decode"]):
        rows.append([f"decode step, batch {m['batch']} (ms)", common.fmt(1000 * m["step_s"]),
                     common.fmt(1000 * d["step_s"]), common.fmt(m["step_s"] / d["step_s"])])
    print(common.format_table(["", "MoE", "dense twin", "MoE / dense"], rows))
    for work in moe["expert_work"]:
        print(f"batch {work['batch']}: {work['routed_rows']} rows routed to {work['experts_reached']} experts, "
              f"{work['computed_rows']} computed ({work['executed_over_floor']:.2f}x the active floor)")


if __name__ == "__main__":
    main()

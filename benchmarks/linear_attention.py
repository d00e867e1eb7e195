"""A hybrid linear-attention decoder against the dense decoder of the same width, on one machine in one run (issue 48).

Two random-weight models (`load_format="dummy"`) of `--layers` layers, the same residual width, attention heads and
MLP: Qwen3.5's shape (`qwen3_5_text`: three Gated DeltaNet layers per gated full-attention layer, a per-sequence
state and no pages in the former) and Qwen3's (`qwen3`: every layer full attention over the pages). For each, the
decode step at `--batch` sequences at each of `--contexts` tokens (`roofline.time_decode_step`, median of its
repeats) as output tokens per second, and the cache bytes one sequence of that context holds (KV pages of the
full-attention layers, plus the hybrid's state slots).

    python benchmarks/linear_attention.py --contexts 256 2048 8192 --batch 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline, throughput

NAME = "linear-attention"


def model_configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    common_fields = {"hidden_size": args.hidden_size, "intermediate_size": 3 * args.hidden_size,
                     "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": 2,
                     "head_dim": args.head_dim, "vocab_size": args.vocab_size, "max_position_embeddings": 16384,
                     "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}
    hybrid = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], **common_fields,
              "linear_num_key_heads": args.heads, "linear_num_value_heads": 2 * args.heads,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "full_attention_interval": 4, "partial_rotary_factor": 0.25}
    dense = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **common_fields}
    return {"hybrid": hybrid, "dense": dense}


def measure(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    longest = max(args.contexts)
    pages = args.batch * -(-longest // args.page_size) + 1
    llm, startup_s = throughput.start_engine(dict(
        model=model_dir, load_format="dummy", dtype=args.dtype, max_num_seqs=args.batch, max_model_len=longest,
        page_size=args.page_size, num_kv_pages=pages, enable_prefix_caching=False, seed=args.seed,
        decode_batch_buckets=(args.batch,)))
    plan = llm.llm_engine.runner.kv_plan
    token_bytes = plan.groups[0].page_bytes / plan.page_size
    state_bytes = plan.state_slot_bytes
    result = {"startup_s": startup_s, "kv_bytes_per_token": token_bytes, "state_bytes_per_seq": state_bytes,
              "contexts": {}}
    for context in args.contexts:
        step_s = roofline.time_decode_step(llm, args.batch, context)["step_s"]
        result["contexts"][context] = {"decode_step_s": step_s, "output_tok_s": args.batch / step_s,
                                       "bytes_per_seq": context * token_bytes + state_bytes}
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    configs = model_configs(args)
    payload: dict[str, Any] = {"benchmark": NAME, "argv": argv, "machine": common.machine_info(),
                               "commit": common.commit_at_start(), "configs": configs}
    for arm, config in configs.items():
        with tempfile.TemporaryDirectory() as root:
            (Path(root) / "config.json").write_text(json.dumps(config))
            payload[arm] = measure(root, args)
    common.write_result(NAME, payload, args.result_file)
    report(payload)
    return payload


def report(payload: dict[str, Any]) -> None:
    hybrid, dense = payload["hybrid"], payload["dense"]
    rows = []
    for context, ours in hybrid["contexts"].items():
        theirs = dense["contexts"][context]
        rows.append([context, common.fmt(ours["output_tok_s"], 1), common.fmt(theirs["output_tok_s"], 1),
                     common.fmt(ours["output_tok_s"] / theirs["output_tok_s"]),
                     common.fmt(ours["bytes_per_seq"] / 2**20, 2), common.fmt(theirs["bytes_per_seq"] / 2**20, 2)])
    print(common.format_table(["context", "hybrid tok/s", "dense tok/s", "hybrid / dense", "hybrid MiB/seq",
                               "dense MiB/seq"], rows))


if __name__ == "__main__":
    main()

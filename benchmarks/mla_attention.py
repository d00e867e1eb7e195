"""Multi-head Latent Attention absorbed against decompressed, on one machine in one run (issue 47).

A 2-layer model with DeepSeek-V3's attention (128 heads, a 512 + 64 latent row, 128 + 64 query dims, 128 value
dims, a 1536 query latent, YaRN) around a `--hidden-size` residual stream and dense MLPs, random weights
(`load_format="dummy"`), served through `LLM` twice: with every step absorbed (queries moved into latent space,
attention over the latent rows) and with every step decompressed (each block of latent rows expanded into every
head's keys and values, `layers/mla.decompressed_attention`). Measured for each:

1. a prefill of one prompt of each `--prefill-lens` tokens (median of `--repeats`, after a warm call);
2. the decode step at `--batch` sequences of `--context` tokens (`roofline.time_decode_step`);
3. offline throughput: `--num-prompts` prompts of `--input-len` tokens, `--output-len` outputs each.

    python benchmarks/mla_attention.py --prefill-lens 16 64 256 1024 --batch 8 --context 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline, throughput
from jaxserve.bench.datasets import random_dataset

NAME = "mla-attention"
ARMS = {"absorbed": 1 << 30, "decompressed": 1}  # each arm's DECOMPRESS_MIN_TOKENS, on every platform


def model_config(hidden_size: int, vocab_size: int) -> dict[str, Any]:
    """DeepSeek-V3's attention in a 2-layer dense model."""
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": 2, "num_attention_heads": 128,
            "num_key_value_heads": 128, "vocab_size": vocab_size, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 2,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "n_group": 1,
            "topk_group": 1, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                "mscale_all_dim": 1.0}}


def time_prefill(llm: Any, length: int, repeats: int, vocab_size: int) -> float:
    """Median seconds of a one-prompt generate of `length` tokens and one output token (a prefill)."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = [{"prompt_token_ids": [(7 * i + 3) % vocab_size for i in range(length)]}]
    llm.generate(prompt, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(model_dir: str, arm: str, args: argparse.Namespace, records: list) -> dict[str, Any]:
    from jaxserve.layers import mla

    mla.DECOMPRESS_MIN_TOKENS = dict.fromkeys(("cpu", "gpu", "tpu"), ARMS[arm])  # read as the steps are traced
    longest = max(args.prefill_lens)
    llm, startup_s = throughput.start_engine(dict(
        model=model_dir, load_format="dummy", dtype=args.dtype, max_num_seqs=args.batch,
        max_model_len=max(longest, args.context, args.input_len + args.output_len) + 16,
        max_num_batched_tokens=longest, enable_prefix_caching=False, seed=args.seed))
    prefill = {length: time_prefill(llm, length, args.repeats, args.vocab_size) for length in args.prefill_lens}
    decode = roofline.time_decode_step(llm, args.batch, args.context)
    result = throughput.run_offline(llm, records, use_tqdm=False)
    return {"startup_s": startup_s, "prefill_s": prefill, "decode_step_s": decode["step_s"],
            "output_tok_s": result.output_tokens / result.elapsed_s}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    config = model_config(args.hidden_size, args.vocab_size)
    records = random_dataset(args.num_prompts, args.input_len, args.output_len, args.vocab_size, seed=args.seed)
    payload: dict[str, Any] = {"benchmark": NAME, "argv": argv, "machine": common.machine_info(),
                               "commit": common.commit_at_start(), "config": config}
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "config.json").write_text(json.dumps(config))
        for arm in ARMS:
            payload[arm] = measure(root, arm, args, records)
    common.write_result(NAME, payload, args.result_file)
    report(payload)
    return payload


def report(payload: dict[str, Any]) -> None:
    absorbed, decompressed = payload["absorbed"], payload["decompressed"]
    rows = [[f"prefill of {length} tokens (ms)", common.fmt(1000 * absorbed["prefill_s"][length]),
             common.fmt(1000 * decompressed["prefill_s"][length]),
             common.fmt(decompressed["prefill_s"][length] / absorbed["prefill_s"][length])]
            for length in absorbed["prefill_s"]]
    rows.append(["decode step (ms)", common.fmt(1000 * absorbed["decode_step_s"]),
                 common.fmt(1000 * decompressed["decode_step_s"]),
                 common.fmt(decompressed["decode_step_s"] / absorbed["decode_step_s"])])
    rows.append(["offline output tok/s", common.fmt(absorbed["output_tok_s"], 1),
                 common.fmt(decompressed["output_tok_s"], 1),
                 common.fmt(decompressed["output_tok_s"] / absorbed["output_tok_s"])])
    print(common.format_table(["", "absorbed", "decompressed", "decompressed / absorbed"], rows))


if __name__ == "__main__":
    main()

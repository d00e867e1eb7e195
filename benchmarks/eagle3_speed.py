"""What EAGLE-3 speculation costs per step on a device: a published shape with random weights (`load_format="dummy"`)
and a random EAGLE-3 head of that shape (written to a temporary directory), each step timed on its warm-up
inputs (the scratch page: weights and activations, no context to attend over) per batch bucket: a plain decode
step, the head's proposal of K drafts, the verify forward over K + 1 tokens, and the keeping of its hidden states.
The ratio (proposal + verify + keep) / decode is the mean tokens per verify step a head must reach to pay; the
acceptance itself is `benchmarks/spec_decode.py`'s, with a trained head.

    python benchmarks/eagle3_speed.py                                   # llama-3.1-8b, bf16, K = 3
    python benchmarks/eagle3_speed.py --num-layers 2 --vocab-size 4096 --dtype float32 --batch-sizes 1 4  # a dry run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import common, random_model
from benchmarks.timing import time_fn

NAME = "eagle3_speed"


def write_head(path: str, config: dict[str, Any], draft_vocab: int, dtype: str, seed: int) -> str:
    """A random head for the target `config` (its sizes, vLLM's default layers), weights of scale 0.02."""
    from jaxserve.spec_decode.eagle3 import Eagle3Config, checkpoint_shapes, default_aux_layers, write_checkpoint
    from jaxserve.models import llama
    from transformers import LlamaConfig

    hf = {key: config[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta",
                                       "max_position_embeddings") if key in config}
    hf.update(draft_vocab_size=draft_vocab, tie_word_embeddings=False, hidden_act="silu")
    layers = default_aux_layers(config["num_hidden_layers"])
    layer = llama.parse_config(LlamaConfig(**hf, num_hidden_layers=1))
    head = Eagle3Config(layer, draft_vocab, layers, config["hidden_size"])
    rng = np.random.default_rng(seed)
    store = np.dtype("float16") if dtype == "bfloat16" else np.dtype("float32")
    tensors = {name: (np.zeros(shape, np.int64) if name == "d2t" else
                      np.ones(shape, store) if len(shape) == 1 else
                      (0.02 * rng.standard_normal(shape, np.float32)).astype(store))
               for name, shape in checkpoint_shapes(head).items()}
    write_checkpoint(path, tensors, {**hf, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}})
    return path


def step_seconds(llm: Any, name: str, rows: int, repeats: int) -> float:
    """Median seconds of step `name` on its warm-up input of `rows` rows (its first, for the keep step: a verify
    call's width)."""
    steps = llm.llm_engine.runner.steps
    inputs = [example for example in steps[name].examples() if len(example.slots) == rows][-1]
    return time_fn(lambda: steps.run(name, inputs), warmup=2, repeats=repeats, min_sample_s=0.02).median_s


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=list(random_model.SHAPES))
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=common.DEFAULT_SEED)
    parser.add_argument("--result-file", default=None)
    argv, args = common.start(parser, argv)
    from jaxserve import LLM

    overrides = {key: value for key, value in (("num_hidden_layers", args.num_layers),
                                               ("vocab_size", args.vocab_size)) if value is not None}
    work = tempfile.mkdtemp(prefix="eagle3-speed-")
    model = random_model.write_config(f"{work}/model", args.shape, **overrides)
    config = random_model.shape_config(args.shape, **overrides)
    head = write_head(f"{work}/head", config, min(args.draft_vocab, config["vocab_size"]), args.dtype, args.seed)
    buckets = tuple(sorted(set(args.batch_sizes)))
    llm = LLM(model, load_format="dummy", dtype=args.dtype, max_num_seqs=max(buckets), decode_batch_buckets=buckets,
              max_model_len=256, max_num_batched_tokens=256, num_kv_pages=max(buckets) * 16 + 1,
              speculative_config={"method": "eagle3", "model": head,
                                  "num_speculative_tokens": args.num_speculative_tokens,
                                  "disable_by_batch_size": None})
    rows = []
    for batch in buckets:
        seconds = {name: step_seconds(llm, name, batch, args.repeats)
                   for name in ("decode", "head_propose", "verify", "head_keep")}
        speculative = seconds["head_propose"] + seconds["verify"] + seconds["head_keep"]
        rows.append({"batch": batch, **{f"{name}_ms": 1e3 * value for name, value in seconds.items()},
                     "break_even_tokens_per_verify": speculative / seconds["decode"]})
    print(common.format_table(["batch", "decode ms", "propose ms", "verify ms", "keep ms", "break-even tokens/verify"],
                              [[row["batch"], *(common.fmt(row[f"{name}_ms"], 2) for name in (
                                  "decode", "head_propose", "verify", "head_keep")),
                                common.fmt(row["break_even_tokens_per_verify"])] for row in rows]))
    payload = {"shape": args.shape, "overrides": overrides, "dtype": args.dtype, "k": args.num_speculative_tokens,
               "draft_vocab": min(args.draft_vocab, config["vocab_size"]), "rows": rows}
    path = common.write_result(NAME, payload, args.result_file, argv)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()

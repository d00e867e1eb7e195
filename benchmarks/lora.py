"""The cost of LoRA per step: one offline batch through the base model alone, then through a LoRA engine with every
row on the base model, and with the rows spread over `--num-adapters` adapters (rank `--lora-rank` on every
projection, random weights in PEFT's format, written by `write_random_adapter`). Output tokens/s of each, as ratios
to the base engine, in one run on one machine. The warm-up requests use prompts of their own: a timed prompt found in
the prefix cache would start decoding while the others prefill, adding decode calls to one run and not the others.

    python benchmarks/lora.py --num-prompts 32 --input-len 128 --output-len 64
    python benchmarks/lora.py --shape llama-3.1-8b --dtype bfloat16 --num-prompts 64  # a GPU: the 8B stand-in
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common

NAME = "lora"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, config, rank: int, seed: int, scale: float = 0.02) -> str:
    """A PEFT-format adapter of `config` (a jaxserve ModelConfig) with random A and B on every projection."""
    from safetensors.numpy import save_file

    from jaxserve.lora.peft_format import MLP_PROJECTIONS, module_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in TARGETS:
            if target in MLP_PROJECTIONS and config.layers[layer].feed_forward != "dense":
                continue
            fan_in, fan_out = module_shapes(config, target)
            module = "mlp" if target in MLP_PROJECTIONS else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * scale).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * scale).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    return path


def timed_generate(llm, prompts: list[list[int]], output_len: int, loras) -> dict:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    hits = llm.llm_engine.stats().prefix_cache_hits
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "prefix_cache_hits": llm.llm_engine.stats().prefix_cache_hits - hits}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    common.add_engine_args(parser, max_num_seqs=32, max_model_len=512)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--shape", default=None, help="a random_model.py shape with random weights drawn on the "
                                                      "device (load_format=dummy) instead of --model")
    argv, args = common.start(parser, argv)
    from benchmarks import random_model
    from jaxserve import LLM, LoRARequest
    from jaxserve.loading import model_config, resolve_model

    scratch = tempfile.TemporaryDirectory()
    options = common.engine_options(args)
    if args.shape is not None:
        options |= dict(model=random_model.write_config(scratch.name, args.shape), load_format="dummy")
    config = model_config(resolve_model(options["model"]))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, config.vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]
    warmup = [rng.integers(3, config.vocab_size, args.input_len).tolist() for _ in range(max(2, args.num_adapters))]
    results = {}
    llm = LLM(**options)
    timed_generate(llm, warmup[:2], 4, None)  # first requests: anything lazy happens here, not in the timing
    results["base engine"] = timed_generate(llm, prompts, args.output_len, None)
    del llm
    gc.collect()  # the base engine's device memory back before the LoRA engine sizes its KV pool
    with tempfile.TemporaryDirectory() as root:
        adapters = [LoRARequest(f"adapter{i}", i + 1, write_random_adapter(f"{root}/{i}", config, args.lora_rank, i))
                    for i in range(args.num_adapters)]
        llm = LLM(**options, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.lora_rank)
        timed_generate(llm, warmup[:len(adapters)], 4, adapters)  # every adapter read and in its slot
        results["LoRA engine, base rows"] = timed_generate(llm, prompts, args.output_len, None)
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        results[f"LoRA engine, {args.num_adapters} adapters mixed"] = timed_generate(llm, prompts, args.output_len,
                                                                                   mixed)
    base = results["base engine"]["output_tok_s"]
    rows = [(name, common.fmt(r["output_tok_s"], 1), common.fmt(r["output_tok_s"] / base, 3), common.fmt(r["seconds"]),
             r["prefix_cache_hits"]) for name, r in results.items()]
    print(common.format_table(["run", "output tok/s", "vs base", "seconds", "prefix-cache hits"], rows))
    payload = {"argv": argv, "commit": common.commit_at_start(), "machine": common.machine_info(),
               "model": args.shape or common.model_label(args.model), "results": results}
    common.write_result(NAME, payload, args.result_file)
    scratch.cleanup()
    return payload


if __name__ == "__main__":
    main()

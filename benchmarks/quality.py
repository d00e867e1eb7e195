"""Accuracy of quantization modes against the float model on the shipped prompts (jaxserve/bench/data/prompts.jsonl,
rendered with the chat template), greedy decoding.

For every mode, against the first mode (the float reference):

* greedy agreement: the mean common prefix of the `--max-tokens` (32) greedy tokens each prompt gets (EOS ignored,
  so every output has that many), and the share of prompts whose tokens are all equal;
* teacher forcing: the mean absolute difference of the log-probability the reference gave its own greedy tokens
  and the one the mode gives those same tokens after the same context (one forward over prompt + reference tokens
  with the mode's serving params, `jaxserve.models.forward`), and the share of positions whose argmax agrees
  (`--no-teacher-forcing` leaves it out: greedy agreement alone).

A mode is a name and engine options (`LLM(**options)`); built in: `float` ({}), `int8` ({quantization: int8}),
`int8-float-embedding` (int8 with the embedding table, and so the tied LM head, kept float), `kv-int8` and
`kv-fp8` ({kv_cache_dtype: int8 / fp8}), and `awq`: the model written once as an AutoAWQ-format checkpoint
(`loading.awq.write_awq_checkpoint`: RTN int4 in AWQ format, groups of 64 input rows, *no activation-aware
scaling*, so a lower bound on what a real AutoAWQ checkpoint of the model would score) under the checkpoint root
and served with quantization="awq". Others come from the command line as `NAME:key=value,key=value`.
Teacher forcing runs the engine's own model, attention backend and KV page dtype over a fresh pool (the tokens
are written, quantized if the mode says so, then read back, as in a prefill), so it measures weight and KV
modes alike; greedy agreement goes through the whole engine.

    python benchmarks/quality.py --modes float int8 int8-float-embedding
    python benchmarks/quality.py --modes float kv-int8 kv-fp8 --num-prompts 12
    python benchmarks/quality.py --modes float awq
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench.datasets import DEFAULT_PROMPTS_FILE, chat_messages, load_prompt_file, render_chat

NAME = "quality"
BUILT_IN = {"float": {}, "int8": {"quantization": "int8"},
            "int8-float-embedding": {"quantization": "int8", "_float_embedding": True},
            "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
            "awq": {"quantization": "awq", "_awq_group_size": 64}}  # 64: SmolLM2-135M's 576 features are 4.5 x 128
PAD_TO = 64  # teacher-forcing sequences are right-padded to a multiple of this (causal: padding changes nothing)


def parse_mode(spec: str) -> tuple[str, dict[str, Any]]:
    """`int8` (built in) or `NAME:key=value,...` -> (name, engine options); values are int, float, bool or str."""
    if spec in BUILT_IN:
        return spec, dict(BUILT_IN[spec])
    name, _, rest = spec.partition(":")
    if not rest:
        raise ValueError(f"unknown mode {spec!r}: built in are {sorted(BUILT_IN)}, others are NAME:key=value,...")
    options: dict[str, Any] = {}
    for item in rest.split(","):
        key, _, value = item.partition("=")
        for kind in (int, float):
            try:
                options[key] = kind(value)
                break
            except ValueError:
                pass
        else:
            options[key] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return name, options


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def teacher_forced_logprobs(llm: Any, sequences: list[list[int]], starts: list[int]) -> list[tuple[list, list]]:
    """For each sequence: (log-probabilities of tokens[start:] given what precedes them, argmax at those positions),
    from the engine's serving params (one device) through `models.forward` with its attention backend over a fresh
    pool of its KV page dtype, every sequence padded to the longest's length (one compiled forward)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.engine.kv_plan import empty_kv_cache
    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.models import forward

    runner = llm.llm_engine.runner
    if runner.tp.size != 1:
        raise ValueError("teacher forcing runs on one device")
    cfg, page_size = runner.model_config, runner.page_size
    backend = runner.backend
    run = jax.jit(forward, static_argnums=(1, 2), static_argnames=("dtype",))
    results = []
    length = -(-max(map(len, sequences)) // PAD_TO) * PAD_TO  # one length, one compile: later tokens change nothing
    for tokens, start in zip(sequences, starts):
        pages = length // page_size
        cache = empty_kv_cache([pages + 1] * cfg.num_layers, cfg, runner.tp, backend, page_size, runner.dtype,
                               runner.allocator)
        ids = np.zeros(length, np.int32)
        ids[:len(tokens)] = tokens
        meta = AttentionMetadata(positions=jnp.arange(length, dtype=jnp.int32)[None],
                                 slot_mapping=(jnp.arange(length, dtype=jnp.int32) + page_size)[None],
                                 page_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                                 context_lens=jnp.array([len(tokens)], jnp.int32),
                                 query_lens=jnp.array([len(tokens)], jnp.int32))
        logits, _ = run(runner.params, cfg, backend, jnp.asarray(ids)[None], cache, meta, dtype=runner.dtype)
        logp = np.asarray(jax.nn.log_softmax(logits[0, start - 1:len(tokens) - 1].astype(jnp.float32), axis=-1))
        targets = np.asarray(tokens[start:])
        results.append((logp[np.arange(len(targets)), targets].tolist(), logp.argmax(-1).tolist()))
    return results


def awq_checkpoint(model: str | None, group: int) -> str:
    """An AutoAWQ-format checkpoint of `model` (the default model, or a HF directory of float safetensors) with RTN
    int4 groups of `group` (no activation-aware scaling), written once under the checkpoint root."""
    import glob
    import json
    import shutil
    from pathlib import Path

    from jaxserve.loading import DEFAULT_MODEL, checkpoint_root, default_gguf_path
    from jaxserve.loading.awq import write_awq_checkpoint

    name = DEFAULT_MODEL if model in (None, DEFAULT_MODEL) else Path(model).name
    target = checkpoint_root() / f"{name}-awq-rtn-g{group}"
    if (target / "config.json").exists():
        return str(target)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if model in (None, DEFAULT_MODEL):
        from jaxserve.loading.gguf_convert import read_gguf

        hf_config, state, tokenizer = read_gguf(default_gguf_path())
        write_awq_checkpoint(partial, state, json.loads(hf_config.to_json_string()), group)
        tokenizer.save_pretrained(str(partial))
    else:
        from safetensors.numpy import load_file

        state = {k: v for f in sorted(glob.glob(f"{model}/*.safetensors")) for k, v in load_file(f).items()}
        write_awq_checkpoint(partial, state, json.loads((Path(model) / "config.json").read_text()), group)
        for file in Path(model).iterdir():
            if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", INDEX):
                shutil.copy(file, partial / file.name)
    partial.rename(target)
    return str(target)


INDEX = "model.safetensors.index.json"


def teacher_forced_row(llm: Any, prompts: list[list[int]], reference: dict[str, Any]) -> dict[str, float]:
    """The teacher-forcing figures of `llm`'s mode against `reference` (its greedy tokens, and the logprobs it gave
    them, which the reference mode's own call records)."""
    forced = teacher_forced_logprobs(llm, [p + t for p, t in zip(prompts, reference["tokens"])],
                                     [len(p) for p in prompts])
    if "logprobs" not in reference:
        reference["logprobs"] = [lp for lp, _ in forced]
    diffs = [abs(a - b) for (lp, _), ref in zip(forced, reference["logprobs"]) for a, b in zip(lp, ref)]
    agree = [int(a == b) for (_, argmax), ref in zip(forced, reference["tokens"]) for a, b in zip(argmax, ref)]
    return {"mean_abs_logprob_diff": statistics.mean(diffs), "max_abs_logprob_diff": max(diffs),
            "teacher_forced_argmax_agreement": statistics.mean(agree),
            "mean_reference_logprob": statistics.mean(lp for lps in reference["logprobs"] for lp in lps)}


def build_engine(options: dict[str, Any], mode_options: dict[str, Any]):
    from jaxserve import LLM
    from jaxserve.layers import quant_dense

    mode_options = dict(mode_options)
    if "_awq_group_size" in mode_options:
        options = {**options, "model": awq_checkpoint(options.get("model"), mode_options.pop("_awq_group_size"))}
    float_embedding = mode_options.pop("_float_embedding", False)
    saved = quant_dense.QUANTIZE_EMBEDDING
    quant_dense.QUANTIZE_EMBEDDING = not float_embedding  # read while the weights are quantized at load
    try:
        return LLM(**{**options, **mode_options}, warmup=False)
    finally:
        quant_dense.QUANTIZE_EMBEDDING = saved


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["float", "int8", "int8-float-embedding"],
                        help="the first is the reference; built in: " + ", ".join(BUILT_IN))
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default: all)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS_FILE))
    parser.add_argument("--teacher-forcing", action=argparse.BooleanOptionalAction, default=True,
                        help="also score the reference's tokens with each mode (one more forward per mode)")
    common.add_engine_args(parser, max_num_seqs=64, max_model_len=1024)
    common.add_common_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    from jaxserve import SamplingParams

    modes = [parse_mode(spec) for spec in args.modes]
    tokenizer = common.load_tokenizer(args.model)
    entries = load_prompt_file(args.prompts_file)[:args.num_prompts]
    prompts = [render_chat(tokenizer, chat_messages(entry))[1] for entry in entries]
    prompts = [p for p in prompts if len(p) + args.max_tokens <= args.max_model_len]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = common.engine_options(args)
    options.pop("quantization", None)  # each mode says its own
    reference: dict[str, Any] = {}
    rows = []
    for name, mode_options in modes:
        started = time.perf_counter()
        llm = build_engine(options, mode_options)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        if not reference:
            reference["tokens"] = tokens
        prefixes = [common_prefix(t, r) for t, r in zip(tokens, reference["tokens"])]
        row = {"mode": name, "options": mode_options, "mean_common_prefix": statistics.mean(prefixes),
               "min_common_prefix": min(prefixes),
               "all_equal": sum(p == args.max_tokens for p in prefixes) / len(prefixes)}
        if args.teacher_forcing:
            row |= teacher_forced_row(llm, prompts, reference)
        rows.append({**row, "seconds": time.perf_counter() - started})
        forced = f", |d logprob| {row['mean_abs_logprob_diff']:.4f}" if args.teacher_forcing else ""
        print(f"{name}: mean common prefix {row['mean_common_prefix']:.2f} / {args.max_tokens}{forced}", flush=True)
        del llm
    payload = {"model": common.model_label(args.model), "dtype": args.dtype, "num_prompts": len(prompts),
               "max_tokens": args.max_tokens, "reference": modes[0][0], "rows": rows}
    path = common.write_result(NAME, payload, args.result_file, argv)
    print(common.format_table(
        ["mode", "mean common prefix", "min", "all 32 equal", "mean |d logprob|", "max |d logprob|",
         "forced argmax agree"],
        [[r["mode"], r["mean_common_prefix"], r["min_common_prefix"], r["all_equal"],
          *(r.get(key, "-") for key in ("mean_abs_logprob_diff", "max_abs_logprob_diff",
                                        "teacher_forced_argmax_agreement"))] for r in rows]))
    print(f"result: {path}")
    return payload


if __name__ == "__main__":
    main()

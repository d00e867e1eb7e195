"""KV cache quantization quality (issue 13): each `kv_cache_dtype` against the float KV cache on the shipped
prompts (benchmarks/data/prompts.jsonl, rendered with the model's chat template, in file order).

For each mode (the model and its weights unchanged, only the KV pages quantized):
* greedy agreement: the mean common prefix of `--max-tokens` greedy tokens with the float run's, through the
  engine (chunked prefill + decode, as served);
* the mean absolute difference of the log-probability the float model gave its own greedy tokens, under teacher
  forcing: one forward over prompt + the float run's greedy tokens through the engine's model and attention
  backend, with a fresh pool of the mode's page dtype (the new tokens are written, quantized, then read back,
  as in a prefill), against the same forward with float pages. The float forward's logprobs are checked against
  the ones the engine reported while generating (`teacher_forcing_check`, max abs difference).

    python benchmarks/kv_quality.py                                 # 12 prompts x 32 tokens, int8 and fp8
    python benchmarks/kv_quality.py --num-prompts 4 --modes int8    # smaller

Writes benchmarks/results/kv_quality.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, datasets

NAME = "kv_quality"
MODES = ("int8", "fp8")


def prompt_token_ids(tokenizer: Any, num_prompts: int,
                     path: str | Path = datasets.DEFAULT_PROMPTS_FILE) -> list[list[int]]:
    """The first `num_prompts` prompts of the file, chat-rendered as the `prompts` workload renders them."""
    entries = datasets.load_prompt_file(path)[:num_prompts]
    return [datasets.render_chat(tokenizer, datasets.chat_messages(entry))[1] for entry in entries]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@functools.partial(jax.jit, static_argnames=("config", "backend", "dtype", "tp", "page_size"))
def _forward_logprobs(params, kv_cache, token_ids, length, *, config, backend, dtype, tp, page_size):
    """log p(token_ids[t + 1] | token_ids[:t + 1]) for t < length - 1, one forward of `[1, T]` tokens over a fresh
    pool whose pages 1.. hold the sequence (page 0: scratch, where padding writes)."""
    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.models import forward

    num_tokens = token_ids.shape[0]
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    pages = -(-num_tokens // page_size)
    meta = AttentionMetadata(positions=index[None], slot_mapping=jnp.where(index < length, page_size + index, 0)[None],
                             page_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                             context_lens=length[None], query_lens=length[None])
    logits, _ = forward(params, config, backend, token_ids[None], kv_cache, meta, None, dtype=dtype, tp=tp)
    logprobs = jax.nn.log_softmax(logits[0], axis=-1)
    return jnp.take_along_axis(logprobs[:-1], token_ids[1:, None], axis=1)[:, 0]


def teacher_forced_logprobs(llm, prompt: list[int], continuation: list[int], padded_len: int) -> np.ndarray:
    """The engine's model (its params, attention backend and KV page dtype) scoring `continuation` after `prompt`:
    the log-probability of each continuation token. Single device only."""
    runner = llm.llm_engine.runner
    if runner.tp.size != 1:
        raise ValueError("teacher forcing runs on one device")
    tokens = prompt + continuation
    if len(tokens) > padded_len:
        raise ValueError(f"{len(tokens)} tokens do not fit padded_len={padded_len}")
    page_size = runner.page_size
    shape = runner.backend.pool_shape(padded_len // page_size + 2, page_size, runner.tp.pool_heads(runner.config),
                                      runner.config.head_dim)
    kv_cache = [tuple(runner.backend.empty_pool(shape, runner.dtype) for _ in "kv")
                for _ in range(runner.config.num_layers)]
    ids = np.zeros(padded_len, np.int32)
    ids[:len(tokens)] = tokens
    out = _forward_logprobs(runner.params, kv_cache, ids, np.int32(len(tokens)), config=runner.config,
                            backend=runner.backend, dtype=runner.dtype, tp=runner.tp, page_size=page_size)
    return np.asarray(out)[len(prompt) - 1:len(tokens) - 1]


def evaluate(modes: Sequence[str] = MODES, num_prompts: int = 12, max_tokens: int = 32, model: str | None = None,
             max_model_len: int = 512, **engine_options: Any) -> dict[str, Any]:
    """Runs the float reference and each mode; returns {"reference": ..., "modes": {mode: row}}."""
    from jaxserve import LLM, SamplingParams

    options = dict(max_num_seqs=4, max_model_len=max_model_len, warmup=False, **engine_options)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)

    def run(kv_cache_dtype: str, prompts=None):
        llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **options)
        if prompts is None:
            prompts = prompt_token_ids(llm.get_tokenizer(), num_prompts)
        outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                      use_tqdm=False)]
        return llm, prompts, outputs

    llm, prompts, float_outputs = run("auto")
    float_tokens = [o.token_ids for o in float_outputs]
    forced = {"auto": [teacher_forced_logprobs(llm, p, t, max_model_len) for p, t in zip(prompts, float_tokens)]}
    reported = [np.array([lp[token] for lp, token in zip(o.logprobs, o.token_ids)]) for o in float_outputs]
    check = max(float(np.abs(f - r).max()) for f, r in zip(forced["auto"], reported))
    capacity = {"auto": llm.llm_engine.stats().kv_cache_capacity_tokens}
    del llm
    gc.collect()
    rows = {}
    for mode in modes:
        llm, _, outputs = run(mode, prompts)
        tokens = [o.token_ids for o in outputs]
        forced[mode] = [teacher_forced_logprobs(llm, p, t, max_model_len) for p, t in zip(prompts, float_tokens)]
        prefixes = [common_prefix(a, b) for a, b in zip(tokens, float_tokens)]
        diffs = np.concatenate([np.abs(q - f) for q, f in zip(forced[mode], forced["auto"])])
        rows[mode] = {"mean_common_prefix": float(np.mean(prefixes)), "common_prefixes": prefixes,
                      "logprob_mad": float(diffs.mean()), "logprob_max_abs_diff": float(diffs.max()),
                      "kv_cache_capacity_tokens": llm.llm_engine.stats().kv_cache_capacity_tokens,
                      "page_bytes": llm.llm_engine.runner.page_bytes}
        del llm
        gc.collect()
    return {"num_prompts": len(prompts), "max_tokens": max_tokens, "teacher_forcing_check": check,
            "reference_capacity_tokens": capacity["auto"], "modes": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"| kv_cache_dtype | mean common prefix (of {result['max_tokens']}) | mean abs logprob diff "
             "(teacher forcing) | max abs logprob diff |",
             "|---|---|---|---|"]
    for mode, row in result["modes"].items():
        lines.append(f"| {mode} | {row['mean_common_prefix']:.2f} | {row['logprob_mad']:.4f} | "
                     f"{row['logprob_max_abs_diff']:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default=None, help="default: benchmarks/results/kv_quality.json")
    args = parser.parse_args(argv)
    result = evaluate(args.modes, args.num_prompts, args.max_tokens, args.model, dtype=args.dtype)
    path = common.write_result(NAME, {"config": vars(args), "commit": common.git_commit(), **result},
                               args.output, argv if argv is not None else sys.argv[1:])
    print(markdown(result))
    print(f"teacher forcing check (float forward vs the engine's reported logprobs): "
          f"{result['teacher_forcing_check']:.2e}; written to {path}")


if __name__ == "__main__":
    main()

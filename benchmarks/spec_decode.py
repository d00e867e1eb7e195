"""Speculative decoding: single-stream speed with and without it, and the acceptance rate of each method.

Two prompt sets, rendered with the model's chat template: `copy` (benchmarks/data/copy_prompts.jsonl: repeat,
edit or rename a given text, where the answer copies the prompt and prompt lookup has much to find) and `chat`
(the shipped jaxserve/bench/data/prompts.jsonl, where it has little). For each method (`plain`: no speculation;
`ngram`: prompt lookup; `draft`: a draft model, `--draft`, default the target itself, which checks the verify step
rather than gaining speed; `eagle3`: an EAGLE-3 head, `--eagle3 DIR`, e.g. one `benchmarks/train_eagle3.py` trained;
a method may name its own K after a colon, `eagle3:5`) one engine with `max_num_seqs=1` answers every prompt of each
set in turn (or, with `--concurrency B`, all of a set's prompts in one batch of B slots: where speculation stops
paying), greedy, up to `--max-tokens` tokens (EOS ends an answer). Reported per method and set: output tokens per
second of generation (prefill included, as a user sees it), the ratio to `plain` in the same run, the acceptance
rate, the mean tokens per verify step, and whether every answer equals plain decoding's token for token. With
`--lora DIR` every request runs with that PEFT adapter (a speculative head proposes without it: what that costs in
acceptance).

    python benchmarks/spec_decode.py                       # plain and ngram, K = 4, both prompt sets
    python benchmarks/spec_decode.py --methods plain ngram draft --num-prompts 4
    python benchmarks/spec_decode.py --concurrency 8      # batched: 8 sequences decode together
    python benchmarks/spec_decode.py --methods plain ngram:3 eagle3:2 eagle3:3 eagle3:5 \
        --eagle3 benchmarks/results/eagle3-smollm2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench import datasets

NAME = "spec_decode"
COPY_PROMPTS = Path(__file__).resolve().parent / "data" / "copy_prompts.jsonl"
METHODS = ("plain", "ngram", "draft", "eagle3")


def prompt_sets(tokenizer: Any, num_prompts: int, max_input_len: int) -> dict[str, list[list[int]]]:
    sets = {}
    for name, path in (("copy", COPY_PROMPTS), ("chat", datasets.DEFAULT_PROMPTS_FILE)):
        entries = datasets.load_prompt_file(path)[:num_prompts]
        token_ids = [datasets.render_chat(tokenizer, datasets.chat_messages(entry))[1] for entry in entries]
        sets[name] = [ids for ids in token_ids if len(ids) <= max_input_len]
    return sets


def method_and_k(label: str, args: argparse.Namespace) -> tuple[str, int]:
    """`ngram` or `eagle3:5`: the method and its K (default `--num-speculative-tokens`)."""
    method, _, k = label.partition(":")
    if method not in METHODS or (k and not k.isdigit()):
        raise SystemExit(f"--methods: {label!r} is not one of {METHODS}, optionally with ':K'")
    if method == "eagle3" and not args.eagle3:
        raise SystemExit("--methods eagle3 needs --eagle3 DIR (an EAGLE-3 head)")
    return method, int(k) if k else args.num_speculative_tokens


def speculative_config(label: str, args: argparse.Namespace) -> dict[str, Any] | None:
    method, k = method_and_k(label, args)
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}
    if method == "eagle3":
        return {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": k}
    from jaxserve.loading import DEFAULT_MODEL

    return {"model": args.draft or args.model or DEFAULT_MODEL, "num_speculative_tokens": k}


def run_method(method: str, sets: dict[str, list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    """One engine; every prompt of every set answered alone, in turn."""
    import gc

    from jaxserve import LLM, SamplingParams

    options = {**common.engine_options(args), "max_num_seqs": args.concurrency,
               "speculative_config": speculative_config(method, args)}
    adapter = None
    if args.lora:
        from jaxserve import LoRARequest

        options.update(enable_lora=True, max_lora_rank=args.max_lora_rank)
        adapter = LoRARequest("adapter", 1, args.lora)
    started = time.perf_counter()
    llm = LLM(**options)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engine = llm.llm_engine
    llm.generate([sets["chat"][0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # first runs
    result: dict[str, Any] = {"startup_s": startup, "sets": {}}
    for name, prompts in sets.items():
        before = engine.stats()
        seconds, outputs = 0.0, []
        groups = [[prompt] for prompt in prompts] if args.concurrency == 1 else [prompts]
        for group in groups:
            started = time.perf_counter()
            outputs += llm.generate(group, params, use_tqdm=False, lora_request=adapter)
            seconds += time.perf_counter() - started
        after = engine.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        result["sets"][name] = {
            "requests": len(prompts), "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "steps": after.num_steps - before.num_steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_verify": 1 + accepted / drafts if drafts else None,
            "token_ids": [o.outputs[0].token_ids for o in outputs]}
    del llm, engine
    gc.collect()
    return result


def summarize(results: dict[str, Any]) -> list[list[Any]]:
    plain = results.get("plain")
    rows = []
    for method, result in results.items():
        for name, numbers in result["sets"].items():
            ratio = numbers["tokens_per_s"] / plain["sets"][name]["tokens_per_s"] if plain else None
            same = plain["sets"][name]["token_ids"] == numbers["token_ids"] if plain else None
            rows.append([method, name, numbers["output_tokens"], common.fmt(numbers["tokens_per_s"], 1),
                         common.fmt(ratio), common.fmt(numbers["acceptance_rate"]),
                         common.fmt(numbers["tokens_per_verify"]), same])
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    common.add_engine_args(parser, max_num_seqs=1, max_model_len=1024)
    parser.add_argument("--methods", nargs="+", default=["plain", "ngram"], help=f"of {METHODS}, each optionally "
                        "with its own K after a colon (eagle3:5)")
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts of each set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="1: each prompt alone (single stream); B > 1: every prompt of a set in one batch of B slots")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--draft", default=None, help="the draft model (default: the target itself)")
    parser.add_argument("--eagle3", default=None, help="the EAGLE-3 head's directory (method eagle3)")
    parser.add_argument("--lora", default=None, help="a PEFT LoRA adapter every request runs with")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    argv, args = common.start(parser, argv)
    tokenizer = common.load_tokenizer(args.model)
    sets = prompt_sets(tokenizer, args.num_prompts, args.max_model_len - args.max_tokens)
    for label in args.methods:
        method_and_k(label, args)
    results = {method: run_method(method, sets, args) for method in args.methods}
    rows = summarize(results)
    print(common.format_table(["method", "prompts", "tokens", "tok/s", "vs plain", "acceptance", "tokens/verify",
                               "same as plain"], rows))
    payload = {"model": common.model_label(args.model), "methods": results, "summary": rows,
               "options": {key: getattr(args, key) for key in (
                   "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_tokens", "num_prompts",
                   "concurrency", "lora")}}
    path = common.write_result(NAME, payload, args.result_file, argv)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()

"""Benchmark workloads: request records built through a grain pipeline, identical for every engine under test.

Owns the three workloads and their command-line flags:
* `random`: prompts of random token ids with input/output lengths drawn uniformly in
  [len * (1 - range_ratio), len * (1 + range_ratio)] (like `vllm bench --dataset-name random`).
* `prompts`: ~200 natural prompts (benchmarks/data/prompts.jsonl) rendered with the model's chat template.
* `shared-prefix`: many requests over a few long common prefixes, each followed by a random suffix
  (the workload prefix caching should win on).
* `mixed`: short chats of random tokens (`--short-input-range`, default 40-128 prompt tokens) with a fraction
  (`--long-fraction`) of long prompts (`--long-input-range`, default 1,500-2,000), outputs in `--mixed-output-range`
  (16-64); records are categorized "short" and "long" (the workload scheduling for latency targets is measured on).

Every workload is a `grain.MapDataset` pipeline: source -> shuffle(seed) -> map to token ids -> filter by
length. Randomness inside `map` is seeded per record (seed, record index), so a record's tokens do not
depend on the shuffle order. Each pipeline yields `RequestRecord`s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)
DATASETS = ("random", "prompts", "shared-prefix", "mixed")
DEFAULT_PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
PREFIX_STREAM = 1_000_003  # offsets the seeds of shared prefixes away from the per-request seeds


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One benchmark request: what to send and how many tokens to ask for."""

    prompt_token_ids: list[int]
    expected_output_len: int
    prompt_text: str | None = None  # the rendered prompt, when the workload has text
    messages: list[dict[str, str]] | None = None  # the chat messages, for chat endpoints
    category: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _lengths(rng: np.random.Generator, count: int, mean: int, range_ratio: float) -> np.ndarray:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def _fits(max_model_len: int | None, max_input_len: int | None) -> Callable[[RequestRecord], bool]:
    def keep(record: RequestRecord) -> bool:
        if max_input_len is not None and record.prompt_len > max_input_len:
            return False
        return max_model_len is None or record.prompt_len + record.expected_output_len <= max_model_len

    return keep


def _collect(dataset, num_requests: int, name: str) -> list[RequestRecord]:
    records = [record for record in dataset if record is not None][:num_requests]
    if len(records) < num_requests:
        logger.warning("%s: only %d of %d requests fit the length limits", name, len(records), num_requests)
    if not records:
        raise ValueError(f"{name}: no request fits the length limits")
    return records


def _token_range(vocab_size: int, tokenizer: Any = None) -> tuple[int, int]:
    """Token ids to draw random prompts from: the vocabulary above the special tokens."""
    low = 0
    if tokenizer is not None:
        specials = [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None and i < vocab_size // 2]
        low = max(specials, default=-1) + 1
    if low >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token ids")
    return low, vocab_size


def random_dataset(num_requests: int, input_len: int, output_len: int, vocab_size: int, range_ratio: float = 0.0,
                   seed: int = 0, tokenizer: Any = None, max_model_len: int | None = None) -> list[RequestRecord]:
    """`num_requests` prompts of uniformly random token ids (special tokens excluded when a tokenizer is given)."""
    import grain

    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_requests, input_len, range_ratio)
    out_lens = _lengths(rng, num_requests, output_len, range_ratio)
    low, high = _token_range(vocab_size, tokenizer)
    specs = [(i, int(n_in), int(n_out)) for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))]

    def make(spec: tuple[int, int, int]) -> RequestRecord:
        index, n_in, n_out = spec
        tokens = np.random.default_rng([seed, index]).integers(low, high, size=n_in)
        return RequestRecord(tokens.tolist(), n_out, category="random")

    dataset = (grain.MapDataset.source(specs).shuffle(seed=seed).map(make)
               .filter(_fits(max_model_len, None)))
    return _collect(dataset, num_requests, "random")


def mixed_dataset(num_requests: int, long_fraction: float, short_range: Sequence[int], long_range: Sequence[int],
                  output_range: Sequence[int], vocab_size: int, seed: int = 0, tokenizer: Any = None,
                  max_model_len: int | None = None) -> list[RequestRecord]:
    """Short chats and a `long_fraction` of long prompts, in random order, lengths uniform in their ranges."""
    import grain

    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_requests) < long_fraction
    specs = []
    for index, long in enumerate(is_long):
        low, high = long_range if long else short_range
        specs.append((index, "long" if long else "short", int(rng.integers(low, high + 1)),
                      int(rng.integers(output_range[0], output_range[1] + 1))))
    low, high = _token_range(vocab_size, tokenizer)

    def make(spec: tuple[int, str, int, int]) -> RequestRecord:
        index, category, n_in, n_out = spec
        tokens = np.random.default_rng([seed, index]).integers(low, high, size=n_in)
        return RequestRecord(tokens.tolist(), n_out, category=category)

    dataset = grain.MapDataset.source(specs).map(make).filter(_fits(max_model_len, None))
    return _collect(dataset, num_requests, "mixed")


def load_prompt_file(path: str | Path = DEFAULT_PROMPTS_FILE) -> list[dict[str, Any]]:
    """The JSONL prompt file: one {"id", "category", "prompt", optional "system"} object per line."""
    entries = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
                raise ValueError(f"{path}:{line_no}: every line needs a non-empty 'prompt'")
            entries.append(entry)
    return entries


def chat_messages(entry: dict[str, Any]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": entry["system"]}] if entry.get("system") else []
    return messages + [{"role": "user", "content": entry["prompt"]}]


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The chat-template text (with the generation prompt) and its token ids; raw text if there is no template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompts_dataset(num_requests: int, output_len: int, tokenizer: Any, seed: int = 0,
                    path: str | Path = DEFAULT_PROMPTS_FILE, max_model_len: int | None = None,
                    max_input_len: int | None = None) -> list[RequestRecord]:
    """Natural prompts rendered with the chat template; the file is cycled when more requests are asked for."""
    import grain

    entries = load_prompt_file(path)
    if tokenizer is None:
        raise ValueError("the prompts dataset needs a tokenizer")

    def make(entry: dict[str, Any]) -> RequestRecord:
        messages = chat_messages(entry)
        text, ids = render_chat(tokenizer, messages)
        return RequestRecord(ids, output_len, prompt_text=text, messages=messages, category=entry.get("category"))

    repeats = max(1, -(-num_requests // len(entries)) + 1)  # one spare pass to make up for filtered prompts
    dataset = (grain.MapDataset.source(entries).repeat(repeats).shuffle(seed=seed).map(make)
               .filter(_fits(max_model_len, max_input_len)))
    return _collect(dataset, num_requests, "prompts")


def shared_prefix_dataset(num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                          vocab_size: int, range_ratio: float = 0.0, seed: int = 0, tokenizer: Any = None,
                          max_model_len: int | None = None) -> list[RequestRecord]:
    """Request i = prefix[i % num_prefixes] + its own random suffix; shuffled so prefix groups interleave."""
    import grain

    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    suffix_lens = _lengths(rng, num_requests, suffix_len, range_ratio)
    out_lens = _lengths(rng, num_requests, output_len, range_ratio)
    low, high = _token_range(vocab_size, tokenizer)
    prefixes = [np.random.default_rng([seed, PREFIX_STREAM + p]).integers(low, high, size=prefix_len).tolist()
                for p in range(num_prefixes)]
    specs = [(i, i % num_prefixes, int(n_suffix), int(n_out))
             for i, (n_suffix, n_out) in enumerate(zip(suffix_lens, out_lens))]

    def make(spec: tuple[int, int, int, int]) -> RequestRecord:
        index, prefix, n_suffix, n_out = spec
        suffix = np.random.default_rng([seed, index]).integers(low, high, size=n_suffix).tolist()
        return RequestRecord(prefixes[prefix] + suffix, n_out, category=f"prefix-{prefix}")

    dataset = (grain.MapDataset.source(specs).shuffle(seed=seed).map(make)
               .filter(_fits(max_model_len, None)))
    return _collect(dataset, num_requests, "shared-prefix")


# -- command line ------------------------------------------------------------------------------------------


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 64, input_len: int = 128,
                     output_len: int = 64) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=DATASETS, default="random")
    group.add_argument("--num-prompts", type=int, default=num_prompts, help="number of requests")
    group.add_argument("--input-len", type=int, default=input_len, help="random: mean prompt tokens")
    group.add_argument("--output-len", type=int, default=output_len, help="mean output tokens per request")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="random/shared-prefix: lengths uniform in len*(1 +- ratio)")
    group.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS_FILE), help="prompts: the JSONL file")
    group.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    group.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens per prefix")
    group.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: mean unique tokens per request")
    group.add_argument("--long-fraction", type=float, default=0.1, help="mixed: the fraction of long prompts")
    group.add_argument("--short-input-range", type=int, nargs=2, default=[40, 128], metavar=("LOW", "HIGH"),
                       help="mixed: prompt tokens of the short requests")
    group.add_argument("--long-input-range", type=int, nargs=2, default=[1500, 2000], metavar=("LOW", "HIGH"),
                       help="mixed: prompt tokens of the long requests")
    group.add_argument("--mixed-output-range", type=int, nargs=2, default=[16, 64], metavar=("LOW", "HIGH"),
                       help="mixed: output tokens of every request")


def build_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int,
                   max_model_len: int | None = None) -> list[RequestRecord]:
    """The workload the `add_dataset_args` flags describe."""
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.input_len, args.output_len, vocab_size, args.range_ratio,
                              args.seed, tokenizer, max_model_len)
    if args.dataset == "prompts":
        return prompts_dataset(args.num_prompts, args.output_len, tokenizer, args.seed, args.prompts_file,
                               max_model_len)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(args.num_prompts, args.num_prefixes, args.prefix_len, args.suffix_len,
                                     args.output_len, vocab_size, args.range_ratio, args.seed, tokenizer,
                                     max_model_len)
    if args.dataset == "mixed":
        return mixed_dataset(args.num_prompts, args.long_fraction, args.short_input_range, args.long_input_range,
                             args.mixed_output_range, vocab_size, args.seed, tokenizer, max_model_len)
    raise ValueError(f"unknown dataset {args.dataset!r}")


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """The workload flags that matter for `args.dataset`, for result files."""
    keys = {"random": ("num_prompts", "input_len", "output_len", "range_ratio"),
            "prompts": ("num_prompts", "output_len", "prompts_file"),
            "shared-prefix": ("num_prompts", "num_prefixes", "prefix_len", "suffix_len", "output_len", "range_ratio"),
            "mixed": ("num_prompts", "long_fraction", "short_input_range", "long_input_range", "mixed_output_range")}
    return {"dataset": args.dataset, "seed": args.seed, **{k: getattr(args, k) for k in keys[args.dataset]}}


def length_stats(records: Sequence[RequestRecord]) -> dict[str, float]:
    prompt = np.array([r.prompt_len for r in records])
    output = np.array([r.expected_output_len for r in records])
    return {"requests": len(records), "prompt_tokens": int(prompt.sum()), "mean_prompt_len": float(prompt.mean()),
            "max_prompt_len": int(prompt.max()), "expected_output_tokens": int(output.sum())}

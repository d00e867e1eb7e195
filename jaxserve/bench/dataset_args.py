"""The dataset flags of every `jaxserve bench` command (vLLM's names), their checks, and the workload they build."""

from __future__ import annotations

import argparse
from typing import Any

from jaxserve.bench.datasets import (DATASETS, DEFAULT_PROMPTS_FILE, RequestRecord, mixed_dataset,
                                     prefix_repetition_dataset, prompt_file_dataset, random_dataset, sharegpt_dataset)


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 1000) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", choices=DATASETS, default="random")
    group.add_argument("--dataset-path", default=None,
                       help="sharegpt: the JSON file; custom: the JSONL file (prompts: default the packaged file)")
    group.add_argument("--num-prompts", type=positive_int, default=num_prompts, help="number of requests")
    group.add_argument("--input-len", type=positive_int, default=None,
                       help="general input length: sets --random-input-len")
    group.add_argument("--output-len", type=positive_int, default=None,
                       help="general output length: sets every dataset's output length")
    group.add_argument("--random-input-len", type=positive_int, default=1024)
    group.add_argument("--random-output-len", type=positive_int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in len * (1 +- ratio), ratio in [0, 1)")
    group.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                       help="random: tokens of one random prefix before every prompt")
    group.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                       help="sharegpt: output tokens per request (default: the conversation's answer length)")
    group.add_argument("--custom-output-len", type=positive_int, default=256, help="custom, prompts: output tokens")
    group.add_argument("--skip-chat-template", action="store_true", help="custom, prompts: send the raw prompt")
    group.add_argument("--prefix-repetition-prefix-len", type=positive_int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=positive_int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=positive_int, default=128)
    group.add_argument("--mixed-long-fraction", type=float, default=0.1, help="mixed: the fraction of long prompts")
    group.add_argument("--mixed-short-input-range", type=positive_int, nargs=2, default=[40, 128],
                       metavar=("LOW", "HIGH"), help="mixed: prompt tokens of the short requests")
    group.add_argument("--mixed-long-input-range", type=positive_int, nargs=2, default=[1500, 2000],
                       metavar=("LOW", "HIGH"), help="mixed: prompt tokens of the long requests")
    group.add_argument("--mixed-output-range", type=positive_int, nargs=2, default=[16, 64], metavar=("LOW", "HIGH"),
                       help="mixed: output tokens of every request")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def check_dataset_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the dataset flags together (for parser.error), else None; applies --input-len and
    --output-len to the dataset-specific lengths."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.custom_output_len = args.output_len
        args.prefix_repetition_output_len = args.output_len
        args.mixed_output_range = [args.output_len, args.output_len]
    if not 0 <= args.random_range_ratio < 1:
        return f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}"
    if not 0 <= args.mixed_long_fraction <= 1:
        return f"--mixed-long-fraction must be in [0, 1], got {args.mixed_long_fraction}"
    for flag in ("mixed_short_input_range", "mixed_long_input_range", "mixed_output_range"):
        low, high = getattr(args, flag)
        if low > high:
            return f"--{flag.replace('_', '-')} LOW HIGH needs LOW <= HIGH, got {low} {high}"
    if args.dataset_name in ("sharegpt", "custom") and not args.dataset_path:
        return f"--dataset-name {args.dataset_name} needs --dataset-path"
    return None


def build_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int,
                   max_model_len: int | None = None) -> list[RequestRecord]:
    """The workload the `add_dataset_args` flags describe (after `check_dataset_args`)."""
    name = args.dataset_name
    if name == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, vocab_size,
                              args.random_range_ratio, args.seed, tokenizer, max_model_len, args.random_prefix_len)
    if name == "sharegpt":
        return sharegpt_dataset(args.num_prompts, args.dataset_path, tokenizer, args.sharegpt_output_len, args.seed,
                                max_model_len)
    if name in ("custom", "prompts"):
        return prompt_file_dataset(args.num_prompts, args.custom_output_len, tokenizer, args.seed,
                                   args.dataset_path or DEFAULT_PROMPTS_FILE, max_model_len,
                                   skip_chat_template=args.skip_chat_template)
    if name == "prefix_repetition":
        return prefix_repetition_dataset(args.num_prompts, args.prefix_repetition_num_prefixes,
                                         args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                         args.prefix_repetition_output_len, vocab_size, 0.0, args.seed, tokenizer,
                                         max_model_len)
    if name == "mixed":
        return mixed_dataset(args.num_prompts, args.mixed_long_fraction, args.mixed_short_input_range,
                             args.mixed_long_input_range, args.mixed_output_range, vocab_size, args.seed, tokenizer,
                             max_model_len)
    raise ValueError(f"unknown dataset {name!r}")


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset flags that matter for `args.dataset_name`, for result files."""
    keys = {"random": ("random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"),
            "sharegpt": ("dataset_path", "sharegpt_output_len"),
            "custom": ("dataset_path", "custom_output_len", "skip_chat_template"),
            "prompts": ("dataset_path", "custom_output_len", "skip_chat_template"),
            "prefix_repetition": ("prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
                                  "prefix_repetition_num_prefixes", "prefix_repetition_output_len"),
            "mixed": ("mixed_long_fraction", "mixed_short_input_range", "mixed_long_input_range",
                      "mixed_output_range")}
    return {"dataset_name": args.dataset_name, "num_prompts": args.num_prompts, "seed": args.seed,
            **{k: getattr(args, k) for k in keys[args.dataset_name]}}

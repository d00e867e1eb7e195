"""Benchmark workloads (`jaxserve bench --dataset-name ...`): request records built through a grain pipeline,
identical for every engine under test.

Owns the workloads (their flags are `dataset_args.py`), under `vllm bench`'s names where vLLM has the dataset:
* `random`: prompts of random token ids, input/output lengths uniform in [len * (1 - r), len * (1 + r)]
  (`--random-input-len`, `--random-output-len`, `--random-range-ratio`, `--random-prefix-len`).
* `sharegpt`: the first human turn of each ShareGPT conversation (`--dataset-path` to the JSON), asking for as many
  tokens as the first answer had (or `--sharegpt-output-len`); vLLM's length filter (prompt and output >= 4 tokens,
  prompt <= 1024, both <= 2048).
* `prefix_repetition`: `--prefix-repetition-num-prefixes` long common prefixes, each request one of them plus its
  own random suffix (the workload prefix caching should win on).
* `custom`: a JSONL file with a "prompt" (and optional "system") per line, rendered with the chat template unless
  `--skip-chat-template`; `--custom-output-len` tokens each. `prompts` is `custom` over the ~200 varied prompts
  shipped in the package (`jaxserve/bench/data/prompts.jsonl`).
* `mixed` (jaxserve's): short chats of random tokens with a fraction of long prompts, categorized "short" and
  "long" (the workload scheduling for latency targets is measured on).

Every workload is a `grain.MapDataset` pipeline: source -> shuffle(seed) -> map to token ids -> filter by
length. Randomness inside `map` is seeded per record (seed, record index), so a record's tokens do not
depend on the shuffle order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)
DATASETS = ("random", "sharegpt", "prefix_repetition", "custom", "prompts", "mixed")
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
                   seed: int = 0, tokenizer: Any = None, max_model_len: int | None = None,
                   prefix_len: int = 0) -> list[RequestRecord]:
    """`num_requests` prompts of uniformly random token ids (special tokens excluded when a tokenizer is given),
    each after the same `prefix_len` random tokens (vLLM's `--random-prefix-len`)."""
    import grain

    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_requests, input_len, range_ratio)
    out_lens = _lengths(rng, num_requests, output_len, range_ratio)
    low, high = _token_range(vocab_size, tokenizer)
    prefix = np.random.default_rng([seed, PREFIX_STREAM]).integers(low, high, size=prefix_len).tolist()
    specs = [(i, int(n_in), int(n_out)) for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))]

    def make(spec: tuple[int, int, int]) -> RequestRecord:
        index, n_in, n_out = spec
        tokens = np.random.default_rng([seed, index]).integers(low, high, size=n_in)
        return RequestRecord(prefix + tokens.tolist(), n_out, category="random")

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
    """A JSONL prompt file: one {"prompt", optional "system", "category", "id"} object per line."""
    entries = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not JSON ({err.msg})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
                raise ValueError(f"{path}:{line_no}: every line needs a non-empty 'prompt'")
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no prompts")
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


def prompt_file_dataset(num_requests: int, output_len: int, tokenizer: Any, seed: int = 0,
                        path: str | Path = DEFAULT_PROMPTS_FILE, max_model_len: int | None = None,
                        max_input_len: int | None = None, skip_chat_template: bool = False) -> list[RequestRecord]:
    """Prompts of a JSONL file, rendered with the chat template (or raw); the file is cycled when more requests
    are asked for than it has."""
    import grain

    if tokenizer is None:
        raise ValueError("a prompt file dataset needs a tokenizer")
    entries = load_prompt_file(path)

    def make(entry: dict[str, Any]) -> RequestRecord:
        messages = chat_messages(entry)
        if skip_chat_template:
            text = entry["prompt"]
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            text, ids = render_chat(tokenizer, messages)
        return RequestRecord(ids, output_len, prompt_text=text, messages=messages, category=entry.get("category"))

    repeats = max(1, -(-num_requests // len(entries)) + 1)  # one spare pass to make up for filtered prompts
    dataset = (grain.MapDataset.source(entries).repeat(repeats).shuffle(seed=seed).map(make)
               .filter(_fits(max_model_len, max_input_len)))
    return _collect(dataset, num_requests, str(path))


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first answer) of every ShareGPT conversation with at least two turns."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"sharegpt: cannot read {path}: {err}") from None
    if not isinstance(data, list):
        raise ValueError(f"sharegpt: {path} must hold a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations", entry.get("conversation")) if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        values = [turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2]]
        if all(isinstance(value, str) for value in values):
            pairs.append((values[0], values[1]))
    if not pairs:
        raise ValueError(f"sharegpt: {path} has no conversation with two turns")
    return pairs


def sharegpt_dataset(num_requests: int, path: str | Path, tokenizer: Any, output_len: int | None = None,
                     seed: int = 0, max_model_len: int | None = None) -> list[RequestRecord]:
    """ShareGPT conversations in a seeded shuffle: the first turn is the prompt, the first answer's token count
    (or `output_len`) the tokens asked for; vLLM's filter drops prompts or answers under 4 tokens, prompts over
    1,024 and pairs over 2,048."""
    import grain

    if tokenizer is None:
        raise ValueError("the sharegpt dataset needs a tokenizer")
    pairs = load_sharegpt(path)

    def make(pair: tuple[str, str]) -> RequestRecord | None:
        prompt, answer = pair
        ids = list(tokenizer(prompt)["input_ids"])
        wanted = output_len if output_len is not None else len(tokenizer(answer)["input_ids"])
        too_short = len(ids) < 4 or (output_len is None and wanted < 4)
        if too_short or len(ids) > 1024 or len(ids) + wanted > 2048:
            return None
        return RequestRecord(ids, wanted, prompt_text=prompt, messages=[{"role": "user", "content": prompt}],
                             category="sharegpt")

    dataset = (grain.MapDataset.source(pairs).shuffle(seed=seed).map(make)
               .filter(lambda r: r is not None and _fits(max_model_len, None)(r)))
    return _collect(dataset, num_requests, "sharegpt")


def prefix_repetition_dataset(num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
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
    return _collect(dataset, num_requests, "prefix_repetition")


def length_stats(records: Sequence[RequestRecord]) -> dict[str, float]:
    prompt = np.array([r.prompt_len for r in records])
    output = np.array([r.expected_output_len for r in records])
    return {"requests": len(records), "prompt_tokens": int(prompt.sum()), "mean_prompt_len": float(prompt.mean()),
            "max_prompt_len": int(prompt.max()), "expected_output_tokens": int(output.sum())}

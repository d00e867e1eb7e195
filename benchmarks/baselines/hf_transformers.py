"""Hugging Face transformers baseline: the same offline workload through `model.generate`, static batches.

Owns the HF side of `benchmarks/compare.py`: load the same weights in the same dtype (for the default model,
transformers dequantizes the same GGUF file jaxserve converts, so both run identical float32 values), torch
threads = usable cores, greedy decoding, static batches of `--batch-size` requests in workload order, left
padding with an attention mask, and EOS disabled (`eos_token_id=None`, like jaxserve's `ignore_eos`: the
model may emit EOS, generation just continues) so every request gets exactly its expected output length.
A batch generates max(expected output lens in the batch) tokens; only each request's own expected tokens
count as output, the padding-induced extra work counts against HF as it would in a static-batch server.

    python benchmarks/baselines/hf_transformers.py --dataset random --num-prompts 64 --input-len 128 \
        --output-len 64 --batch-size 64
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from jaxserve.bench import dataset_args, datasets, machine
from jaxserve.bench.datasets import RequestRecord

NAME = "hf-transformers"


def set_torch_threads(threads: int | None = None) -> int:
    import torch

    threads = threads or machine.usable_cores()
    torch.set_num_threads(threads)
    return threads


def load_hf_model(model: str | None, dtype: str = "float32") -> tuple[Any, float]:
    """The transformers model for jaxserve's `model` argument (None = default GGUF) and its load seconds."""
    import torch
    import transformers

    from jaxserve.loading import DEFAULT_MODEL, default_gguf_path

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    started = time.perf_counter()
    if model in (None, DEFAULT_MODEL) or str(model).endswith(".gguf"):
        gguf = Path(default_gguf_path() if model in (None, DEFAULT_MODEL) else model)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype)
    hf.eval()
    return hf, time.perf_counter() - started


def _pad_id(hf: Any) -> int:
    config = hf.generation_config
    for candidate in (config.pad_token_id, hf.config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def generate_batch(hf: Any, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy generation of `max_new_tokens` for left-padded `prompts`; returns the new token ids per prompt."""
    import torch

    pad = _pad_id(hf)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None  # never stop early; EOS is an ordinary token (jaxserve's ignore_eos)
    config.update(max_new_tokens=max_new_tokens, min_new_tokens=None, do_sample=False, pad_token_id=pad,
                  use_cache=True, temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return out[:, width:].tolist()


@dataclasses.dataclass
class HFResult(common.OfflineThroughput):
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # requested tokens only (what jaxserve generates for the same workload)
    generated_tokens: int  # including tokens generated past a request's own length in its static batch
    batch_size: int
    output_token_ids: list[list[int]] = dataclasses.field(repr=False, default_factory=list)


def run_hf_offline(hf: Any, records: Sequence[RequestRecord], batch_size: int, use_tqdm: bool = True) -> HFResult:
    """Static batches in workload order, timed end to end after one untimed tiny warm-up call."""
    from tqdm.auto import tqdm

    outputs: list[list[int]] = []
    generated = 0
    generate_batch(hf, [records[0].prompt_token_ids], 2)  # untimed warm-up: first-call allocations
    progress = tqdm(total=len(records), desc="HF generate", disable=not use_tqdm, dynamic_ncols=True)
    started = time.perf_counter()
    for first in range(0, len(records), batch_size):
        batch = records[first:first + batch_size]
        new_tokens = max(r.expected_output_len for r in batch)
        tokens = generate_batch(hf, [r.prompt_token_ids for r in batch], new_tokens)
        outputs += [row[:r.expected_output_len] for row, r in zip(tokens, batch)]
        generated += new_tokens * len(batch)
        progress.update(len(batch))
    elapsed = time.perf_counter() - started
    progress.close()
    return HFResult(elapsed_s=elapsed, num_requests=len(records), prompt_tokens=sum(r.prompt_len for r in records),
                    output_tokens=sum(len(o) for o in outputs), generated_tokens=generated, batch_size=batch_size,
                    output_token_ids=outputs)


def hf_single_stream_decode(hf: Any, prompt_token_ids: list[int], output_len: int) -> dict[str, float]:
    """Batch-1 decode tok/s: (n - 1) tokens over time(n tokens) - time(1 token), i.e. prefill excluded."""
    if output_len < 2:
        raise ValueError("single-stream decode needs output_len >= 2")
    generate_batch(hf, [prompt_token_ids], 2)  # warm-up: first-call allocations
    started = time.perf_counter()
    generate_batch(hf, [prompt_token_ids], 1)
    one = time.perf_counter() - started
    started = time.perf_counter()
    generate_batch(hf, [prompt_token_ids], output_len)
    full = time.perf_counter() - started
    decode_s = full - one
    return {"prompt_len": len(prompt_token_ids), "output_tokens": output_len, "elapsed_s": full, "ttft_s": one,
            "decode_tok_s": (output_len - 1) / decode_s if decode_s > 0 else float("nan"),
            "end_to_end_tok_s": output_len / full}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_workload_args(parser)
    common.add_common_args(parser)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded default model's GGUF)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=64, help="static batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    parser.add_argument("--single-stream-tokens", type=int, default=32,
                        help="also measure batch-1 decode over this many tokens (0 = skip)")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv, args = common.start(build_parser(), argv)
    threads = set_torch_threads(args.threads)
    hf, load_s = load_hf_model(args.model, args.dtype)
    tokenizer = common.load_tokenizer(None if args.model is None or str(args.model).endswith(".gguf") else args.model)
    records = dataset_args.build_requests(args, tokenizer, hf.config.vocab_size)
    result = run_hf_offline(hf, records, args.batch_size, not args.disable_tqdm)
    single = (hf_single_stream_decode(hf, records[0].prompt_token_ids, args.single_stream_tokens)
              if args.single_stream_tokens else None)
    payload = {"model": common.model_label(args.model), "dtype": args.dtype, "torch_threads": threads,
               "load_s": load_s, "workload": {**dataset_args.describe(args), **datasets.length_stats(records)},
               "result": result.summary(), "single_stream": single}
    path = common.write_result(NAME, payload, args.result_file, argv, machine=common.machine_info(include_jax=False))
    rows = [("Model:", payload["model"]), ("Load (s):", common.fmt(load_s, 1)),
            ("Generation time (s):", common.fmt(result.elapsed_s)),
            ("Output token throughput (tok/s):", common.fmt(result.output_throughput)),
            ("Total token throughput (tok/s):", common.fmt(result.total_throughput)),
            ("Request throughput (req/s):", common.fmt(result.request_throughput))]
    if single:
        rows.append(("Batch-1 decode (tok/s):", common.fmt(single["decode_tok_s"])))
    common.print_block("HF transformers baseline", rows)
    print(f"result: {path}")
    return payload


if __name__ == "__main__":
    main()

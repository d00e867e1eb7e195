"""What the hybrid KV cache gains: long sequences that fit at once in the same KV bytes, hybrid against one pool.

Two layouts of layers, as the published models have them, at a small width (the capacity depends on which layers
have windows and on the window against the context, not on the width): **Gemma-3-shaped**, five sliding-window
layers per full one (Gemma 3's pattern) with a window of an eighth of the context (1,024 of 8,192 there), and
**Mistral-shaped**, a window on every layer (Mistral 7B v0.1's 4,096) of a quarter of the context. Random weights
(`load_format="dummy"`), float32, the xla backend. Each engine gets the same `--kv-cache-bytes`; `--num-requests`
prompts of `--prompt-len` random tokens ask for `--output-len` tokens each (enough that sequences pile up in the
pools: the limit is memory, not the prefill rate). Reported per layout and cache: the
pools' pages, the most sequences decoding at once (their whole context in the pools), preemptions, the run's
seconds, and whether every output equals the one-pool run's.

    python benchmarks/hybrid_capacity.py
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common

NAME = "hybrid_capacity"
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def layouts(context: int) -> dict[str, dict[str, Any]]:
    """The two layer layouts' config.json at `context` tokens."""
    layers = 12
    return {
        "gemma-3-shaped": dict(
            model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], **SMALL, num_hidden_layers=layers,
            query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh", sliding_window=context // 8,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                 full_attention=dict(rope_type="default", rope_theta=1000000.0)),
            max_position_embeddings=context),
        "mistral-shaped": dict(
            model_type="mistral", architectures=["MistralForCausalLM"], **SMALL, num_hidden_layers=layers,
            sliding_window=context // 4, rope_theta=10000.0, max_position_embeddings=context),
    }


def run(path: str, hybrid: bool, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from jaxserve import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", max_model_len=args.context, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_bytes,
              disable_hybrid_kv_cache_manager=not hybrid, seed=args.seed)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for index in range(args.num_requests):
        engine.add_request(str(index), {"prompt_token_ids": rng.integers(3, 512, args.prompt_len).tolist()}, params)
    outputs, most, started = {}, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = list(output.outputs[0].token_ids)
        most = max(most, sum(not seq.is_prefilling for seq in engine.scheduler.running))
    plan = runner.kv_plan
    result = {"hybrid": len(plan.groups) > 1, "full_pages": plan.num_pages,
              "window_pages": sum(group.num_pages for group in plan.window_groups), "pool_bytes": plan.pool_bytes,
              "most_decoding_at_once": most,
              "preemptions": engine.scheduler.num_preemptions, "seconds": time.perf_counter() - started,
              "outputs": [outputs[i] for i in range(args.num_requests)]}
    del llm, engine, runner
    gc.collect()
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="max_model_len")
    parser.add_argument("--prompt-len", type=int, default=1800)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-bytes", type=int, default=40 * 2**20, help="KV bytes each engine gets")
    common.add_common_args(parser)
    argv, args = common.start(parser, argv)
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as root:
        for name, config in layouts(args.context).items():
            path = Path(root) / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
            uniform, hybrid = run(str(path), False, args), run(str(path), True, args)
            hybrid["identical"] = hybrid.pop("outputs") == uniform.pop("outputs")
            results[name] = {"uniform": uniform, "hybrid": hybrid}
            for kind, result in (("one pool", uniform), ("hybrid", hybrid)):
                rows.append([name, kind, result["full_pages"], result["window_pages"], result["pool_bytes"] / 2**20,
                             result["most_decoding_at_once"], result["preemptions"], result["seconds"],
                             result.get("identical", "")])
    print(common.format_table(["layout", "cache", "full pages", "window pages", "MiB", "decoding at once",
                               "preemptions", "seconds", "identical"], rows))
    payload = {"argv": argv, "machine": common.machine_info(), "commit": common.git_commit(), "results": results}
    common.write_result(NAME, payload, args.result_file)
    return payload


if __name__ == "__main__":
    main()

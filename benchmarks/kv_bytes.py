"""What a model's KV cache takes per token and per sequence, from the engine's own KV plan (`engine/kv_plan.py`):
with the hybrid KV cache (window layers keep only their window) and without it (every layer keeps every token),
for a shape of `random_model.py`, its config's fields overridden where asked (a KV-shared variant).

    python benchmarks/kv_bytes.py --shape gemma-4-31b --max-model-len 131072
    python benchmarks/kv_bytes.py --shape gemma-4-31b --set num_kv_shared_layers=20

No weights, no device: the numbers are the plan's (bfloat16 pages, one device).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Sequence

import jax.numpy as jnp
import transformers

from benchmarks.random_model import SHAPES, write_config
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_plan import plan_kv_cache
from jaxserve.layers.attention import make_attention_backend
from jaxserve.models import config_from_hf


def kv_bytes(path: str, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[dict]:
    """Per plan (hybrid on, off): KiB per token of the full-attention group, MiB each sequence's windows hold (its
    window and the largest step), and GiB one sequence of max_model_len takes."""
    config = config_from_hf(transformers.AutoConfig.from_pretrained(path))
    rows = []
    for hybrid in (True, False):
        ec = EngineConfig(model=path, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, num_kv_pages=1000, page_size=16,
                          disable_hybrid_kv_cache_manager=not hybrid)
        plan = plan_kv_cache(config, ec, TensorParallel(1), make_attention_backend("xla"), jnp.bfloat16, None)
        per_token = plan.groups[0].page_bytes / plan.page_size
        windows = sum(group.page_bytes * (group.num_pages - 1) for group in plan.window_groups) / max_num_seqs
        rows.append({"hybrid": hybrid, "full_layers": len(plan.groups[0].layers),
                     "window_layers": sum(len(group.layers) for group in plan.window_groups),
                     "no_pages": sum(pages == 0 for pages in plan.layer_pages),
                     "kib_per_token": per_token / 1024, "window_mib_per_sequence": windows / 2**20,
                     "gib_per_sequence": (per_token * max_model_len + windows) / 2**30})
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="config fields (JSON values)")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    overrides = {field: json.loads(value) for field, value in (item.split("=", 1) for item in args.set)}
    with tempfile.TemporaryDirectory() as path:
        write_config(path, args.shape)
        config = json.loads(open(f"{path}/config.json").read()) | overrides
        with open(f"{path}/config.json", "w") as file:
            json.dump(config, file)
        rows = kv_bytes(path, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()

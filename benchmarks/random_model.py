"""A random-weight Hugging Face checkpoint with the default model's shapes, for timing where its GGUF is absent.

The GPU check runs on a machine that is lent files up to 64 MiB, and the default model's GGUF is 98 MB, so
`gpu_check.sh` builds this stand-in there (torch and transformers are installed on it) and times the
engine on it. Only speed can be measured on it, never output quality. `DEFAULT_MODEL_SHAPES` is what
SmolLM2-135M-Instruct's GGUF describes; a test checks the two agree.

    python benchmarks/random_model.py /tmp/smollm2-random
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

DEFAULT_MODEL_SHAPES: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True)


def build(path: str, seed: int = 0, **overrides: Any) -> str:
    """Writes a `LlamaForCausalLM` with HF's random initialization (and `overrides` of the shapes) to `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**DEFAULT_MODEL_SHAPES, **overrides})
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.path, args.seed)
    print(f"random-weight checkpoint with the default model's shapes: {path}")
    return path


if __name__ == "__main__":
    main()

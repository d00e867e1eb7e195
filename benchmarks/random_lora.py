"""A PEFT LoRA adapter for the default model with random weights, to measure what serving an adapter costs a
speculative head trained on the base model (`benchmarks/spec_decode.py --lora DIR`): rank `--rank` on every
attention and MLP projection, A drawn as PEFT draws it, B from N(0, `--std`), so `--std` sets how far the adapted
model's answers move from the base model's (RESULTS.md says how far each measured one moved).

    python benchmarks/random_lora.py --std 0.01 --out /tmp/lora-0.01
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the adapter's directory")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--std", type=float, default=0.01, help="standard deviation of the B matrices")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import peft
    import torch
    import transformers

    from jaxserve.loading import default_gguf_path

    gguf = Path(default_gguf_path())
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, args.std)
    adapted.save_pretrained(args.out)
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()

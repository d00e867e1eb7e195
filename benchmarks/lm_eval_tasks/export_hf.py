"""The default model as an HF checkpoint directory, for lm-eval's `--model hf` and as the tokenizer of its
`--model local-completions`: transformers dequantizes the same GGUF jaxserve converts (as
benchmarks/baselines/hf_transformers.py loads it), so both backends score identical float32 weights.

    python benchmarks/lm_eval_tasks/export_hf.py /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.baselines.hf_transformers import load_hf_model


def main() -> None:
    import transformers

    from jaxserve.loading import default_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write (config, safetensors weights, tokenizer)")
    args = parser.parse_args()
    hf, _ = load_hf_model(None)
    gguf = Path(default_gguf_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a model loaded from a GGUF counts as quantized and refuses to save: the same (dequantized) tensors, in a plain one
    config = hf.config
    config.__dict__.pop("quantization_config", None)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=hf.dtype)
    plain.load_state_dict(hf.state_dict())
    plain.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

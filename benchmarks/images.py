"""Images on this machine: the vision encoder's and the prefill's seconds per image by resolution, and what the
encoder cache saves when an image comes again behind other text (a prefix-cache miss that reaches the image).

The model is Qwen2.5-VL-7B's shape with random weights (`random_model.py --shape qwen2.5-vl-7b`): its whole vision
tower (32 blocks of 1280, 0.68 B parameters) and, unless `--layers` says otherwise, 2 of its 28 decoder layers, so
the encoder's times are the published model's and the prefill's are 2/28 of its decoder's. Prompts are token ids
(the stand-in has no tokenizer) with one image placeholder each.

    python benchmarks/images.py --sizes 224 336 448 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.random_model import SHAPES, write_config  # noqa: E402

SHAPE = "qwen2.5-vl-7b"


def drawn(size: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def prompt(text_tokens: int, seed: int) -> list[int]:
    shape = SHAPES[SHAPE]
    text = np.random.default_rng(seed).integers(1000, 100000, text_tokens).tolist()
    return text + [shape["vision_start_token_id"], shape["image_token_id"], shape["vision_end_token_id"], 872, 374]


def timed(llm, ids: list[int], image) -> tuple[float, float, int]:
    """Seconds to the first token, the encoder's seconds in them, the prompt's tokens."""
    from jaxserve import SamplingParams

    before = llm.llm_engine.stats().encoder_seconds
    started = time.perf_counter()
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                             SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    seconds = time.perf_counter() - started
    return seconds, llm.llm_engine.stats().encoder_seconds - before, len(output.prompt_token_ids)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 336, 448], help="square images' sides")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the stand-in")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    from jaxserve import LLM

    directory = write_config(tempfile.mkdtemp(prefix="qwen2_5_vl_"), SHAPE, num_hidden_layers=args.layers)
    largest = max(args.sizes)
    llm = LLM(directory, load_format="dummy", max_num_seqs=1, max_model_len=4096, max_num_batched_tokens=2048,
              mm_processor_kwargs={"max_pixels": largest * largest})
    rows, seed = [], 0
    for size in args.sizes:
        runs = []
        for _ in range(args.repeats):
            seed += 1
            runs.append(timed(llm, prompt(32, seed), drawn(size, seed)))  # a new image and text: nothing cached
        seconds, encoder, tokens = min(runs)
        rows.append(dict(size=size, prompt_tokens=tokens, ttft_s=round(seconds, 3), encoder_s=round(encoder, 3),
                         prefill_and_rest_s=round(seconds - encoder, 3)))
        print(json.dumps(rows[-1]), flush=True)
    image = drawn(largest, 10_000)
    first = timed(llm, prompt(32, 10_001), image)
    again = min(timed(llm, prompt(32, 10_002 + i), image) for i in range(args.repeats))  # other text, same image
    fresh = min(timed(llm, prompt(32, 20_000 + i), drawn(largest, 20_000 + i)) for i in range(args.repeats))
    cache = dict(size=largest, first_ttft_s=round(first[0], 3), cached_image_ttft_s=round(again[0], 3),
                 new_image_ttft_s=round(fresh[0], 3), cached_encoder_s=round(again[1], 3))
    print(json.dumps(cache), flush=True)
    return dict(resolutions=rows, encoder_cache=cache)


if __name__ == "__main__":
    main()

"""The Qwen-VL family's prompts with images: preprocessing by transformers' own image processor (its PIL backend),
each image's placeholder expanded to its token count, and the M-RoPE positions of the whole prompt (transformers'
`get_rope_index` for images)."""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from jaxserve.multimodal.inputs import ImageInput, MultiModalPrompt, image_hash


PROCESSOR_CONFIG = "preprocessor_config.json"
SMALLEST_BUCKET = 16  # patches of the smallest encoder call


def read_image_processor(directory: str, kwargs: dict, default: Callable | None = None):
    """transformers' image processor of `directory` (its PIL backend) with `kwargs` on top; `default(**kwargs)` when
    the directory has no preprocessor_config.json and a default is given, else ValueError naming the file."""
    from transformers import AutoImageProcessor

    try:
        if default is not None and not os.path.exists(os.path.join(directory, PROCESSOR_CONFIG)):
            return default(**kwargs)
        return AutoImageProcessor.from_pretrained(directory, backend="pil", **kwargs)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"cannot read the image processor of {directory!r} ({PROCESSOR_CONFIG}): {err}") from None


class QwenVLProcessor:
    """`process(token_ids, images)`: the prompt with each image's placeholder expanded, and its `MultiModalPrompt`.

    The prompt holds one `<|image_pad|>` per image (what the chat template writes), or each image's placeholder
    already expanded to its token count."""

    def __init__(self, directory: str, hf_config: Any, mm_processor_kwargs: dict | None = None,
                 defaults: bool = False):
        """`defaults`: a directory without preprocessor_config.json gets transformers' default processor (random
        weights, `jaxserve compile`); otherwise its absence is a ValueError."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.image_processor = read_image_processor(directory, mm_processor_kwargs or {},
                                                    Qwen2VLImageProcessorPil if defaults else None)
        self.image_token_id = hf_config.image_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        self.placeholder = "<|image_pad|>"

    def preprocess(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        try:
            features = self.image_processor(images=[image], return_tensors="np")
        except ValueError as err:  # e.g. an aspect ratio past 200
            raise ValueError(f"cannot preprocess an image of {image.width}x{image.height}: {err}") from None
        grid = tuple(int(n) for n in features["image_grid_thw"][0])
        return np.asarray(features["pixel_values"], np.float32), grid

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge ** 2

    def patch_range(self) -> tuple[int, int]:
        """The patch counts of the encoder's smallest and largest calls (powers of two between them are compiled
        too): up to the processor's largest image."""
        size = self.image_processor.size
        longest = size["longest_edge"] if "longest_edge" in size else size["max_pixels"]
        return SMALLEST_BUCKET, max(SMALLEST_BUCKET, longest // self.image_processor.patch_size ** 2)

    def max_tokens(self) -> int:
        """The most placeholder tokens one image can take."""
        return self.patch_range()[1] // self.merge ** 2

    def example(self) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The smallest image's preprocessed pixels and grid (one merge unit): warm-up's encoder input."""
        patch_dim = 3 * self.image_processor.temporal_patch_size * self.image_processor.patch_size ** 2
        return np.zeros((self.merge ** 2, patch_dim), np.float32), (1, self.merge, self.merge)

    def expand_text(self, text: str) -> str:
        """`text`: the placeholder is one special token, which no merge crosses, so `process` expands it in the
        ids as transformers' processor does in the text."""
        return text

    def process(self, token_ids: list[int], images: list) -> tuple[list[int], MultiModalPrompt]:
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholders ({self.placeholder}) but "
                             f"{len(images)} images were given")
        expanded: list[int] = []
        inputs = []
        previous = 0
        for (start, length), image in zip(runs, images):
            pixel_values, grid = self.preprocess(image)
            count = self.num_tokens(grid)
            if length not in (1, count):
                raise ValueError(f"an image of {image.width}x{image.height} takes {count} placeholder tokens, the "
                                 f"prompt has {length}")
            expanded += token_ids[previous:start]
            inputs.append(ImageInput(image_hash(image.mode, image.size, image.tobytes()), len(expanded), count,
                                     pixel_values, grid))
            expanded += [self.image_token_id] * count
            previous = start + length
        expanded += token_ids[previous:]
        positions, delta = rope_positions(len(expanded), inputs, self.merge)
        return expanded, MultiModalPrompt(tuple(inputs), positions, delta)


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(token_ids):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def rope_positions(num_tokens: int, images: list[ImageInput], merge: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions `[3, num_tokens]` and the delta of the positions after the prompt: text counts on from the
    largest position before it; an image's tokens have its start position plus their (frame, row, column) in the
    merged grid, and the text after it starts at its start + its longer side."""
    positions = np.zeros((3, num_tokens), np.int64)
    current = previous = 0
    for image in images:
        text = image.offset - previous
        positions[:, previous:image.offset] = current + np.arange(text)
        current += text
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        positions[:, image.offset:image.end] = grid + current
        current += max(h, w)
        previous = image.end
    positions[:, previous:] = current + np.arange(num_tokens - previous)
    return positions.astype(np.int32), int(positions.max()) + 1 - num_tokens

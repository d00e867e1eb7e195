"""Gemma 3's prompts with images: preprocessing by transformers' own image processor (its PIL backend; every image
resized to the tower's square), and each image's `<start_of_image>` expanded as transformers' processor expands it:
`\\n\\n<start_of_image>` + `mm_tokens_per_image` x `<image_soft_token>` + `<end_of_image>\\n\\n`, in a text
prompt's text before it is tokenized (Gemma's tokenizer merges those newlines with the template's), in token ids
otherwise. The image's tokens attend to each other both ways (`MultiModalPrompt.whole_images`: a chunk never
splits them). Pan-and-scan crops are not supported."""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

from jaxserve.multimodal.inputs import ImageInput, MultiModalPrompt, image_hash
from jaxserve.multimodal.qwen_vl import read_image_processor


class Gemma3Processor:
    def __init__(self, directory: str, hf_config: Any, mm_processor_kwargs: dict | None = None,
                 defaults: bool = False):
        from transformers import AutoTokenizer
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        kwargs = dict(mm_processor_kwargs or {})
        if kwargs.get("do_pan_and_scan"):
            raise ValueError("mm_processor_kwargs do_pan_and_scan is not supported (jaxserve encodes each image "
                             "whole)")
        vision = hf_config.vision_config
        default = functools.partial(Gemma3ImageProcessorPil, size={"height": vision.image_size,
                                                                   "width": vision.image_size})
        self.image_processor = read_image_processor(directory, kwargs, default if defaults else None)
        size = self.image_processor.size
        if (size["height"], size["width"]) != (vision.image_size, vision.image_size):
            raise ValueError(f"the image processor resizes to {size['height']}x{size['width']}, the vision tower "
                             f"takes {vision.image_size}x{vision.image_size}")
        self.side = vision.image_size // vision.patch_size
        self.tokens = hf_config.mm_tokens_per_image
        self.image_token_id = hf_config.image_token_id
        self.boi, self.eoi = hf_config.boi_token_id, hf_config.eoi_token_id
        self.placeholder = "<start_of_image>"
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
            self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)
            start, image, end = tokenizer.convert_ids_to_tokens([self.boi, self.image_token_id, self.eoi])
            self.bare = None  # a tokenizer without the image tokens: placeholders expanded in the ids alone
            if None not in (start, image, end):
                self.placeholder = start
                self.bare = re.compile(re.escape(start) + f"(?!{re.escape(image)})")
                self.expanded = f"\n\n{start}{image * self.tokens}{end}\n\n"
        except (OSError, ValueError):  # a config-only directory (jaxserve compile): no text around the images
            self.newlines, self.bare = [], None

    def patch_range(self) -> tuple[int, int]:
        patches = self.side * self.side
        return patches, patches

    def max_tokens(self) -> int:
        return self.tokens

    def example(self) -> tuple[np.ndarray, tuple[int, int, int]]:
        size = self.image_processor.size["height"]
        return np.zeros((3, size, size), np.float32), (1, self.side, self.side)

    def preprocess(self, image) -> np.ndarray:
        features = self.image_processor(images=[image], return_tensors="np")
        return np.asarray(features["pixel_values"][0], np.float32)

    def expand_text(self, text: str) -> str:
        """Each `<start_of_image>` not yet followed by its image tokens expanded, as transformers' processor
        replaces it in the text."""
        return text if self.bare is None else self.bare.sub(lambda _: self.expanded, text)

    def process(self, token_ids: list[int], images: list) -> tuple[list[int], MultiModalPrompt]:
        """Each `<start_of_image>` (one per image; or already followed by its image tokens) expanded."""
        starts = [index for index, token in enumerate(token_ids) if token == self.boi]
        if len(starts) != len(images):
            raise ValueError(f"the prompt has {len(starts)} image placeholders ({self.placeholder}) but "
                             f"{len(images)} images were given")
        stray = [token for token in token_ids if token == self.image_token_id]
        expanded_before = [start for start in starts if token_ids[start + 1:start + 2] == [self.image_token_id]]
        if len(stray) != len(expanded_before) * self.tokens:
            raise ValueError(f"the prompt's image tokens must come {self.tokens} after each {self.placeholder}")
        out: list[int] = []
        inputs = []
        previous = 0
        for start, image in zip(starts, images):
            out += token_ids[previous:start]
            if start in expanded_before:
                out.append(self.boi)
                previous = start + 1 + self.tokens
            else:
                out += self.newlines + [self.boi]
                previous = start + 1
            inputs.append(ImageInput(image_hash(image.mode, image.size, image.tobytes()), len(out), self.tokens,
                                     self.preprocess(image), (1, self.side, self.side)))
            out += [self.image_token_id] * self.tokens
            if start not in expanded_before:
                out += [self.eoi] + self.newlines
        out += token_ids[previous:]
        return out, MultiModalPrompt(tuple(inputs), whole_images=True)

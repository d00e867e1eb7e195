"""`ImageInput` and `MultiModalPrompt`: a request's images once preprocessed, as plain frozen data that crosses the
scheduler, the runner and other processes; and `image_hash`, an image's identity (vLLM's `mm_hash`)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

# a placeholder token's prefix-cache key is negative (never a token id): -(1 + (the image's hash + index) mod this)
KEY_SPACE = 1 << 62


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its placeholder tokens `offset .. offset + num_tokens` take its encoder's output."""

    mm_hash: str  # sha256 hex of the decoded pixels (`image_hash`): equal images share encodings and cached pages
    offset: int
    num_tokens: int
    pixel_values: np.ndarray  # the family's preprocessed pixels (Qwen-VL: float32 [patches, patch_dim])
    grid_thw: tuple[int, int, int]  # its patch grid (temporal, height, width)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalPrompt:
    """A prompt's images in order, and its M-RoPE positions (`mrope_positions [3, prompt tokens]`; tokens past the
    prompt turn by their position + `mrope_delta` on all three axes) for models that use them. `whole_images`: an
    image's tokens attend to each other both ways (Gemma 3), so a prefill chunk takes them all or none."""

    images: tuple[ImageInput, ...]
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    whole_images: bool = False

    def chunk_stop(self, start: int, stop: int) -> int:
        """Under `whole_images`, where a chunk from `start` may end at most at `stop`: before the image it would
        end inside, or at `start` (no tokens) when it would end inside the image it starts in."""
        if not self.whole_images:
            return stop
        for image in reversed(self.images):
            if image.offset < stop < image.end:
                stop = max(image.offset, start)
        return stop

    def key_token_ids(self, token_ids: list[int]) -> list[int]:
        """`token_ids` (the prompt's first) with each image placeholder replaced by a key of its image and index
        in it: the token ids a prefix-cache page is keyed and matched by, so pages holding different images differ."""
        keys = list(token_ids)
        for image in self.images:
            base = int(image.mm_hash[:16], 16)
            keys[image.offset:image.end] = [-1 - (base + i) % KEY_SPACE for i in range(image.num_tokens)]
        return keys

    def images_in(self, start: int, stop: int) -> list[ImageInput]:
        """The images with placeholder tokens among positions `start .. stop`."""
        return [image for image in self.images if image.offset < stop and image.end > start]


def image_hash(mode: str, size: tuple[int, int], pixels: bytes) -> str:
    """An image's identity: sha256 over its mode, size and decoded pixel bytes (not the file's bytes: one picture in
    two encodings is one image)."""
    digest = hashlib.sha256(f"{mode}:{size[0]}x{size[1]}:".encode())
    digest.update(pixels)
    return digest.hexdigest()

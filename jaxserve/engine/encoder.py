"""`Encoder`: the runner's image side (an image + text model's) — the vision tower's `encode` step, compiled at
start-up for each patch-count bucket; the encoder cache (vLLM's), image embeddings on the host keyed by the image's
hash, so an image repeated in a conversation or shared by requests is encoded once; and each prefill call's
embeddings at its image placeholders (`prepare`).

A step encodes the images its chunks reach that the cache lacks, packed several to a call (each image's patches
attend only among themselves) up to the largest bucket, and each chunk takes the rows of its tokens; chunked prefill
may split an image's tokens over several chunks, which read the cache in turn. What the cache holds is the
scheduler's decision (`encoder_cache_manager.py`): it drops the images that record evicts.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Iterator

import jax
import numpy as np

from jaxserve.engine.buckets import bucket_for, power_of_two_buckets
from jaxserve.engine.input_batch import InputBatch
from jaxserve.engine.step_inputs import PrefillInputs, with_images
from jaxserve.engine.step_registry import Step, assign, jit_step
from jaxserve.engine.steps import PrefillBatch
from jaxserve.multimodal.inputs import ImageInput
from jaxserve.multimodal.vision import VisionModel


class EncoderCache:
    """Image embeddings by image hash: the images `EncoderCacheManager` holds; it drops what that record evicts."""

    def __init__(self):
        self._entries: dict[str, np.ndarray] = {}
        self.hits = 0
        self.misses = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __getitem__(self, mm_hash: str) -> np.ndarray:
        return self._entries[mm_hash]

    def put(self, mm_hash: str, embeddings: np.ndarray) -> None:
        self._entries[mm_hash] = embeddings

    def free(self, mm_hashes: tuple[str, ...]) -> None:
        for mm_hash in mm_hashes:
            self._entries.pop(mm_hash, None)


class Encoder:
    def __init__(self, vision: VisionModel, mesh, hidden_size: int, dtype, max_num_batched_tokens: int,
                 deepstack_layers: int = 0, bidirectional: bool = False):
        if vision.config.out_hidden_size != hidden_size:
            raise ValueError(f"the vision tower's out_hidden_size ({vision.config.out_hidden_size}) is not the "
                             f"language model's hidden_size ({hidden_size})")
        self.vision = vision
        self.mesh = mesh
        self.width = hidden_size * (1 + deepstack_layers)  # an image token's embedding and its deepstack features
        self.bidirectional = bidirectional  # an image's tokens see each other (the prefill takes query limits)
        if bidirectional and max_num_batched_tokens < vision.processor.max_tokens():
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must hold an image's "
                             f"{vision.processor.max_tokens()} tokens: they are prefilled in one chunk")
        self.dtype = np.dtype(dtype)
        self.buckets = power_of_two_buckets(*vision.processor.patch_range())
        self.cache = EncoderCache()
        self.calls = 0
        self.images_encoded = 0
        self.encoder_seconds = 0.0

    def steps(self) -> list[Step]:
        vision = self.vision
        params_in = jax.tree.map(lambda param: param.sharding, vision.params)
        encode = functools.partial(vision.family.encode, vision.config, self.dtype)
        return [Step("encode", jit_step(encode, self.mesh, (params_in,), (), donate=()), lambda: (vision.params,),
                     assign(self), self._examples)]

    def _examples(self) -> Iterator:
        """Each bucket's call, holding the processor's smallest image (the rest padding)."""
        pixels, grid = self.vision.processor.example()
        for bucket in self.buckets:
            yield self.vision.family.encoder_inputs(self.vision.config, [(pixels, grid)], bucket)[0]

    def activation_bytes(self) -> int:
        """A bound on the largest encode call's temporaries: what the KV plan leaves free for it."""
        return self.vision.family.activation_bytes(self.vision.config, self.buckets[-1])

    def stats(self) -> dict:
        """`SchedulerStats`' encoder fields."""
        cache = self.cache
        return dict(encoder_cache_queries=cache.hits + cache.misses, encoder_cache_hits=cache.hits,
                    images_encoded=self.images_encoded, encoder_seconds=self.encoder_seconds)

    def with_room(self, batch: PrefillBatch) -> PrefillBatch:
        return with_images(batch, self.width, self.dtype, self.bidirectional)

    def prepare(self, calls: list[PrefillInputs], rows_of: InputBatch, steps, frees: tuple[str, ...] = ()) -> None:
        """A step's image side: drops the embeddings the scheduler evicted (`frees`), encodes the images its chunks
        read that the cache lacks (`encode`), and gives each prefill call the embeddings of the image placeholders it
        holds (a call with none stays the text variant)."""
        self.cache.free(frees)
        missing: dict[str, ImageInput] = {}
        for inputs in calls:
            for _, chunk, image in self._images_in(inputs, rows_of):
                if image.mm_hash in self.cache or image.mm_hash in missing:
                    self.cache.hits += 1
                else:
                    self.cache.misses += 1
                    missing[image.mm_hash] = image
        for image, embeddings in zip(missing.values(), self.encode(list(missing.values()), steps)):
            self.cache.put(image.mm_hash, embeddings)
        for inputs in calls:
            self._attach(inputs, rows_of)

    def encode(self, images: list[ImageInput], steps) -> list[np.ndarray]:
        """Each image's embeddings `[num_tokens, width]`, in calls of as many images as the largest bucket holds."""
        out, group, patches = [], [], 0
        for image in [*images, None]:
            size = 0 if image is None else int(np.prod(image.grid_thw))
            if group and (image is None or patches + size > self.buckets[-1]):
                out += self._encode_call(group, patches, steps)
                group, patches = [], 0
            if image is not None:
                group.append(image)
                patches += size
        return out

    def _encode_call(self, images: list[ImageInput], patches: int, steps) -> list[np.ndarray]:
        started = time.perf_counter()
        encoder_inputs, orders = self.vision.family.encoder_inputs(
            self.vision.config, [(image.pixel_values, image.grid_thw) for image in images],
            bucket_for(patches, self.buckets))
        out = np.asarray(jax.device_get(steps.run("encode", encoder_inputs)))
        self.calls += 1
        self.images_encoded += len(images)
        self.encoder_seconds += time.perf_counter() - started
        return [out[order].astype(self.dtype) for order in orders]

    @staticmethod
    def _images_in(inputs: PrefillInputs, rows_of: InputBatch) -> Iterator[tuple[int, Any, ImageInput]]:
        """(row, chunk, image) for each image placeholder run a call's chunks reach."""
        for row, chunk in enumerate(inputs.chunks):
            mm = rows_of.mm[rows_of.slot_of[chunk.seq_id]]
            for image in [] if mm is None else mm.images_in(chunk.start, chunk.start + chunk.num_tokens):
                yield row, chunk, image

    def _attach(self, inputs: PrefillInputs, rows_of: InputBatch) -> None:
        batch = inputs.batch
        for row, chunk, image in self._images_in(inputs, rows_of):
            if batch.mm_embeds is None:
                batch = self.with_room(batch)
            embeddings = self.cache[image.mm_hash]
            first, last = max(image.offset, chunk.start), min(image.end, chunk.start + chunk.num_tokens)
            batch.mm_embeds[row, first - chunk.start:last - chunk.start] = \
                embeddings[first - image.offset:last - image.offset]
            batch.mm_mask[row, first - chunk.start:last - chunk.start] = True
            if batch.query_limits is not None:
                batch.query_limits[row, first - chunk.start:last - chunk.start] = image.end - 1
        inputs.batch = batch

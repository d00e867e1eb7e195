"""`Encoder`: the runner's image side (an image + text model's) — the vision tower's `encode` step, compiled at
start-up for each patch-count bucket; the encoder cache (vLLM's), image embeddings on the host keyed by the image's
hash, so an image repeated in a conversation or shared by requests is encoded once; and each prefill call's
embeddings at its image placeholders (`attach`).

A chunk that reaches an image's placeholder tokens encodes the whole image (or finds it cached) and takes the rows of
its tokens; chunked prefill may split an image's tokens over several chunks, which read the cache in turn. The cache
keeps the most recently used embeddings up to `cache_tokens` rows; an image is encoded again only if it was evicted.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.engine.config import power_of_two_buckets
from jaxserve.engine.input_batch import InputBatch
from jaxserve.engine.step_inputs import PrefillInputs, bucket_for, with_images
from jaxserve.engine.step_registry import Step, assign, jit_step
from jaxserve.engine.steps import PrefillBatch
from jaxserve.multimodal.inputs import ImageInput
from jaxserve.multimodal.vision import VisionModel



class EncoderCache:
    """Image embeddings by image hash, least recently used evicted first once they hold more than `budget` rows."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.rows = 0
        self.hits = 0
        self.misses = 0

    def get(self, mm_hash: str) -> np.ndarray | None:
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(mm_hash)
        return entry

    def put(self, mm_hash: str, embeddings: np.ndarray) -> None:
        self._entries[mm_hash] = embeddings
        self.rows += len(embeddings)
        while self.rows > self.budget and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self.rows -= len(evicted)


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
        self.cache = EncoderCache(max(4 * max_num_batched_tokens, 2 * vision.processor.max_tokens()))
        self.images_encoded = 0
        self.encoder_seconds = 0.0

    def steps(self) -> list[Step]:
        vision = self.vision
        replicated = NamedSharding(self.mesh, REPLICATED)
        params_in = jax.tree.map(lambda _: replicated, vision.params)
        encode = functools.partial(vision.family.encode, vision.config, self.dtype)
        return [Step("encode", jit_step(encode, self.mesh, (params_in,), (), donate=()), lambda: (vision.params,),
                     assign(self), self._examples)]

    def _examples(self) -> Iterator:
        """Each bucket's call, holding the processor's smallest image (the rest padding)."""
        pixels, grid = self.vision.processor.example()
        for bucket in self.buckets:
            yield self.vision.family.encoder_inputs(self.vision.config, pixels, grid, bucket)[0]

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

    def attach(self, inputs: PrefillInputs, rows_of: InputBatch, steps) -> None:
        """Gives a prefill call the embeddings of the image placeholders its chunks hold (encoding what the cache
        lacks through `steps`); a call with none stays the text variant."""
        batch = inputs.batch
        for row, chunk in enumerate(inputs.chunks):
            mm = rows_of.mm[rows_of.slot_of[chunk.seq_id]]
            stop = chunk.start + chunk.num_tokens
            for image in [] if mm is None else mm.images_in(chunk.start, stop):
                if batch.mm_embeds is None:
                    batch = self.with_room(batch)
                embeddings = self.embeddings(image, steps)
                first, last = max(image.offset, chunk.start), min(image.end, stop)
                batch.mm_embeds[row, first - chunk.start:last - chunk.start] = \
                    embeddings[first - image.offset:last - image.offset]
                batch.mm_mask[row, first - chunk.start:last - chunk.start] = True
                if batch.query_limits is not None:
                    batch.query_limits[row, first - chunk.start:last - chunk.start] = image.end - 1
        inputs.batch = batch

    def embeddings(self, image: ImageInput, steps) -> np.ndarray:
        """The image's embeddings `[num_tokens, hidden]`, from the cache or encoded now."""
        cached = self.cache.get(image.mm_hash)
        if cached is not None:
            return cached
        started = time.perf_counter()
        config = self.vision.config
        bucket = bucket_for(int(np.prod(image.grid_thw)), self.buckets)
        encoder_inputs, order = self.vision.family.encoder_inputs(config, image.pixel_values, image.grid_thw, bucket)
        out = steps.run("encode", encoder_inputs)
        embeddings = np.asarray(jax.device_get(out))[:image.num_tokens][order].astype(self.dtype)
        self.cache.put(image.mm_hash, embeddings)
        self.images_encoded += 1
        self.encoder_seconds += time.perf_counter() - started
        return embeddings

"""`EncoderCacheManager`: the scheduler's side of the encoder cache (vLLM's): which images' embeddings the runner
holds, and how much image encoding one step may do.

The runner keeps image embeddings by image hash (`engine/encoder.py`) and drops only what this record evicts: the
least recently used images past `cache_size` rows, never one a chunk of the current step reads; evictions reach the
runner with the step (`SchedulerOutput.encoder_frees`). The encoder budget (vLLM's `max_num_encoder_input_tokens`)
bounds the rows of images a step encodes, so a request with many images does not stall the decodes: a prefill chunk
stops before the first image the cache lacks that would pass it, except that a step's first image is always
encoded (the budget holds the largest image). An image the runner lacks all the same (its chunk was preempted within
the step) is encoded when a chunk reads it, so outputs never depend on this record.
"""

from __future__ import annotations

import collections

from jaxserve.engine.sequence import Sequence


class EncoderCacheManager:
    def __init__(self, cache_size: int, step_budget: int):
        self.cache_size = cache_size
        self.step_budget = step_budget
        self._held: collections.OrderedDict[str, int] = collections.OrderedDict()  # image hash -> rows
        self._rows = 0
        self._step_rows = 0  # rows of the images this step encodes
        self._step_images: set[str] = set()  # images this step's chunks read

    @classmethod
    def for_model(cls, max_num_batched_tokens: int, max_image_tokens: int) -> EncoderCacheManager:
        """vLLM's defaults, raised to hold the largest image: a step encodes up to a step's tokens; the cache keeps
        four steps' worth, at least two of the largest images."""
        return cls(max(4 * max_num_batched_tokens, 2 * max_image_tokens),
                   max(max_num_batched_tokens, max_image_tokens))

    def chunk_tokens(self, seq: Sequence, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` from `start` a prefill chunk of `seq` may take: no more than
        `Sequence.chunk_tokens` allows, ending before an image whose encoding would pass the step's budget."""
        num_tokens = seq.chunk_tokens(start, num_tokens)
        if seq.mm is None:
            return num_tokens
        rows, counted = self._step_rows, set()
        for image in seq.mm.images_in(start, start + num_tokens):
            if image.mm_hash in self._held or image.mm_hash in counted:
                continue
            if rows and rows + image.num_tokens > self.step_budget:
                return max(image.offset, start) - start
            rows += image.num_tokens
            counted.add(image.mm_hash)
        return num_tokens

    def took(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """Records a scheduled chunk: the images it reads are held from now on (encoded this step if they were
        not)."""
        for image in [] if seq.mm is None else seq.mm.images_in(start, start + num_tokens):
            self._step_images.add(image.mm_hash)
            if image.mm_hash in self._held:
                self._held.move_to_end(image.mm_hash)
                continue
            self._held[image.mm_hash] = image.num_tokens
            self._rows += image.num_tokens
            self._step_rows += image.num_tokens

    def end_step(self) -> tuple[str, ...]:
        """Closes the step's record: the images evicted (least recently used past `cache_size`, none of this
        step's), for the runner to drop."""
        evicted = []
        for mm_hash in list(self._held):
            if self._rows <= self.cache_size:
                break
            if mm_hash not in self._step_images:
                self._rows -= self._held.pop(mm_hash)
                evicted.append(mm_hash)
        self._step_rows, self._step_images = 0, set()
        return tuple(evicted)

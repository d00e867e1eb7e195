"""`InputProcessor`: a request's way in, on the caller's thread — tokenize, read and preprocess its images (an image
model's: placeholders expanded, `MultiModalPrompt`), validate (a `ValueError` naming the problem), compile its
grammar, take its id, and build its `Request`: one `Sequence` and one text state per completion. It also owns the
ids of unfinished requests, so an id in use is refused at once."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.detokenizer import DetokenizedText, IncrementalDetokenizer
from jaxserve.engine.request import Request
from jaxserve.engine.sequence import Sequence
from jaxserve.lora.cache import AdapterCache
from jaxserve.lora.request import LoRARequest
from jaxserve.multimodal.inputs import MultiModalPrompt
from jaxserve.multimodal.media import MediaPolicy, load_image
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import GrammarCompiler

PromptType = str | list[int] | dict[str, Any]
SEED_STRIDE = 0x9E3779B1  # completion i of a request samples with seed + i * SEED_STRIDE (mod 2**32)


def check_priority(priority: int, scheduling_policy: str) -> None:
    """vLLM's rule: a request priority other than 0 needs scheduling_policy="priority"."""
    if not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority {priority} is set, but priority scheduling is not enabled "
                         "(scheduling_policy='priority', --scheduling-policy priority)")


class InputProcessor:
    """`detokenizer_process`: the completions' text comes from a detokenizer process (`DetokenizedText` mirrors)
    instead of an `IncrementalDetokenizer` each."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, grammars: GrammarCompiler,
                 detokenizer_process: bool = False, adapters: AdapterCache | None = None, images=None):
        self.engine_config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.detokenizer_process = detokenizer_process
        self.adapters = adapters  # LoRA: the host cache (None: enable_lora is off)
        self.images = images  # an image model's prompt processor (`multimodal/qwen_vl.py`); None: text only
        self.media = MediaPolicy(config.allowed_local_media_path)
        self._ids_lock = threading.Lock()
        self._live_ids: set[str] = set()  # ids accepted and not yet finished
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)

    def make_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams, priority: int = 0,
                     arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Validates a request and builds it (ValueError naming the problem: then nothing is taken)."""
        prompt = self.prepare(prompt)
        prompt_text, token_ids, mm = prompt.get("prompt"), prompt["prompt_token_ids"], prompt.get("mm_inputs")
        self.validate_prompt(token_ids, params)
        check_priority(priority, self.engine_config.scheduling_policy)
        adapter = self.adapter(lora_request)
        # the grammar compiles here (cached by its text), before the id is taken; each sequence gets its own copy
        grammar = self.grammars.matcher(params.guided_decoding) if params.guided_decoding is not None else None
        with self._ids_lock:
            if request_id is None:
                request_id = next(str(i) for i in self._request_counter if str(i) not in self._live_ids)
            elif request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
            self._live_ids.add(request_id)
        arrival_time = arrival_time or time.monotonic()
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seqs, texts = [], []
        ttft_ms = params.ttft_slo_ms if params.ttft_slo_ms is not None else self.engine_config.ttft_slo_ms
        tpot_ms = params.tpot_slo_ms if params.tpot_slo_ms is not None else self.engine_config.tpot_slo_ms
        for index in range(params.n):
            seq = Sequence(request_id, index, token_ids, params, (base_seed + SEED_STRIDE * index) % 2**32,
                           arrival_time, priority)
            seq.ttft_slo = ttft_ms / 1000 if ttft_ms is not None else None
            seq.tpot_slo = tpot_ms / 1000 if tpot_ms is not None else None
            if grammar is not None:
                seq.grammar = grammar.deep_copy()
            seq.lora = adapter
            if mm is not None:
                seq.set_images(mm)
            seqs.append(seq)
            texts.append(DetokenizedText(params.stop) if self.detokenizer_process else
                         IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
                                                params.include_stop_str_in_output))
        return Request(request_id, prompt_text, token_ids, params, seqs, texts, arrival_time)

    def prepare(self, prompt: PromptType) -> dict[str, Any]:
        """The prompt tokenized and its images processed: `{"prompt": text or None, "prompt_token_ids": [...]}`, with
        `"mm_inputs"` (a `MultiModalPrompt`) when it has images. A prepared prompt is returned as it is, so a caller
        may prepare (and validate) first and submit later. ValueError naming the problem."""
        if isinstance(prompt, dict) and "mm_inputs" in prompt:
            if not isinstance(prompt["mm_inputs"], MultiModalPrompt):
                raise ValueError("mm_inputs must be a MultiModalPrompt (what prepare() returns)")
            return prompt
        with_images = isinstance(prompt, dict) and bool(prompt.get("multi_modal_data"))
        text, token_ids = self.tokenize(prompt, with_images)
        token_ids, mm = self.process_images(prompt, token_ids)
        return {"prompt": text, "prompt_token_ids": token_ids, **({"mm_inputs": mm} if mm is not None else {})}

    def process_images(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], MultiModalPrompt | None]:
        """The prompt's images (`multi_modal_data`) read, checked and preprocessed, their placeholders expanded; an
        image model's text prompt is checked for stray placeholders. ValueError naming the problem."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is not None and not isinstance(data, dict):
            raise ValueError("multi_modal_data must be a dict such as {'image': image or [images]}")
        unknown = sorted(set(data or {}) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data modality {unknown[0]!r} is not supported (jaxserve takes 'image')")
        images = (data or {}).get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if self.images is None:
            if images:
                raise ValueError("this model takes no images (it is served text-only)")
            return token_ids, None
        limit = (self.engine_config.limit_mm_per_prompt or {}).get("image")
        if limit is not None and len(images) > limit:
            raise ValueError(f"the prompt has {len(images)} images, but at most {limit} are allowed per prompt "
                             "(limit_mm_per_prompt, --limit-mm-per-prompt)")
        if not images and self.images.image_token_id not in token_ids:
            return token_ids, None
        return self.images.process(token_ids, [load_image(image, self.media) for image in images])

    def adapter(self, lora_request: LoRARequest | None):
        """The read adapter of a request's `lora_request` (None: the base model); ValueError naming the problem."""
        if lora_request is None:
            return None
        if self.adapters is None:
            raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} was requested, but "
                             "LoRA is not enabled (enable_lora=True, --enable-lora)")
        return self.adapters.get(lora_request)

    def release(self, request_id: str) -> None:
        """A finished request's id may be used again."""
        with self._ids_lock:
            self._live_ids.discard(request_id)

    def tokenize(self, prompt: PromptType, with_images: bool = False) -> tuple[str | None, list[int]]:
        """The prompt's text (None if given as ids) and ids; a text prompt `with_images` has its image placeholders
        expanded in the text before it is tokenized, as the family's processor does."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return self.tokenize({"prompt_token_ids": list(prompt)})
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        return prompt, self.tokenizer.encode(self.expand_images(prompt) if with_images else prompt)

    def encode_chat(self, text: str) -> list[int]:
        """A rendered conversation with images as ids: its placeholders expanded in the text, then tokenized
        without added special tokens (the template writes them), as the family's processor tokenizes it."""
        return self.tokenizer.encode(self.expand_images(text), add_special_tokens=False)

    def expand_images(self, text: str) -> str:
        """`text` with each image placeholder expanded by the family's processor (`expand_text`); no image model:
        `text`. Expanding the text, not the ids, keeps the tokenizer's merges across the placeholder's edges."""
        return text if self.images is None else self.images.expand_text(text)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.engine_config.max_model_len
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, but max_model_len is {max_len}")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({max_len})")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def validate_guided_decoding(self, params: SamplingParams) -> None:
        """Compiles a request's grammar (cached by its text); ValueError with llguidance's message if it fails."""
        if params.guided_decoding is not None:
            self.grammars.compile(params.guided_decoding)

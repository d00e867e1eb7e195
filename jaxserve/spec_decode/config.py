"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked key by key before anything is loaded."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

MTP_METHODS = ("mtp", "deepseek_mtp", "qwen3_next_mtp")  # the last two: vLLM's older spellings of mtp
METHODS = ("ngram", "draft_model", "eagle3", *MTP_METHODS)
CPU_DISABLE_BY_BATCH_SIZE = 2


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram" proposes from the request's own tokens (prompt lookup decoding); "draft_model" (the method
    when `model` is set) from a smaller model with the target's vocabulary, running in the engine with its own
    KV pool; "eagle3" from an EAGLE-3 head (`model`: its directory) reading the target's hidden states, with its
    own one-layer KV pool; "mtp" (or "deepseek_mtp", "qwen3_next_mtp") from the target's own
    multi-token-prediction layer (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5), read from its checkpoint (`model`:
    unset, or the checkpoint to read it from), with its own KV pool. `model` may be a hub id (at `revision`). `num_speculative_tokens` (K) tokens are
    proposed per sequence and step; every step whose batch reaches `disable_by_batch_size` sequences decodes without
    speculation (a large batch is compute-bound, where verifying K+1 tokens per sequence costs more than it saves). Left out of the dict, it is
    `CPU_DISABLE_BY_BATCH_SIZE` on a CPU (measured there: speculation pays single-stream only; RESULTS.md) and
    unset on accelerators (not measured yet)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None
    revision: str | None = None  # of a hub id `model`: a branch, tag or commit

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None",
              default_disable_by_batch_size: int | None = None) -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the server's `--speculative-config`); ValueError naming the bad key.
        `default_disable_by_batch_size` stands in for that key when the dict leaves it out."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from err
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r} (known: {sorted(known)})")
        options: dict[str, Any] = dict(value)
        if "method" not in options:
            options["method"] = "draft_model" if options.get("model") else "ngram"
        options.setdefault("disable_by_batch_size", default_disable_by_batch_size)
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        config = cls(**options)
        config.check()
        return config

    def check(self) -> None:
        def fail(key: str, message: str) -> None:
            raise ValueError(f"speculative_config {key!r} {message}, got {getattr(self, key)!r}")

        if self.method not in METHODS:
            fail("method", f"must be one of {METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            fail("num_speculative_tokens", "must be an integer >= 1")
        if self.method == "ngram":
            if self.model is not None:
                fail("model", "is for method 'draft_model', not 'ngram'")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, key)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    fail(key, "must be an integer >= 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                fail("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        elif self.uses_mtp:
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                fail("model", "must be unset (the target's checkpoint) or name the checkpoint holding the MTP layers")
        elif not isinstance(self.model, str) or not self.model:
            fail("model", "must name the draft model (a checkpoint directory, a .gguf file or the default model)"
                 if self.method == "draft_model" else "must name the EAGLE-3 head's directory")
        if self.revision is not None and (not isinstance(self.revision, str) or self.model is None):
            fail("revision", "must be a string, beside a hub id 'model'")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            fail("disable_by_batch_size", "must be an integer >= 1 or None")

    @property
    def uses_head(self) -> bool:
        """Drafts come from a head reading the target's hidden states (`engine/speculative_head.py`)."""
        return self.method == "eagle3" or self.uses_mtp

    @property
    def uses_mtp(self) -> bool:
        return self.method in MTP_METHODS

    @property
    def has_pool(self) -> bool:
        """The proposer keeps a KV pool of its own, named by the target's page tables (one KV cache group)."""
        return self.method == "draft_model" or self.uses_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

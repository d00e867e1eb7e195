"""jaxserve: a JAX/XLA inference engine for LLMs — paged KV cache, continuous batching, Pallas kernels.

The public names load on first use, so the host-only core (`jaxserve.engine.scheduler` and what it reads) imports
without jax."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.engine.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import LLM
    from jaxserve.lora.request import LoRARequest
    from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
    from jaxserve.sampling_params import GuidedDecodingParams, SamplingParams

_WHERE = {"LLM": "jaxserve.llm", "LLMEngine": "jaxserve.engine.llm_engine", "EngineConfig": "jaxserve.engine.config",
          "SamplingParams": "jaxserve.sampling_params", "GuidedDecodingParams": "jaxserve.sampling_params",
          "RequestOutput": "jaxserve.outputs", "CompletionOutput": "jaxserve.outputs", "Logprob": "jaxserve.outputs",
          "LoRARequest": "jaxserve.lora.request"}
__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

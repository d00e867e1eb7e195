"""jaxserve: a JAX/XLA inference engine for LLMs — paged KV cache, continuous batching, Pallas kernels."""

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
           "Logprob", "LoRARequest"]
__version__ = "0.1.0"

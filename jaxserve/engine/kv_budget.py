"""How many pages the KV pool gets: vLLM's `gpu_memory_utilization` on an accelerator, enough pages for every
slot (up to a fixed budget) on a CPU; what one page takes, and the pool itself."""

from __future__ import annotations

import os

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.config import EngineConfig
from jaxserve.layers.attention import PagedAttention

DEFAULT_ALLOCATOR_FRACTION = "0.75"  # jax's default XLA_PYTHON_CLIENT_MEM_FRACTION on GPU
CPU_POOL_BYTES = 4 * 2**30


def kv_pages(device, config: ModelConfig, engine_config: EngineConfig, page_bytes: int,
             device_page_bytes: int) -> int:
    """Pages for a pool whose page takes `page_bytes` in all and `device_page_bytes` on each device (every device
    of the mesh holds the same share, so one `device`'s memory decides)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_ALLOCATOR_FRACTION))
        return accelerator_kv_pages(stats, engine_config.gpu_memory_utilization, fraction,
                                    activation_bytes(config, engine_config), device_page_bytes)
    enough_for_all_slots = engine_config.max_num_seqs * engine_config.pages_per_seq + 1
    return max(2, min(enough_for_all_slots, CPU_POOL_BYTES // page_bytes))


def activation_bytes(config: ModelConfig, engine_config: EngineConfig) -> int:
    """A bound on one step's live activations: the widest layer's for the largest prefill, plus logits and the
    sampler's float32 copies of them for the largest batch."""
    ec = engine_config
    width = config.hidden_size * 4 + config.q_size + 2 * config.kv_size + 3 * config.intermediate_size
    if config.moe is not None:  # each token's top_k rows: their inputs, SwiGLU and outputs
        width += config.moe.top_k * (3 * config.moe.intermediate_size + 2 * config.hidden_size)
    rows = max(max(ec.decode_batch_buckets), max(r for r, _ in ec.prefill_shapes))
    return 4 * (ec.max_num_batched_tokens * width + 4 * rows * config.vocab_size)


def accelerator_kv_pages(memory_stats: dict, utilization: float, allocator_fraction: float,
                         activation_bytes: int, page_bytes: int) -> int:
    """KV pages for vLLM's `gpu_memory_utilization`: weights (already in use), KV pages and the largest step's
    activations together take at most `utilization` of the device's memory. jax's allocator may use
    `allocator_fraction` of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set; `jaxserve serve`
    sets it to the utilization), so the device's total is the allocator's limit over that fraction."""
    limit = memory_stats["bytes_limit"]
    budget = min(utilization * limit / allocator_fraction, limit) - memory_stats.get("bytes_in_use", 0)
    return max(2, int(budget - activation_bytes) // page_bytes)


def page_bytes(config: ModelConfig, tp: TensorParallel, backend: PagedAttention, page_size: int, dtype) -> int:
    """Bytes of one page of a model's pool over all layers and all devices (K and V; a quantized cache's scales
    included)."""
    return 2 * config.num_layers * page_size * tp.pool_heads(config) * backend.token_bytes(config.head_dim, dtype)


def empty_pool(config: ModelConfig, tp: TensorParallel, backend: PagedAttention, num_pages: int, page_size: int,
               dtype) -> tuple[list, tuple[int, ...]]:
    """A model's page pool, one (K, V) pair per layer (arrays, or QuantizedPages: values + per-token scales for an
    int8/fp8 cache), and the shape of each."""
    shape = backend.pool_shape(num_pages, page_size, tp.pool_heads(config), config.head_dim)
    return [tuple(backend.empty_pool(shape, dtype) for _ in "kv") for _ in range(config.num_layers)], shape

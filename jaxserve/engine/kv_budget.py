"""How many bytes each device gives its KV pools: `kv_cache_memory_bytes`, or vLLM's `gpu_memory_utilization` on an
accelerator (None on a CPU, whose pools are sized by their slots), and what one page takes. The KV plan
(`engine/kv_plan.py`) turns the budget into each KV cache group's pages."""

from __future__ import annotations

import os
from typing import Sequence

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.config import EngineConfig
from jaxserve.layers.attention import PagedAttention

DEFAULT_ALLOCATOR_FRACTION = "0.75"  # jax's default XLA_PYTHON_CLIENT_MEM_FRACTION on GPU
CPU_POOL_BYTES = 4 * 2**30
MIN_ACTIVATION_BYTES = 64 * 2**20
# float32 [rows, vocab] arrays the sampler holds at once (logits, probabilities, the sort's keys and indices, the
# cumulative sum, ...), as jaxserve compile finds them on a TPU (benchmarks/RESULTS.md, issue 44)
SAMPLER_COPIES = 10


def kv_budget_bytes(memory_stats: dict | None, platform: str, config: ModelConfig,
                    engine_config: EngineConfig, encoder_bytes: int = 0, transfer_bytes: int = 0) -> int | None:
    """Bytes each device gives its KV pools (every device of the mesh holds the same share, so one device's
    `memory_stats` decide, taken with the weights in place): `kv_cache_memory_bytes` when set, else vLLM's
    `gpu_memory_utilization` on an accelerator; None on a CPU, whose pool is sized by its slots. An image model's
    largest encode call may hold `encoder_bytes` of temporaries (one step runs at a time: the larger reserve
    serves both); prefill/decode disaggregation's pages in transit (`transfer_reserve`) stay between steps."""
    if engine_config.kv_cache_memory_bytes is not None:
        return engine_config.kv_cache_memory_bytes
    if "bytes_limit" not in (memory_stats or {}):
        return None
    return accelerator_kv_bytes(memory_stats, engine_config.gpu_memory_utilization, allocator_fraction(platform),
                                max(activation_bytes(config, engine_config), encoder_bytes) + transfer_bytes)


def transfer_reserve(engine_config: EngineConfig, largest_transfer_bytes: int) -> int:
    """Bytes per device left for prefill/decode disaggregation's pages in transit (a prefill worker's gathered
    copies until they are pulled, a decode worker's pulled pages until their request is admitted): the config's
    `kv_buffer_size`, and no less than the largest transfer's per device."""
    transfer = engine_config.kv_transfer
    return 0 if transfer is None else max(int(transfer.kv_buffer_size), largest_transfer_bytes)


def allocator_fraction(platform: str) -> float:
    """The fraction of a device's memory jax's allocator reports as its `bytes_limit`: XLA_PYTHON_CLIENT_MEM_FRACTION
    (0.75 unless set) on a GPU; a TPU's limit is its whole memory."""
    if platform != "gpu":
        return 1.0
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_ALLOCATOR_FRACTION))


def cpu_pool_pages(engine_config: EngineConfig, page_bytes: int) -> int:
    """Pages of `page_bytes` for a pool without a byte budget (a CPU): enough for every slot, up to a fixed size."""
    enough_for_all_slots = engine_config.max_num_seqs * engine_config.pages_per_seq + 1
    return max(2, min(enough_for_all_slots, CPU_POOL_BYTES // max(page_bytes, 1)))


def activation_bytes(config: ModelConfig, engine_config: EngineConfig) -> int:
    """A bound on one step's live activations: the widest layer's for the largest prefill, plus logits and the
    sampler's float32 copies of them for the largest batch, and no less than `MIN_ACTIVATION_BYTES` (a small
    model's steps hold buffers this formula does not count: rope tables, the executable itself). `jaxserve compile`
    checks it against each step's compiled temporaries (tests/test_compile_targets.py)."""
    ec = engine_config
    views = [config.for_layer(layer) for layer in config.layers] or [config]  # the widest layer's
    width = max(view.hidden_size * 4 + view.q_size + 2 * view.kv_size + 3 * view.intermediate_size for view in views)
    if config.moe is not None:  # each token's top_k rows: their inputs, SwiGLU and outputs
        width += config.moe.top_k * (3 * config.moe.intermediate_size + 2 * config.hidden_size)
    if config.mla is not None:  # every head's query and output in latent space (float32) and its padded query
        mla = config.mla
        width += config.num_q_heads * (3 * mla.kv_lora_rank + 2 * mla.cache_dim + mla.v_head_dim)
    rows = max(max(ec.decode_batch_buckets), max(r for r, _ in ec.prefill_shapes))
    return max(MIN_ACTIVATION_BYTES,
               4 * (ec.max_num_batched_tokens * width + SAMPLER_COPIES * rows * config.vocab_size))


def accelerator_kv_bytes(memory_stats: dict, utilization: float, allocator_fraction: float,
                         activation_bytes: int) -> int:
    """KV bytes for vLLM's `gpu_memory_utilization`: weights (already in use), KV pages and the largest step's
    activations together take at most `utilization` of the device's memory. jax's allocator may use
    `allocator_fraction` of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set; `jaxserve serve`
    sets it to the utilization), so the device's total is the allocator's limit over that fraction."""
    limit = memory_stats["bytes_limit"]
    budget = min(utilization * limit / allocator_fraction, limit) - memory_stats.get("bytes_in_use", 0)
    return int(budget - activation_bytes)


def page_bytes(config: ModelConfig, tp: TensorParallel, backend: PagedAttention, page_size: int, dtype,
               layers: Sequence[int] | None = None) -> int:
    """Bytes of one page of a model's pool over `layers` (default: every layer that keeps pages) and all devices
    (K and V, each layer in its own head size and KV heads; a quantized cache's scales included)."""
    if layers is None:
        layers = [index for index, layer in enumerate(config.layers)
                  if layer.mixer == "attention" and layer.kv_source is None]
    if config.mla is not None:  # one latent row per token, no V pool
        return len(layers) * page_size * tp.size * backend.token_bytes(config.mla.cache_dim, dtype)
    views = [config.for_layer(config.layers[layer]) for layer in layers]
    return sum(2 * page_size * tp.pool_heads(view) * backend.token_bytes(view.head_dim, dtype) for view in views)

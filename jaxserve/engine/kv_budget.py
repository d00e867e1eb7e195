"""How many pages the KV pool gets: vLLM's `gpu_memory_utilization` on an accelerator, enough pages for every
slot (up to a fixed budget) on a CPU; what one page takes, and the pool itself.

Under the hybrid KV cache (`engine/window_pages.py`) the sliding-window layers have a pool of their own, sized
for every slot's window (`window_pages_per_seq`: a window plus the largest step's tokens), and the full-attention
layers get the rest of the budget (`hybrid_pages`)."""

from __future__ import annotations

import os

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.allocator import Allocator
from jaxserve.engine.config import EngineConfig
from jaxserve.layers.attention import PagedAttention

DEFAULT_ALLOCATOR_FRACTION = "0.75"  # jax's default XLA_PYTHON_CLIENT_MEM_FRACTION on GPU
CPU_POOL_BYTES = 4 * 2**30
MIN_ACTIVATION_BYTES = 64 * 2**20
# float32 [rows, vocab] arrays the sampler holds at once (logits, probabilities, the sort's keys and indices, the
# cumulative sum, ...), as jaxserve compile finds them on a TPU (benchmarks/RESULTS.md, issue 44)
SAMPLER_COPIES = 10


def kv_budget_bytes(memory_stats: dict | None, platform: str, config: ModelConfig,
                    engine_config: EngineConfig) -> int | None:
    """Bytes each device gives its KV pools (every device of the mesh holds the same share, so one device's
    `memory_stats` decide, taken with the weights in place): `kv_cache_memory_bytes` when set, else vLLM's
    `gpu_memory_utilization` on an accelerator; None on a CPU, whose pool is sized by its slots."""
    if engine_config.kv_cache_memory_bytes is not None:
        return engine_config.kv_cache_memory_bytes
    if "bytes_limit" not in (memory_stats or {}):
        return None
    return accelerator_kv_bytes(memory_stats, engine_config.gpu_memory_utilization, allocator_fraction(platform),
                                activation_bytes(config, engine_config))


def allocator_fraction(platform: str) -> float:
    """The fraction of a device's memory jax's allocator reports as its `bytes_limit`: XLA_PYTHON_CLIENT_MEM_FRACTION
    (0.75 unless set) on a GPU; a TPU's limit is its whole memory."""
    if platform != "gpu":
        return 1.0
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_ALLOCATOR_FRACTION))


def kv_pages(budget_bytes: int | None, engine_config: EngineConfig, page_bytes: int, device_page_bytes: int) -> int:
    """Pages for a pool whose page takes `page_bytes` in all and `device_page_bytes` on each device: the budget's
    worth, or (no budget: a CPU) enough for every slot up to a fixed size."""
    if budget_bytes is not None:
        return max(2, budget_bytes // device_page_bytes)
    enough_for_all_slots = engine_config.max_num_seqs * engine_config.pages_per_seq + 1
    return max(2, min(enough_for_all_slots, CPU_POOL_BYTES // page_bytes))


def activation_bytes(config: ModelConfig, engine_config: EngineConfig) -> int:
    """A bound on one step's live activations: the widest layer's for the largest prefill, plus logits and the
    sampler's float32 copies of them for the largest batch, and no less than `MIN_ACTIVATION_BYTES` (a small
    model's steps hold buffers this formula does not count: rope tables, the executable itself). `jaxserve compile`
    checks it against each step's compiled temporaries (tests/test_compile_targets.py)."""
    ec = engine_config
    width = config.hidden_size * 4 + config.q_size + 2 * config.kv_size + 3 * config.intermediate_size
    if config.moe is not None:  # each token's top_k rows: their inputs, SwiGLU and outputs
        width += config.moe.top_k * (3 * config.moe.intermediate_size + 2 * config.hidden_size)
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


def accelerator_kv_pages(memory_stats: dict, utilization: float, allocator_fraction: float,
                         activation_bytes: int, page_bytes: int) -> int:
    """`accelerator_kv_bytes` in pages of `page_bytes` (at least 2)."""
    return max(2, accelerator_kv_bytes(memory_stats, utilization, allocator_fraction, activation_bytes) // page_bytes)


def page_bytes(config: ModelConfig, tp: TensorParallel, backend: PagedAttention, page_size: int, dtype,
               num_layers: int | None = None) -> int:
    """Bytes of one page of a model's pool over all layers (or `num_layers` of them) and all devices (K and V; a
    quantized cache's scales included)."""
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * page_size * tp.pool_heads(config) * backend.token_bytes(config.head_dim, dtype)


def hybrid_window(config: ModelConfig, engine_config: EngineConfig) -> int | None:
    """The window of the hybrid KV cache's window pool (the largest of the layers'), or None for one pool: no
    layer has a window, the hybrid cache is disabled (or off for the KV tiers or a draft model, which copy or share
    the whole pool by page), or a window pool would hold as many pages per sequence as a full one."""
    ec = engine_config
    windows = [window for window in config.layer_sliding_windows if window is not None]
    if (not windows or ec.disable_hybrid_kv_cache_manager or ec.kv_tiers
            or (ec.speculative_config is not None and ec.speculative_config.method == "draft_model")):
        return None
    window = max(windows)
    return window if window_pages_per_seq(ec, window) < ec.pages_per_seq else None


def window_pages_per_seq(ec: EngineConfig, window: int) -> int:
    """The most window pages a sequence holds at once: its next token's window and the largest step's tokens."""
    step_tokens = max(ec.max_num_batched_tokens, ec.num_speculative_tokens + 1)
    return -(-(window - 1 + step_tokens) // ec.page_size) + 1


def hybrid_pages(ec: EngineConfig, window: int, budget_bytes: int | None, full_page_bytes: int,
                 window_page_bytes: int) -> tuple[int, int]:
    """(full pages, window pages) of the two pools, scratch pages included. Without a byte budget (a CPU, or
    `num_kv_pages` set): the window pool holds every slot's window. With one: split so that the two run out together
    for sequences of max_model_len, the window pool never more than every slot's window."""
    per_seq = window_pages_per_seq(ec, window)
    all_windows = ec.max_num_seqs * per_seq + 1
    if budget_bytes is None:
        full = ec.num_kv_pages or max(2, min(ec.max_num_seqs * ec.pages_per_seq + 1,
                                             CPU_POOL_BYTES // max(full_page_bytes, 1)))
        return full, all_windows
    full_need, window_need = ec.pages_per_seq * full_page_bytes, per_seq * window_page_bytes
    windows = max(2, min(all_windows, int(budget_bytes * window_need / (full_need + window_need)) // window_page_bytes))
    if not full_page_bytes:  # every layer has a window: the full pool holds nothing, its pages are only ids
        return ec.max_num_seqs * ec.pages_per_seq + 1, windows
    return max(2, (budget_bytes - windows * window_page_bytes) // full_page_bytes), windows


def empty_pool(config: ModelConfig, tp: TensorParallel, backend: PagedAttention, num_pages: int, page_size: int,
               dtype, allocator: Allocator, window_pages: int | None = None) -> tuple[list, tuple[int, ...]]:
    """A model's page pool, one (K, V) pair per layer (arrays, or QuantizedPages: values + per-token scales for an
    int8/fp8 cache), and the shape of each full layer's; `window_pages`: the hybrid KV cache's sliding-window layers
    have pools of that many pages."""
    def pool(pages: int) -> tuple:
        shape = backend.pool_shape(pages, page_size, tp.pool_heads(config), config.head_dim)
        return tuple(backend.empty_pool(shape, dtype, allocator) for _ in "kv")
    windows = config.layer_sliding_windows
    pools = [pool(window_pages if window_pages is not None and window is not None else num_pages)
             for window in windows]
    return pools, backend.pool_shape(num_pages, page_size, tp.pool_heads(config), config.head_dim)

"""The KV plan (vLLM's `KVCacheConfig`): what cache each layer keeps (its `KVCacheSpec`), which layers share page
tables (KV cache groups: layers with equal specs), and how many pages each group's pool gets, decided once from the
specs and the byte budget (`kv_budget_bytes`, or `num_kv_pages`). The runner allocates the pools the plan names
(`empty_kv_cache`), the scheduler's page managers count its pages, and the metrics, KV tiers and `jaxserve compile`
read it; nothing else sizes a pool.

Group 0 holds the full-attention layers (perhaps none: its page indices then only name pages) and owns the prefix
cache's chain; its page indices name every group's pages. Each other group is one sliding window's layers
(vLLM's hybrid KV cache): a pool of its own holding every slot's window and step, so a long sequence keeps only
window-sized K/V in those layers. Window layers fall into group 0 (full pages, read through the window mask) when
the hybrid cache is off (`disable_hybrid_kv_cache_manager`, the KV tiers, a draft model or an EAGLE-3 head, which
copy or share the whole pool by page) or their window holds as many pages per sequence as a full layer.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.allocator import Allocator
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_budget import cpu_pool_pages, page_bytes
from jaxserve.layers.attention import KVPages, PagedAttention
from jaxserve.layers.state_slots import StateSlots, state_shardings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that keeps every position's K and V."""

    num_kv_heads: int
    head_size: int


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec:
    """A layer whose queries read only the last `window` positions: pages behind that are released."""

    num_kv_heads: int
    head_size: int
    window: int


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """A Multi-head Latent Attention layer (`layers/mla.py`): every position's latent and rope key, one row of
    `cache_dim` values, no V."""

    cache_dim: int


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """A layer that keeps a fixed-size state per sequence instead of pages (Gated DeltaNet's; `layers/
    state_slots.py`): its convolution's last inputs `[channels, width]` in the model's dtype and a float32
    recurrent state of `recurrent` shape, one of each per decode slot."""

    conv: tuple[int, int]
    recurrent: tuple[int, ...]

    def slot_bytes(self, dtype) -> int:
        """One slot's bytes over all devices."""
        return (math.prod(self.conv) * jnp.dtype(dtype).itemsize
                + math.prod(self.recurrent) * jnp.dtype(jnp.float32).itemsize)


@dataclasses.dataclass(frozen=True)
class KVSharingSpec:
    """A layer that reads layer `source`'s KV (vLLM's KV sharing; Gemma 4's last layers): no pages of its own, its
    queries read that layer's pool through that layer's group."""

    source: int


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec
FULL_SPECS = (FullAttentionSpec, MLASpec)  # the specs of group 0: every position kept


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]
    num_pages: int  # scratch page included
    page_bytes: int  # one page over the group's layers and all devices (K and V, scales included)
    page_size: int
    shapes: tuple[KVCacheSpec, ...] = ()  # its layers' specs when they differ in shape (vLLM's uniform-type specs)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the group's pool holds for sequences (page 0 is the scratch page)."""
        return (self.num_pages - 1) * self.page_size


@dataclasses.dataclass(frozen=True)
class KVPlan:
    page_size: int
    groups: tuple[KVCacheGroup, ...]
    layer_groups: tuple[int, ...]  # each layer's group, whose pages it reads (-1: a layer with a state, no pages)
    proposer_page_bytes: int = 0  # a draft model's or EAGLE-3 head's pool: group 0's pages, this many bytes each
    state: StateSpec | None = None  # the state layers' (`ModelConfig.state_layers`)
    state_slots: int = 0  # states each such layer keeps: one per decode slot (K + 1 under speculative decoding)
    state_slot_bytes: int = 0  # one slot's states over all state layers and devices
    state_checkpoints: int = 0  # states kept for prefix hits, as many bytes each (`engine/state_checkpoints.py`)

    @property
    def num_pages(self) -> int:
        """Group 0's pages: every sequence's page indices."""
        return self.groups[0].num_pages

    @property
    def capacity_tokens(self) -> int:
        """Tokens group 0 holds for sequences (page 0 is the scratch page)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of every pool over all devices (a draft model's or EAGLE-3 head's included)."""
        return (sum(group.num_pages * group.page_bytes for group in self.groups)
                + self.num_pages * self.proposer_page_bytes + self.state_bytes)

    @property
    def state_bytes(self) -> int:
        """Bytes of every state slot and checkpoint over all devices."""
        return (self.state_slots + self.state_checkpoints) * self.state_slot_bytes

    @property
    def window_groups(self) -> tuple[KVCacheGroup, ...]:
        return self.groups[1:]

    @property
    def layer_pages(self) -> list[int]:
        """Each layer's pool's pages (its group's; 0: a layer with a state, or reading another layer's pool)."""
        return [self.groups[group].num_pages if group >= 0 and layer in self.groups[group].layers else 0
                for layer, group in enumerate(self.layer_groups)]


def state_spec(config: ModelConfig) -> StateSpec | None:
    la = config.linear_attention
    if la is None:
        return None
    return StateSpec((la.conv_channels, la.conv_kernel - 1), (la.value_heads, la.key_dim, la.value_dim))


def layer_specs(config: ModelConfig) -> tuple[KVCacheSpec | StateSpec | KVSharingSpec, ...]:
    """Each layer's cache, as its family declares it (in the layer's own head size and KV heads)."""
    if config.mla is not None:
        return (MLASpec(config.mla.cache_dim),) * config.num_layers
    state = state_spec(config)

    def spec(layer) -> KVCacheSpec | StateSpec | KVSharingSpec:
        own = config.for_layer(layer)
        if layer.mixer != "attention":
            return state
        if layer.kv_source is not None:
            return KVSharingSpec(layer.kv_source)
        if layer.sliding_window is None:
            return FullAttentionSpec(own.num_kv_heads, own.head_dim)
        return SlidingWindowSpec(own.num_kv_heads, own.head_dim, layer.sliding_window)
    return tuple(spec(layer) for layer in config.layers)


def window_pages_per_seq(ec: EngineConfig, window: int) -> int:
    """The most window pages a sequence holds at once: its next token's window and the largest step's tokens."""
    step_tokens = max(ec.max_num_batched_tokens, ec.num_speculative_tokens + 1)
    return -(-(window - 1 + step_tokens) // ec.page_size) + 1


def pages_per_seq(spec: KVCacheSpec, ec: EngineConfig) -> int:
    return window_pages_per_seq(ec, spec.window) if isinstance(spec, SlidingWindowSpec) else ec.pages_per_seq


def group_layers(specs: tuple[KVCacheSpec | StateSpec | KVSharingSpec, ...], ec: EngineConfig
                 ) -> list[tuple[KVCacheSpec, list[int]]]:
    """(spec, layers) per group: group 0 the full-attention layers (of one shape or several: each layer its own
    pool, all named by the same page indices), then one group per window worth a pool; layers with a state
    (`StateSpec`) or reading another layer's KV (`KVSharingSpec`) take no pages and are in no group."""
    draft = ec.speculative_config is not None and ec.speculative_config.method == "draft_model"
    if isinstance(specs[0], MLASpec):  # the latent pool has no V: what reads K and V pools cannot take it yet
        refused = {"kv_cache_dtype int8/fp8": ec.kv_cache_dtype != "auto", "a draft model": draft}
        if any(refused.values()):
            raise ValueError(f"{', '.join(name for name, on in refused.items() if on)}: not supported yet for "
                             "Multi-head Latent Attention's latent KV cache")
    if any(isinstance(spec, StateSpec) for spec in specs) and ec.kv_tiers:  # a state cannot be copied out yet
        raise ValueError("the KV tiers: not supported yet for models with linear-attention layers (their "
                         "per-sequence state)")
    specs_of_pages = [spec for spec in specs if not isinstance(spec, (StateSpec, KVSharingSpec))]
    shapes = {(spec.num_kv_heads, spec.head_size) for spec in specs_of_pages if not isinstance(spec, MLASpec)}
    if ec.kv_tiers and (len(shapes) > 1 or any(isinstance(spec, KVSharingSpec) for spec in specs)):
        raise ValueError("the KV tiers: not supported yet for models whose layers keep KV of different shapes or "
                         "read other layers' KV (they copy every layer's page as one stack)")
    own_pool = ec.speculative_config is not None and ec.speculative_config.has_pool
    hybrid = not (ec.disable_hybrid_kv_cache_manager or ec.kv_tiers or own_pool)
    full: FullAttentionSpec | MLASpec | None = None
    groups: list[tuple[KVCacheSpec | None, list[int]]] = [(None, [])]
    for layer, spec in enumerate(specs):
        if isinstance(spec, (StateSpec, KVSharingSpec)):
            continue
        if isinstance(spec, SlidingWindowSpec) and (not hybrid or pages_per_seq(spec, ec) >= ec.pages_per_seq):
            spec = FullAttentionSpec(spec.num_kv_heads, spec.head_size)  # full pages, read through the window mask
        if isinstance(spec, FULL_SPECS):
            full = full or spec
            groups[0][1].append(layer)
            continue
        index = next((i for i, (other, _) in enumerate(groups) if other == spec), None)
        if index is None:
            groups.append((spec, []))
            index = len(groups) - 1
        groups[index][1].append(layer)
    # every layer has a window: group 0 only names page indices
    groups[0] = (full or FullAttentionSpec(specs_of_pages[0].num_kv_heads, specs_of_pages[0].head_size),
                 groups[0][1])
    return groups


def plan_kv_cache(config: ModelConfig, ec: EngineConfig, tp: TensorParallel, backend: PagedAttention, dtype,
                  budget_bytes: int | None, proposer_page_bytes: int = 0) -> KVPlan:
    """The plan for `budget_bytes` per device (None: a CPU, or `num_kv_pages` set). One group: the budget's worth of
    pages, or enough for every slot up to a fixed size. With window groups: each holds every slot's window and
    step, or with a budget its share of it, so that every group runs out together for sequences of max_model_len;
    group 0 gets the rest. State layers' slots (one per sequence slot, `StateSpec`) come off the budget first."""
    specs = layer_specs(config)
    grouped = group_layers(specs, ec)
    state = state_spec(config)
    slot_bytes = state.slot_bytes(dtype) * len(config.state_layers) if state is not None else 0
    checkpoints = ec.state_checkpoints if state is not None and ec.enable_prefix_caching else 0
    # under speculative decoding each sequence keeps the state after each of a verify step's K + 1 tokens
    state_rows = ec.max_num_seqs * (ec.num_speculative_tokens + 1) if state is not None else 0
    if budget_bytes is not None and slot_bytes:
        state_device_bytes = (state_rows + checkpoints) * slot_bytes // tp.size
        if state_device_bytes >= budget_bytes:
            raise ValueError(f"the linear-attention state of max_num_seqs={ec.max_num_seqs} sequences "
                             f"({ec.num_speculative_tokens + 1} each: num_speculative_tokens + 1) and {checkpoints} "
                             f"state checkpoints ({state_device_bytes / 2**30:.2f} GiB per device) does not fit the "
                             f"KV budget ({budget_bytes / 2**30:.2f} GiB per device): lower max_num_seqs or "
                             "num_state_checkpoints, or raise gpu_memory_utilization / kv_cache_memory_bytes")
        budget_bytes -= state_device_bytes
    group_bytes = [page_bytes(config, tp, backend, ec.page_size, dtype, layers) for _, layers in grouped]
    total = [group_bytes[0] + proposer_page_bytes, *group_bytes[1:]]  # the proposer's page rides on group 0's
    device = [size // tp.size for size in total]
    windows = [ec.max_num_seqs * pages_per_seq(spec, ec) + 1 for spec, _ in grouped[1:]]
    if len(grouped) == 1:
        full = ec.num_kv_pages or (max(2, budget_bytes // device[0]) if budget_bytes is not None else
                                   cpu_pool_pages(ec, total[0]))
    elif budget_bytes is None:
        full = ec.num_kv_pages or cpu_pool_pages(ec, device[0])
    else:
        needs = [pages_per_seq(spec, ec) * size for (spec, _), size in zip(grouped, device)]
        windows = [max(2, min(every, int(budget_bytes * need / sum(needs)) // size))
                   for every, need, size in zip(windows, needs[1:], device[1:])]
        rest = budget_bytes - sum(pages * size for pages, size in zip(windows, device[1:]))
        full = max(2, rest // device[0]) if device[0] else ec.max_num_seqs * ec.pages_per_seq + 1
    layer_groups = [-1] * config.num_layers
    groups = []
    for index, ((spec, layers), pages) in enumerate(zip(grouped, [full, *windows])):
        for layer in layers:
            layer_groups[layer] = index
        shapes = tuple(dict.fromkeys(FullAttentionSpec(specs[layer].num_kv_heads, specs[layer].head_size)
                                     if isinstance(specs[layer], SlidingWindowSpec) else specs[layer]
                                     for layer in layers))
        groups.append(KVCacheGroup(spec, tuple(layers), pages, group_bytes[index], ec.page_size,
                                   shapes if len(shapes) > 1 else ()))
    for layer, spec in enumerate(specs):  # a layer reading another's KV reads it through that layer's group
        if isinstance(spec, KVSharingSpec):
            layer_groups[layer] = layer_groups[spec.source]
    return KVPlan(ec.page_size, tuple(groups), tuple(layer_groups), proposer_page_bytes, state,
                  state_rows, slot_bytes, checkpoints)


def check_plan(plan: KVPlan, ec: EngineConfig) -> None:
    """Raises ValueError when a group cannot hold one sequence (the engine's check; `jaxserve compile` reports it)."""
    if plan.num_pages - 1 < ec.pages_per_seq:
        raise ValueError(f"num_kv_pages={plan.num_pages} cannot hold one sequence of max_model_len="
                         f"{ec.max_model_len} ({ec.pages_per_seq} pages + 1 scratch page)")
    for index, group in enumerate(plan.window_groups, 1):
        needed = pages_per_seq(group.spec, ec)
        if group.num_pages - 1 < needed:
            raise ValueError(f"KV cache group {index} (layers with a sliding window of {group.spec.window}) has "
                             f"{group.num_pages} pages and cannot hold one sequence's window and step ({needed} "
                             "pages + 1 scratch page): raise kv_cache_memory_bytes or gpu_memory_utilization")


def empty_kv_cache(layer_pages: list[int], config: ModelConfig, tp: TensorParallel, backend: PagedAttention,
                   page_size: int, dtype, allocator: Allocator, state_slots: int = 0,
                   state_checkpoints: int = 0) -> list[KVPages | StateSlots]:
    """Each layer's cache: its K and V pools of `layer_pages[layer]` pages in its own shape (arrays, or
    QuantizedPages: values + per-token scales for an int8/fp8 cache); a plan's are `plan.layer_pages`. A state
    layer's: `state_slots` zeroed slots and `state_checkpoints` checkpoint rows (`plan.state_slots`,
    `plan.state_checkpoints`). None for a layer reading another layer's KV."""
    state = state_spec(config)
    state_placed = state_shardings(backend.mesh, state_checkpoints > 0)

    def states(rows: int) -> tuple[jax.Array, jax.Array]:
        return (allocator.full((rows, *state.conv), dtype, state_placed.conv),
                allocator.full((rows, *state.recurrent), jnp.float32, state_placed.recurrent))

    def cache(layer: int, pages: int) -> KVPages | StateSlots | None:
        if config.layers[layer].mixer != "attention":
            return StateSlots(*states(state_slots), *(states(state_checkpoints) if state_checkpoints else ()))
        if config.layers[layer].kv_source is not None:  # reads its source's pool
            return None
        if config.mla is not None:  # one replicated latent pool, no V
            shape = (1, pages, page_size, backend.stored_head_dim(config.mla.cache_dim))
            placed = NamedSharding(backend.mesh, P()) if backend.mesh is not None else None
            return KVPages(allocator.full(shape, backend.storage_dtype(dtype), placed), None)
        own = config.for_layer(config.layers[layer])
        shape = backend.pool_shape(pages, page_size, tp.pool_heads(own), own.head_dim)
        return backend.empty_cache(shape, dtype, allocator)
    return [cache(layer, pages) for layer, pages in enumerate(layer_pages)]


def kv_cache_shardings(backend: PagedAttention, config: ModelConfig, state_checkpoints: bool = False
                       ) -> list[KVPages | StateSlots]:
    """The sharding tree of a cache `empty_kv_cache` makes, for jit's in and out shardings; needs the backend's
    mesh."""
    pages = KVPages(NamedSharding(backend.mesh, P()), None) if config.mla is not None else backend.cache_shardings()
    states = state_shardings(backend.mesh, state_checkpoints)
    return [states if layer.mixer != "attention" else None if layer.kv_source is not None else pages
            for layer in config.layers]


def log_kv_plan(plan: KVPlan, config: ModelConfig, kv_cache_dtype: str, storage_dtype: str, backend: PagedAttention,
                num_devices: int) -> None:
    logger.info("KV pools: %.1f MiB over %d devices (kv_cache_dtype %s: %s pages%s, %s attention, page of %d tokens)",
                plan.pool_bytes / 2**20, num_devices, kv_cache_dtype, storage_dtype,
                " + float32 per-token scales" if backend.quantized else "", backend.name, plan.page_size)
    for index, group in enumerate(plan.groups):
        logger.info("KV cache group %d: %s, %d layers, %d pages (%d usable tokens)", index,
                    " + ".join(map(str, group.shapes)) or group.spec, len(group.layers), group.num_pages,
                    group.capacity_tokens)
    shared = [layer for layer in range(config.num_layers) if config.layers[layer].kv_source is not None]
    if shared:
        logger.info("layers %s read earlier layers' KV (no pages of their own)", shared)
    if plan.state is not None:
        logger.info("state slots: %s, %d layers, %d slots and %d checkpoints of %.2f MiB each (%.1f MiB), no "
                    "pages", plan.state, len(config.state_layers), plan.state_slots, plan.state_checkpoints,
                    plan.state_slot_bytes / 2**20, plan.state_bytes / 2**20)
    if len(plan.groups) == 1 and any(window is not None for window in config.layer_sliding_windows):
        logger.info("one KV cache group for every layer, sliding-window ones included (the hybrid KV cache is off: "
                    "disabled, KV tiers, a draft model, or a window near max_model_len)")

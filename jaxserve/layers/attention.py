"""Paged attention: the `AttentionBackend` protocol, the backends behind it, and `PagedAttention`, what the model
and the engine hold.

A backend says how one device's new K/V are written into its page pool and how its queries read them back:

* `xla` (`attention_xla.XlaAttention`): plain jax.numpy, the default on CPU and the fallback anywhere;
* `pallas` / `pallas-interpret` (`attention_triton.TritonAttention`): our Triton Pallas kernels (default on GPU),
  or the same kernels in Pallas' interpreter, for tests on CPU;
* `pallas-tpu` / `pallas-tpu-interpret` (`attention_tpu.MosaicTpuAttention`): our Mosaic TPU kernels (default on
  TPU), or the same kernels in Pallas' TPU interpreter, for tests on CPU.

`make_attention_backend(name, mesh, kv_cache_dtype)` picks one once, at start-up, and wraps it in `PagedAttention`,
which owns the pool (its shape, dtype, quantization and sharding: `paged_kv`) and runs the backend on each device's
heads: under tensor parallelism (`mesh` set) the pool and the heads are split over the model axis and the backend
runs under `shard_map`; attention never crosses heads, so no device talks to another here. The pool layout
`[kv_heads, num_pages, page_size, head_dim]` lets a Pallas grid cell stream one head's pages and the XLA loop
contract each head's keys without transposing them, which measured faster on CPU than `[num_pages, page_size,
kv_heads, head_dim]` (figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.distributed.tensor_parallel import MODEL_AXIS, REPLICATED
from jaxserve.layers.attention_xla import XlaAttention, xla_paged_attention
from jaxserve.layers.paged_kv import (HEADS, KV_POOL, KV_SCALE_BYTES, KV_SCALES, QUANTIZED_KV, AttentionMetadata,
                                      KVPages, QuantizedPages, pool_shape)
from jaxserve.options import KV_CACHE_DTYPES

ATTENTION_BACKENDS = ("xla", "pallas", "pallas-interpret", "pallas-tpu", "pallas-tpu-interpret")

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "KVPages", "PagedAttention",
           "make_attention_backend"]


@runtime_checkable
class AttentionBackend(Protocol):
    """One device's paged attention: `write_kv` then `attend`, on that device's heads of the pool. A backend
    whose pools need the head size padded says so with a class attribute `head_dim_multiple` (default 1), one whose
    kernels read only row-major pools with `row_major_pools` (default False)."""

    @property
    def name(self) -> str: ...

    def write_kv(self, kv: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                 kv_cache_dtype: str) -> KVPages:
        """Scatters `k, v: [B, T, kv_heads, head_dim]` into their slots (padding tokens target the scratch page);
        returns the layer's new pools."""

    def attend(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
               sliding_window: int | None, soft_cap: float | None, sinks: jax.Array | None) -> jax.Array:
        """Causal attention of `q: [B, T, q_heads, head_dim]` over each row's pages (after `write_kv`), or up to
        each query's `meta.query_limits` when set (Gemma 3's images), each query seeing the last `sliding_window`
        positions back from its own when set; logits capped as `soft_cap * tanh(x / soft_cap)` when `soft_cap` is
        set; `sinks: [q_heads]` (gpt-oss) one more logit per head in each softmax, with no value."""


def backend_by_name(name: str) -> AttentionBackend:
    """The backend `name` (one of ATTENTION_BACKENDS); the Pallas ones are imported only when asked for."""
    if name == "xla":
        return XlaAttention()
    if name in ("pallas", "pallas-interpret"):
        from jaxserve.layers.attention_triton import TritonAttention

        return TritonAttention(interpret=name == "pallas-interpret")
    if name in ("pallas-tpu", "pallas-tpu-interpret"):
        from jaxserve.layers.attention_tpu import MosaicTpuAttention

        return MosaicTpuAttention(interpret=name == "pallas-tpu-interpret")
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")


DEFAULT_PAGE_SIZE = 16


def make_attention_backend(name: str, mesh: Mesh | None = None, kv_cache_dtype: str = "auto") -> PagedAttention:
    """The engine's attention, chosen once: backend `name` over pools of `kv_cache_dtype` ("auto": the model
    dtype; "int8" or "fp8": `QuantizedPages`), split over `mesh`'s model axis when given."""
    return PagedAttention(backend_by_name(name), mesh, kv_cache_dtype)


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """A backend and the page pools it reads (each attention layer's `KVPages`). Hashable, so jitted functions can
    take it as static."""

    backend: AttentionBackend
    mesh: Mesh | None = None  # tensor parallelism: the pool and the heads are split over its model axis
    kv_cache_dtype: str = "auto"  # "auto" (pages in the model dtype), "int8" or "fp8" (QuantizedPages)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def storage_dtype(self, model_dtype):
        """The dtype the pages' values are stored in."""
        return QUANTIZED_KV[self.kv_cache_dtype][0] if self.quantized else jnp.dtype(model_dtype)

    def stored_head_dim(self, head_dim: int) -> int:
        """The head size the pools store: the model's, rounded up to the backend's `head_dim_multiple` (Mosaic
        TPU: 128 lanes; with fewer, a TPU lays the pool out transposed and each step copies it whole to give the
        kernels the layout they read)."""
        multiple = getattr(self.backend, "head_dim_multiple", 1)
        return -(-head_dim // multiple) * multiple

    def min_page_size(self, model_dtype) -> int:
        """The smallest page the backend keeps in the layout its kernels read (its `min_page_size`; else 1)."""
        return getattr(self.backend, "min_page_size", lambda *_: 1)(self.storage_dtype(model_dtype), self.quantized)

    def default_page_size(self, model_dtype) -> int:
        """The page size an engine uses when none is asked for: 16 tokens (vLLM's block size), or the backend's
        smallest page where that is larger (a TPU's with per-token scales: 128)."""
        return max(DEFAULT_PAGE_SIZE, self.min_page_size(model_dtype))

    def check_page_size(self, page_size: int, model_dtype) -> None:
        """ValueError when the backend cannot keep pages of `page_size` tokens in the layout its kernels read (the
        backend's `min_page_size(storage_dtype, quantized)`, if it has one)."""
        least = self.min_page_size(model_dtype)
        if page_size < least:
            dtype = jnp.dtype(self.storage_dtype(model_dtype)).name
            raise ValueError(f"page_size (--block-size) {page_size} is too small for the {self.name} attention backend "
                             f"with {dtype} pages{' and per-token scales' if self.quantized else ''}: use {least} or "
                             "more")

    def pool_shape(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one K (or V) pool of heads of `head_dim` (stored as `stored_head_dim`)."""
        return pool_shape(num_pages, page_size, num_kv_heads, self.stored_head_dim(head_dim))

    def token_bytes(self, head_dim: int, model_dtype) -> int:
        """Bytes one token takes in one head's K (or V) pool, its scale included."""
        scale_bytes = KV_SCALE_BYTES if self.quantized else 0
        return self.stored_head_dim(head_dim) * jnp.dtype(self.storage_dtype(model_dtype)).itemsize + scale_bytes

    def cache_specs(self) -> KVPages:
        """The `PartitionSpec` tree of one layer's pools: split on the heads, scales like their values."""
        pool = QuantizedPages(KV_POOL, KV_SCALES) if self.quantized else KV_POOL
        return KVPages(pool, pool)

    def empty_cache(self, shape: tuple[int, ...], model_dtype, allocator) -> KVPages:
        """One layer's zeroed pools, each of `pool_shape` `shape`, placed on the mesh as `cache_shardings` says (the
        default device without a mesh), made by `allocator` (`engine/allocator.py`)."""
        placed = self.cache_shardings() if self.mesh is not None else jax.tree.map(
            lambda spec: None, self.cache_specs(), is_leaf=lambda x: isinstance(x, P))

        def pool(placed):
            if not self.quantized:
                return allocator.full(shape, self.storage_dtype(model_dtype), placed)
            return QuantizedPages(allocator.full(shape, self.storage_dtype(model_dtype), placed.values),
                                  allocator.full(shape[:3], jnp.float32, placed.scales))
        return KVPages(pool(placed.k), pool(placed.v))

    def cache_shardings(self) -> KVPages:
        """The sharding tree of one layer's pools (for jit's in/out shardings and their allocation); needs `mesh`. A
        backend
        with `row_major_pools` gets `Format`s that pin every pool array row-major, in and out of every step: its
        kernels read only that layout, and a TPU's default layout for some pool shapes is another (a small leading
        heads axis of the scales moved inward), which cost a copy of the array around each kernel call."""
        def placed(spec: P, ndim: int):
            sharding = NamedSharding(self.mesh, spec)
            if not getattr(self.backend, "row_major_pools", False):
                return sharding
            return Format(Layout(major_to_minor=tuple(range(ndim))), sharding)
        pool = QuantizedPages(placed(KV_POOL, 4), placed(KV_SCALES, 3)) if self.quantized else placed(KV_POOL, 4)
        return KVPages(pool, pool)

    def per_device(self, function, in_specs: tuple, out_specs):
        """`function` run on each device's heads when the heads are split, else as it is."""
        if self.mesh is None or self.mesh.size == 1:
            return function
        # check_vma off: pallas_call does not declare how its outputs vary over the mesh
        return jax.shard_map(function, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def write_kv(self, kv: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPages:
        """Scatters `k, v: [B, T, kv_heads, head_dim]` into their slots. Padding tokens target the scratch page."""
        cache = self.cache_specs()
        write = functools.partial(self.backend.write_kv, kv_cache_dtype=self.kv_cache_dtype)
        write = self.per_device(write, (cache, HEADS, HEADS, REPLICATED), cache)
        return write(kv, self.stored(k), self.stored(v), slot_mapping)

    def attend(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
               sliding_window: int | None, soft_cap: float | None = None, sinks: jax.Array | None = None
               ) -> jax.Array:
        """Causal attention of `q: [B, T, q_heads, head_dim]` over each sequence's pages (after `write_kv`), or up
        to each query's `meta.query_limits` (a chunk holding a Gemma 3 image, whose tokens see each other both
        ways: every backend's kernels take the limits); `sinks [q_heads]` split over the devices like the heads."""
        def attend(q, kv, meta, sinks):
            return self.backend.attend(q, kv, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                                       soft_cap=soft_cap, sinks=sinks)

        sinks = None if sinks is None else sinks.astype(jnp.float32)
        specs = (HEADS, self.cache_specs(), REPLICATED, P(MODEL_AXIS))  # a None `sinks` has no leaves: spec unused
        out = self.per_device(attend, specs, HEADS)(self.stored(q), kv, meta, sinks)
        return out[..., :q.shape[-1]]

    def attend_latent(self, q: jax.Array, kv: KVPages, meta: AttentionMetadata, *, sm_scale: float,
                      value_dim: int, rope_dim: int) -> jax.Array:
        """Multi-head Latent Attention (`layers/mla.py`): every head of `q [B, T, heads, stored]` (`[q_latent |
        q_rope]`, `value_dim + rope_dim` wide before padding) over the one latent row per token of `kv` (no V: a
        row's first `value_dim` values are its value), `[B, T, heads, value_dim]`. The heads split over the
        devices, the latent pool whole on each. A backend with an `attend_latent` of its own runs it (the Triton
        decode kernel, the Mosaic ragged kernel); the others attend in XLA."""
        attend = getattr(self.backend, "attend_latent", None)
        if attend is None:
            return xla_paged_attention(q, kv, meta, sm_scale=sm_scale, sliding_window=None, value_dim=value_dim)
        attend = functools.partial(attend, sm_scale=sm_scale, value_dim=value_dim, rope_dim=rope_dim)
        return self.per_device(attend, (HEADS, KVPages(REPLICATED, None), REPLICATED), HEADS)(q, kv, meta)

    def stored(self, x: jax.Array) -> jax.Array:
        """`x [..., head_dim]` zero-padded to the stored head size (zeros change no score, value or scale)."""
        pad = self.stored_head_dim(x.shape[-1]) - x.shape[-1]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x

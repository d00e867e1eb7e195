"""The paged KV cache every attention backend shares: the step's metadata, the pool layout, its quantized form,
and the plain scatter that writes new tokens into it.

An attention layer's cache is a `KVPages`: its K and V page pools, named. One layout per pool: `[kv_heads,
num_pages, page_size, head_dim]`; one page of one head is a contiguous `[page_size, head_dim]` tile. With a quantized KV cache (`kv_cache_dtype` "int8" or "fp8") each pool is
a `QuantizedPages` pytree instead: int8 or float8_e4m3fn values in that layout plus float32 per-token scales
`[kv_heads, num_pages, page_size]` (one per token and head: value = stored * scale). Under tensor parallelism the
pool (and its scales) is split on the heads axis (`KV_POOL`, `KV_SCALES`), and so are the queries (`HEADS`).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.distributed.tensor_parallel import MODEL_AXIS
from jaxserve.options import KV_CACHE_DTYPES

KV_POOL = P(MODEL_AXIS)  # [pool_heads, pages, page_size, head_dim]
KV_SCALES = P(MODEL_AXIS)  # quantized pools' per-token scales [pool_heads, pages, page_size]: split like their pages
# pages copied between the pool and host memory (`engine/kv_tier_copies.py`): each page's every layer's K and V (or
# their scales), [pages, 2 * layers, pool_heads, page_size(, head_dim)], split on the heads like the pool
KV_PAGES = P(None, None, MODEL_AXIS)
HEADS = P(None, None, MODEL_AXIS, None)  # q, k, v and the output: [B, T, heads, head_dim]
# kv_cache_dtype -> (stored dtype, largest magnitude the scale maps a token's max|x| to). "auto": the model dtype.
QUANTIZED_KV = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
assert tuple(QUANTIZED_KV) == KV_CACHE_DTYPES[1:]
KV_SCALE_BYTES = 4  # one float32 scale per token and head


@flax.struct.dataclass
class QuantizedPages:
    """One layer's K (or V) pool stored quantized: `values` [kv_heads, num_pages, page_size, head_dim] (int8 or
    float8_e4m3fn) and `scales` float32 [kv_heads, num_pages, page_size]; a token's head vector is
    `values[h, page, offset] * scales[h, page, offset]`. A pytree, so the pool stays one donated argument."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def is_deleted(self) -> bool:
        return self.values.is_deleted() and self.scales.is_deleted()


@flax.struct.dataclass
class KVPages:
    """One attention layer's cache: its K pool and its V pool (each an array or `QuantizedPages`). A pytree with
    named leaves, so code that moves pages (`engine/kv_tier_copies.py`) reads them by name, never by position. An MLA
    layer's cache (`layers/mla.py`) has no V pool: its one "key" per token is the latent and the rope key, and its
    values are the latent, the first dims of each key."""

    k: Any
    v: Any


@flax.struct.dataclass
class AttentionMetadata:
    """Where a step's query tokens sit in the paged cache. `B` sequences, `T` query tokens each (padded)."""

    positions: jax.Array  # int32 [B, T]: absolute position of each query token
    slot_mapping: jax.Array  # int32 [B, T]: flat KV slot (page * page_size + offset) each token's K/V is written to
    page_tables: jax.Array  # int32 [B, P]: pages of each sequence, in order; unused entries point at the scratch page
    context_lens: jax.Array  # int32 [B]: KV length of each sequence after this step's tokens (0 = inactive row)
    query_lens: jax.Array  # int32 [B]: real (unpadded) query tokens of each sequence in this step
    # int32 [B, T]: each token's rope length, max(prompt length, position + 1) (`layers/rotary.py`); None: position
    # + 1, which it is for every token after its prompt (decode, verify and draft steps)
    rope_lens: jax.Array | None = None
    # several KV cache groups (`engine/kv_plan.py`): each group's page tables [groups, B, P] and slots
    # [groups, B, T], and each layer's group (empty: every layer reads page_tables / slot_mapping, group 0's)
    group_page_tables: jax.Array | None = None
    group_slot_mapping: jax.Array | None = None
    layer_groups: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    # int32 [B]: the state row each row's state-keeping layers read and write (`layers/state_slots.py`: its decode
    # slot's); rows that are not live name one past every row. None: a model without such layers. A verify step
    # writes the state after each token instead, into int32 [B, T] `state_writes`
    state_slots: jax.Array | None = None
    state_writes: jax.Array | None = None
    # state checkpoints (prefix caching, `engine/state_checkpoints.py`): int32 [B], the checkpoint each row starts
    # from (-1: none), and int32 [B, N], the checkpoints to save each row's state into (-1: none): after each of a
    # prefill row's chunks of the chunked form (`gated_deltanet.save_blocks`), after a decode row's token (N = 1)
    state_sources: jax.Array | None = None
    state_saves: jax.Array | None = None
    # M-RoPE (`ModelConfig.mrope_section`): int32 [3, B, T], each token's temporal, height and width positions (an
    # image's tokens have their grid's; text has its position shifted by the images before it, on all three)
    mrope_positions: jax.Array | None = None
    # int32 [B, T]: the last key position each query sees (None: its own; Gemma 3's image tokens see their whole
    # image, `ModelConfig.bidirectional_images`); the sliding window still counts back from the query's position
    query_limits: jax.Array | None = None

    def token_rope_lens(self) -> jax.Array:
        return self.positions + 1 if self.rope_lens is None else self.rope_lens

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer `layer` reads: its KV cache group's page tables and slots."""
        if not self.layer_groups or self.layer_groups[layer] <= 0:  # -1: a layer with a state, no pages
            return self
        group = self.layer_groups[layer]
        return self.replace(page_tables=self.group_page_tables[group], slot_mapping=self.group_slot_mapping[group])


def pool_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_pages, page_size, head_dim)


def split_quantized(kv: KVPages) -> tuple[jax.Array, jax.Array, dict]:
    """`(k values, v values, scales)` for a kernel call: quantized pools' stored values and their
    `k_scales`/`v_scales` keyword arguments, or float pools as they are with no scales."""
    if isinstance(kv.k, QuantizedPages):
        return kv.k.values, kv.v.values, dict(k_scales=kv.k.scales, v_scales=kv.v.scales)
    return kv.k, kv.v, {}


def quantize_kv(x: jax.Array, kv_cache_dtype: str) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-vector quantization over the last axis: `(values, float32 scales)`, x ~ values * scales.

    scale = max|x| / 127 (int8, rounded to nearest) or max|x| / 448 (fp8 e4m3's largest finite value, rounded
    by the cast); an all-zero vector gets scale 0 and zeros."""
    dtype, largest = QUANTIZED_KV[kv_cache_dtype]
    x = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / largest
    scaled = x / jnp.where(scales > 0, scales, 1.0)[..., None]
    if dtype == jnp.int8:
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -largest, largest).astype(dtype), scales


def scatter_kv(kv: KVPages, k, v, slot_mapping, *, kv_cache_dtype: str = "auto") -> KVPages:
    """One device's write of `k, v: [B, T, kv_heads, head_dim]` into their slots by an XLA scatter (padding tokens
    target the scratch page); quantizes each new token's heads first when `kv_cache_dtype` says so. `v` None: a
    cache with no V pool (MLA)."""
    return KVPages(scatter_pages(kv.k, k, slot_mapping, kv_cache_dtype),
                   None if v is None else scatter_pages(kv.v, v, slot_mapping, kv_cache_dtype))


def scatter_pages(pool, new: jax.Array, slot_mapping: jax.Array, kv_cache_dtype: str = "auto"):
    """`pool` with `new: [B, T, heads, head_dim]` written into the slots of `slot_mapping [B, T]`."""
    slots = slot_mapping.reshape(-1)
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice fusion that copies the whole donated
        # pool every step, slow for a large pool; writing the row twice keeps it a scatter.
        slots, new = jnp.concatenate([slots, slots]), jnp.concatenate([new, new])
    heads, pages, page_size, head_dim = pool.shape
    new = new.reshape(-1, heads, head_dim).swapaxes(0, 1)  # [heads, tokens, head_dim]
    flat_shape = (heads, pages * page_size, head_dim)
    if kv_cache_dtype == "auto":
        return pool.reshape(flat_shape).at[:, slots].set(new.astype(pool.dtype)).reshape(pool.shape)
    values, scales = quantize_kv(new, kv_cache_dtype)
    return QuantizedPages(
        values=pool.values.reshape(flat_shape).at[:, slots].set(values).reshape(pool.shape),
        scales=pool.scales.reshape(flat_shape[:2]).at[:, slots].set(scales).reshape(pool.shape[:3]))

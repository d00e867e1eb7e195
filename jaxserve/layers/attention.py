"""Paged attention backends: where new K/V are written into the page pool and how queries read it back.

The model calls `backend.write_kv` and `backend.attend` and never knows which implementation runs:

* `xla`: a loop over each row's pages in use with an online softmax, in plain jax.numpy (default on CPU).
* `pallas`: our Pallas kernels from `pallas_kernels` (default on GPU).
* `pallas-interpret`: the same kernels in Pallas' interpreter, for tests on CPU.

All backends share one layout per layer's page pool: `[kv_heads, num_pages, page_size, head_dim]`.
Under tensor parallelism (`mesh` set) each device holds its heads' slice of the pool and runs the same
code on its own heads (`shard_map` over the heads axis); attention never crosses heads, so no device
talks to another here.
A Pallas grid cell then streams one head's pages, and the XLA loop contracts each head's
keys without transposing them, which measured faster on CPU than `[num_pages, page_size, kv_heads,
head_dim]` (figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.distributed.shardings import KV_POOL, REPLICATED
from jaxserve.distributed.tensor_parallel import MODEL_AXIS

ATTENTION_BACKENDS = ("xla", "pallas", "pallas-interpret")
HEADS = P(None, None, MODEL_AXIS, None)  # q, k, v and the output: [B, T, heads, head_dim]


@flax.struct.dataclass
class AttentionMetadata:
    """Where a step's query tokens sit in the paged cache. `B` sequences, `T` query tokens each (padded)."""

    positions: jax.Array  # int32 [B, T]: absolute position of each query token
    slot_mapping: jax.Array  # int32 [B, T]: flat KV slot (page * page_size + offset) each token's K/V is written to
    page_tables: jax.Array  # int32 [B, P]: pages of each sequence, in order; unused entries point at the scratch page
    context_lens: jax.Array  # int32 [B]: KV length of each sequence after this step's tokens (0 = inactive row)
    query_lens: jax.Array  # int32 [B]: real (unpadded) query tokens of each sequence in this step


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One way of storing and reading the paged KV cache. Hashable, so jitted functions can take it as static."""

    name: str
    mesh: Mesh | None = None  # tensor parallelism: the pool and the heads are split over its model axis

    def __post_init__(self) -> None:
        if self.name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.name!r}")

    def _per_device(self, function, in_specs: tuple, out_specs):
        """`function` run on each device's heads when the heads are split, else as it is."""
        if self.mesh is None or self.mesh.size == 1:
            return function
        # check_vma off: pallas_call does not declare how its outputs vary over the mesh
        return jax.shard_map(function, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    @staticmethod
    def pool_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_pages, page_size, head_dim)

    def write_kv(self, k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Scatters `k, v: [B, T, kv_heads, head_dim]` into their slots. Padding tokens target the scratch page."""
        write = self._per_device(_write_kv, (KV_POOL, KV_POOL, HEADS, HEADS, REPLICATED), (KV_POOL, KV_POOL))
        return write(k_pool, v_pool, k, v, slot_mapping)

    def attend(self, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, meta: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None) -> jax.Array:
        """Causal attention of `q: [B, T, q_heads, head_dim]` over each sequence's pages (after `write_kv`)."""
        if self.name == "xla":
            attend = functools.partial(_xla_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window)
        else:
            attend = functools.partial(_pallas_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window,
                                       interpret=self.name == "pallas-interpret")
        return self._per_device(attend, (HEADS, KV_POOL, KV_POOL, REPLICATED), HEADS)(q, k_pool, v_pool, meta)


def _write_kv(k_pool, v_pool, k, v, slot_mapping):
    """One device's scatter (see `AttentionBackend.write_kv`)."""
    slots = slot_mapping.reshape(-1)
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice fusion that copies the whole donated
        # pool every step, slow for a large pool; writing the row twice keeps it a scatter.
        slots = jnp.concatenate([slots, slots])
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
    heads, pages, page_size, head_dim = k_pool.shape
    k_new = k.reshape(-1, heads, head_dim).swapaxes(0, 1).astype(k_pool.dtype)
    v_new = v.reshape(-1, heads, head_dim).swapaxes(0, 1).astype(v_pool.dtype)
    flat_shape = (heads, pages * page_size, head_dim)
    k_pool = k_pool.reshape(flat_shape).at[:, slots].set(k_new).reshape(k_pool.shape)
    v_pool = v_pool.reshape(flat_shape).at[:, slots].set(v_new).reshape(v_pool.shape)
    return k_pool, v_pool


DECODE_BLOCK_TOKENS = 32  # keys per loop iteration for one query token: the fastest block size measured on CPU
PREFILL_BLOCK_TOKENS = 128  # with many query tokens per row a block has more work, so fewer, larger blocks


def _xla_paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, *, sm_scale, sliding_window):
    """Causal attention blockwise over each row's pages with an online softmax (flash attention in plain XLA).

    The loop runs only as many key blocks as the longest context in the batch needs and never
    materializes a sequence's whole K/V, which on CPU beats both one gather of all pages (decode) and
    attending to every page (prefill); figures in benchmarks/RESULTS.md.
    """
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    target_tokens = DECODE_BLOCK_TOKENS if num_tokens == 1 else PREFILL_BLOCK_TOKENS
    pages_per_block = max(1, target_tokens // page_size)
    block_tokens = pages_per_block * page_size
    page_tables = meta.page_tables
    padding = -page_tables.shape[1] % pages_per_block
    if padding:  # every block slice must stay inside the table (extra entries point at the scratch page)
        page_tables = jnp.pad(page_tables, ((0, 0), (0, padding)))
    query = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    query = query.astype(jnp.float32) * sm_scale  # [B, K, G, T, D]
    query_pos = meta.positions[:, None, None, :, None]  # against key positions [..., block]
    context_lens = meta.context_lens[:, None, None, None, None]
    real_query = (jnp.arange(num_tokens) < meta.query_lens[:, None])[:, None, None, :, None]  # padding sees nothing
    num_blocks = (jnp.max(meta.context_lens) + block_tokens - 1) // block_tokens

    def block(index, carry):
        running_max, denominator, accumulator = carry
        pages = jax.lax.dynamic_slice_in_dim(page_tables, index * pages_per_block, pages_per_block, axis=1)
        keys = k_pool[:, pages].reshape(num_kv_heads, batch, block_tokens, head_dim)
        values = v_pool[:, pages].reshape(num_kv_heads, batch, block_tokens, head_dim)
        key_pos = index * block_tokens + jnp.arange(block_tokens)
        # Slots past a row's context (the scratch page, pages it does not own) may hold anything, even NaN or
        # inf: zero their values, since a zero probability times NaN would still be NaN. Inside the context
        # every slot holds this row's own keys, so masking the scores of invisible ones there is enough.
        in_context = key_pos < meta.context_lens[:, None]  # [B, block]
        values = jnp.where(in_context[None, :, :, None], values, 0)
        scores = jnp.einsum("kbsd,bkgtd->bkgts", keys, query, preferred_element_type=jnp.float32)
        visible = (key_pos <= query_pos) & (key_pos < context_lens) & real_query
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
        probs = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(running_max - safe_max)
        denominator = denominator * rescale + jnp.sum(probs, axis=-1)
        accumulator = accumulator * rescale[..., None] + jnp.einsum(
            "bkgts,kbsd->bkgtd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return new_max, denominator, accumulator

    stats_shape = (batch, num_kv_heads, group, num_tokens)
    init = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32))
    _, denominator, accumulator = jax.lax.fori_loop(0, num_blocks, block, init)
    out = accumulator / jnp.maximum(denominator, 1e-30)[..., None]  # a query with no keys (padding) gives zeros
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _pallas_paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, *, sm_scale, sliding_window, interpret):
    """Decode (`T == 1`) runs the decode kernel; otherwise all rows go through one ragged-kernel call."""
    import pallas_kernels  # imported lazily: the xla path must not depend on Pallas' GPU lowering

    batch, num_tokens = q.shape[:2]
    if num_tokens == 1:
        out = pallas_kernels.paged_attention(q[:, 0], k_pool, v_pool, meta.context_lens, meta.page_tables,
                                             sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret)
        return out[:, None]
    query_lens = jnp.clip(meta.query_lens, 0, num_tokens).astype(jnp.int32)
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
    out = pallas_kernels.ragged_paged_attention(
        _to_ragged(q, cu_q_lens), k_pool, v_pool, meta.context_lens, meta.page_tables, cu_q_lens, jnp.int32(batch),
        sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret)
    return _from_ragged(out, cu_q_lens, query_lens, num_tokens)


def _to_ragged(q: jax.Array, cu_q_lens: jax.Array) -> jax.Array:
    """`[B, T, ...]` -> `[B * T, ...]` with row b's real tokens at `cu_q_lens[b]:cu_q_lens[b + 1]`.

    Entries from `cu_q_lens[B]` on are the ragged kernel's padding: they hold copies of other tokens, and the
    kernel neither reads them for other rows nor writes anything but zeros for them.
    """
    batch, num_tokens = q.shape[:2]
    index = jnp.arange(batch * num_tokens, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu_q_lens[1:], index, side="right"), 0, batch - 1)
    column = jnp.clip(index - cu_q_lens[row], 0, num_tokens - 1)
    return q.reshape(batch * num_tokens, *q.shape[2:])[row * num_tokens + column]


def _from_ragged(out: jax.Array, cu_q_lens: jax.Array, query_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Inverse of `_to_ragged`: `[B * T, ...]` -> `[B, T, ...]`, zeros at padded query tokens."""
    column = jnp.arange(num_tokens, dtype=jnp.int32)
    index = jnp.minimum(cu_q_lens[:-1, None] + column, out.shape[0] - 1)  # [B, T]
    real = (column < query_lens[:, None]).reshape(*index.shape, *(1,) * (out.ndim - 1))
    return jnp.where(real, out[index], 0)

"""Paged attention backends: where new K/V are written into the page pool and how queries read it back.

The model calls `backend.write_kv` and `backend.attend` and never knows which implementation runs:

* `xla`: a loop over each row's pages in use with an online softmax, in plain jax.numpy (default on CPU).
* `pallas`: our Pallas kernels from `pallas_kernels` (default on GPU).
* `pallas-interpret`: the same kernels in Pallas' interpreter, for tests on CPU.
* `pallas-tpu`: our Mosaic TPU kernels from `pallas_kernels.tpu` (default on TPU; glue in `attention_tpu`).
* `pallas-tpu-interpret`: the same kernels in Pallas' TPU interpreter, for tests on CPU.

All backends share one layout per layer's page pool: `[kv_heads, num_pages, page_size, head_dim]`.
With a quantized KV cache (`kv_cache_dtype` "int8" or "fp8") each pool is a `QuantizedPages` pytree instead:
int8 or float8_e4m3fn values in that layout plus float32 per-token scales `[kv_heads, num_pages, page_size]`
(one per token and head: value = stored * scale). `write_kv` quantizes the new tokens; every backend reads the
stored values and applies the scales per key block (the XLA loop) or per KV tile (the Pallas kernels), so
the whole pool is never dequantized.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.distributed.shardings import KV_POOL, KV_SCALES, REPLICATED
from jaxserve.distributed.tensor_parallel import MODEL_AXIS

ATTENTION_BACKENDS = ("xla", "pallas", "pallas-interpret", "pallas-tpu", "pallas-tpu-interpret")
HEADS = P(None, None, MODEL_AXIS, None)  # q, k, v and the output: [B, T, heads, head_dim]


# kv_cache_dtype -> (stored dtype, largest magnitude the scale maps a token's max|x| to). "auto": the model dtype.
QUANTIZED_KV = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
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
    kv_cache_dtype: str = "auto"  # "auto" (pages in the model dtype), "int8" or "fp8" (QuantizedPages)

    def __post_init__(self) -> None:
        if self.name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.name!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in QUANTIZED_KV:
            raise ValueError(f"kv_cache_dtype must be one of {('auto', *QUANTIZED_KV)}, got {self.kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def storage_dtype(self, model_dtype):
        """The dtype the pages' values are stored in."""
        return QUANTIZED_KV[self.kv_cache_dtype][0] if self.quantized else jnp.dtype(model_dtype)

    def token_bytes(self, head_dim: int, model_dtype) -> int:
        """Bytes one token takes in one head's K (or V) pool, its scale included."""
        return head_dim * jnp.dtype(self.storage_dtype(model_dtype)).itemsize + (KV_SCALE_BYTES if self.quantized
                                                                                  else 0)

    def pool_specs(self):
        """The `PartitionSpec` tree of one K (or V) pool: split on the heads, scales like their values."""
        return QuantizedPages(KV_POOL, KV_SCALES) if self.quantized else KV_POOL

    def empty_pool(self, shape: tuple[int, ...], model_dtype):
        """One zeroed K (or V) pool of `pool_shape` `shape`, placed on the mesh as `pool_specs` says."""
        if self.mesh is None:
            sharding = lambda spec: None  # noqa: E731 (default device)
        else:
            sharding = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        values = jnp.zeros(shape, self.storage_dtype(model_dtype), device=sharding(KV_POOL))
        if not self.quantized:
            return values
        return QuantizedPages(values, jnp.zeros(shape[:3], jnp.float32, device=sharding(KV_SCALES)))

    def pool_shardings(self):
        """The `NamedSharding` tree of one pool (for jit's in/out shardings); needs `mesh`."""
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.pool_specs(),
                            is_leaf=lambda x: isinstance(x, P))

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
        pool = self.pool_specs()
        write = functools.partial(_write_kv, kv_cache_dtype=self.kv_cache_dtype)
        if self.name.startswith("pallas-tpu"):
            from jaxserve.layers import attention_tpu  # lazily: it imports this module

            write = functools.partial(attention_tpu.tpu_write_kv, kv_cache_dtype=self.kv_cache_dtype,
                                      interpret=attention_tpu.interpret_params(self.name))
        write = self._per_device(write, (pool, pool, HEADS, HEADS, REPLICATED), (pool, pool))
        return write(k_pool, v_pool, k, v, slot_mapping)

    def attend(self, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, meta: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None) -> jax.Array:
        """Causal attention of `q: [B, T, q_heads, head_dim]` over each sequence's pages (after `write_kv`)."""
        if self.name == "xla":
            attend = functools.partial(_xla_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window)
        elif self.name.startswith("pallas-tpu"):
            from jaxserve.layers import attention_tpu

            attend = functools.partial(attention_tpu.tpu_paged_attention, sm_scale=sm_scale,
                                       sliding_window=sliding_window,
                                       interpret=attention_tpu.interpret_params(self.name))
        else:
            attend = functools.partial(_pallas_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window,
                                       interpret=self.name == "pallas-interpret")
        pool = self.pool_specs()
        return self._per_device(attend, (HEADS, pool, pool, REPLICATED), HEADS)(q, k_pool, v_pool, meta)


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


def _write_kv(k_pool, v_pool, k, v, slot_mapping, *, kv_cache_dtype: str = "auto"):
    """One device's scatter (see `AttentionBackend.write_kv`); quantizes each new token's heads first."""
    slots = slot_mapping.reshape(-1)
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice fusion that copies the whole donated
        # pool every step, slow for a large pool; writing the row twice keeps it a scatter.
        slots = jnp.concatenate([slots, slots])
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
    heads, pages, page_size, head_dim = k_pool.shape
    k_new = k.reshape(-1, heads, head_dim).swapaxes(0, 1)  # [heads, tokens, head_dim]
    v_new = v.reshape(-1, heads, head_dim).swapaxes(0, 1)
    flat_shape = (heads, pages * page_size, head_dim)

    def scatter(pool, new):
        if kv_cache_dtype == "auto":
            return pool.reshape(flat_shape).at[:, slots].set(new.astype(pool.dtype)).reshape(pool.shape)
        values, scales = quantize_kv(new, kv_cache_dtype)
        return QuantizedPages(
            values=pool.values.reshape(flat_shape).at[:, slots].set(values).reshape(pool.shape),
            scales=pool.scales.reshape(flat_shape[:2]).at[:, slots].set(scales).reshape(pool.shape[:3]))

    return scatter(k_pool, k_new), scatter(v_pool, v_new)


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
    quantized = isinstance(k_pool, QuantizedPages)
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
        keys = _block(k_pool, pages, block_tokens)
        values = _block(v_pool, pages, block_tokens)
        key_pos = index * block_tokens + jnp.arange(block_tokens)
        # Slots past a row's context (the scratch page, pages it does not own) may hold anything, even NaN or
        # inf: zero their values, since a zero probability times NaN would still be NaN. Inside the context
        # every slot holds this row's own keys, so masking the scores of invisible ones there is enough.
        in_context = key_pos < meta.context_lens[:, None]  # [B, block]
        values = jnp.where(in_context[None, :, :, None], values, 0)
        scores = jnp.einsum("kbsd,bkgtd->bkgts", keys, query, preferred_element_type=jnp.float32)
        if quantized:  # per-key scales applied to the scores and the probabilities, as the Pallas kernels do
            k_scales = _block_scales(k_pool, pages, block_tokens)
            v_scales = jnp.where(in_context[None], _block_scales(v_pool, pages, block_tokens), 0.0)
            scores = scores * k_scales.transpose(1, 0, 2)[:, :, None, None, :]
        visible = (key_pos <= query_pos) & (key_pos < context_lens) & real_query
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
        probs = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(running_max - safe_max)
        denominator = denominator * rescale + jnp.sum(probs, axis=-1)
        if quantized:
            probs = probs * v_scales.transpose(1, 0, 2)[:, :, None, None, :]
        accumulator = accumulator * rescale[..., None] + jnp.einsum(
            "bkgts,kbsd->bkgtd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return new_max, denominator, accumulator

    stats_shape = (batch, num_kv_heads, group, num_tokens)
    init = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32))
    _, denominator, accumulator = jax.lax.fori_loop(0, num_blocks, block, init)
    out = accumulator / jnp.maximum(denominator, 1e-30)[..., None]  # a query with no keys (padding) gives zeros
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _block(pool, pages: jax.Array, block_tokens: int) -> jax.Array:
    """The keys (or values) of one block of pages, `[kv_heads, B, block_tokens, head_dim]`: stored values
    converted to float32 (exact for int8 and fp8) when the pool is quantized; the scales are applied apart."""
    num_kv_heads, _, _, head_dim = pool.shape
    if isinstance(pool, QuantizedPages):
        return pool.values[:, pages].reshape(num_kv_heads, -1, block_tokens, head_dim).astype(jnp.float32)
    return pool[:, pages].reshape(num_kv_heads, -1, block_tokens, head_dim)


def _block_scales(pool: QuantizedPages, pages: jax.Array, block_tokens: int) -> jax.Array:
    """The per-token scales of one block of pages, `[kv_heads, B, block_tokens]`."""
    return pool.scales[:, pages].reshape(pool.shape[0], -1, block_tokens)


def _pallas_paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, *, sm_scale, sliding_window, interpret):
    """Decode (`T == 1`) runs the decode kernel; otherwise all rows go through one ragged-kernel call.
    Quantized pools go to the kernels as stored, with their per-token scales."""
    import pallas_kernels  # imported lazily: the xla path must not depend on Pallas' GPU lowering

    scales = {}
    if isinstance(k_pool, QuantizedPages):
        scales = dict(k_scales=k_pool.scales, v_scales=v_pool.scales)
        k_pool, v_pool = k_pool.values, v_pool.values
    batch, num_tokens = q.shape[:2]
    if num_tokens == 1:
        out = pallas_kernels.paged_attention(q[:, 0], k_pool, v_pool, meta.context_lens, meta.page_tables,
                                             sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret,
                                             **scales)
        return out[:, None]
    query_lens = jnp.clip(meta.query_lens, 0, num_tokens).astype(jnp.int32)
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
    out = pallas_kernels.ragged_paged_attention(
        _to_ragged(q, cu_q_lens), k_pool, v_pool, meta.context_lens, meta.page_tables, cu_q_lens, jnp.int32(batch),
        sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret, **scales)
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

"""Backend-independent planning for the paged-attention kernels.

This module owns everything a kernel backend (Triton today, Mosaic GPU later)
needs *around* its ``pallas_call`` and that is plain XLA: argument validation,
tile-size choices, page-table sanitizing (entries a sequence does not own are
replaced by page 0 so no kernel ever dereferences a stale or out-of-range page
id), the log-sum-exp merge of split-K partial results, and the work list that
maps ragged query tiles onto sequences.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

# A large, finite negative logit for masked keys.  Finite so that
# ``mask - mask`` is 0 and ``exp(mask - real)`` is 0, never NaN.
MASK_VALUE: float = -0.7 * float(jnp.finfo(jnp.float32).max)

# Triton's tl.dot needs every tile dimension to be >= 16.
MIN_TILE: int = 16

# Most bytes of one K (or V) tile: Triton stages the tiles (two of each in flight) in shared memory, 227 KiB on
# Hopper. A float32 64-token tile at head_dim 256 (64 KiB) asked H200's compiler for 272 KiB; a bfloat16 128-token
# decode tile at head_dim 512 (128 KiB) for 404 KiB, and a 64-token ragged one (with its 64-row query tile) for
# 320 KiB. Decode tiles hold at most MAX_KV_TILE_BYTES, ragged and float32 ones MAX_F32_TILE_BYTES, which
# leaves every tile below head_dim 512 in 1- and 2-byte pages as it was.
MAX_F32_TILE_BYTES: int = 32 * 1024
MAX_KV_TILE_BYTES: int = 64 * 1024

# Page dtypes that come with per-token float32 scales (k = k_pages * k_scales); the kernels convert
# each KV tile to the compute dtype and apply the scales to the logits and probabilities.
SCALED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def query_group_rows(group_size: int) -> int:
    """Rows a KV head's query group occupies in a tile: a power of two >= 16."""
    return max(MIN_TILE, next_power_of_2(group_size))


def validate_paged_kv(
    q_heads: int,
    head_dim: int,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
    triton_tiles: bool = True,
) -> tuple[int, int, int]:
    """Checks the K/V pool layout; returns (num_kv_heads, num_pages, page_size). `triton_tiles`: the head size
    must be a power of two (Triton's tiles; Mosaic takes the pools' 128-lane multiples, as MLA's 640)."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_kv_heads, num_pages, page_size, "
            f"head_dim]; got {k_pages.shape} and {v_pages.shape}"
        )
    num_kv_heads, num_pages, page_size, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k/v head_dim {kv_head_dim}")
    if q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if triton_tiles and (not is_power_of_2(head_dim) or head_dim < MIN_TILE):
        raise ValueError(f"head_dim must be a power of two >= 16 (Triton tiles); got {head_dim}")
    if not is_power_of_2(page_size):
        raise ValueError(f"page_size must be a power of two; got {page_size}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales, or neither")
    if k_scales is not None:
        if k_pages.dtype not in SCALED_KV_DTYPES or v_pages.dtype != k_pages.dtype:
            raise ValueError(
                "k_scales/v_scales are only meaningful with int8 or float8_e4m3fn k_pages/v_pages"
            )
        expected = (num_kv_heads, num_pages, page_size)
        if k_scales.shape != expected or v_scales.shape != expected:
            raise ValueError(
                f"k_scales/v_scales must be {expected}; got {k_scales.shape}, {v_scales.shape}"
            )
    elif k_pages.dtype in SCALED_KV_DTYPES:
        raise ValueError(f"{k_pages.dtype} k_pages/v_pages need k_scales and v_scales")
    return num_kv_heads, num_pages, page_size


def validate_decode_request(batch: int, lengths: jax.Array, page_indices: jax.Array,
                            sliding_window: int | None) -> None:
    """ValueError unless `lengths` is [batch], `page_indices` [batch, pages_per_seq] and the window >= 1."""
    if lengths.shape != (batch,) or page_indices.ndim != 2 or page_indices.shape[0] != batch:
        raise ValueError(
            f"lengths must be [batch] and page_indices [batch, pages_per_seq]; got "
            f"{lengths.shape} and {page_indices.shape} for batch {batch}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1; got {sliding_window}")


def block_tokens(target: int, head_dim: int, itemsize: int, max_bytes: int) -> int:
    """A KV tile's tokens: ``target``, at most ``max_bytes`` of K (and >= MIN_TILE)."""
    return max(MIN_TILE, min(target, max_bytes // (itemsize * head_dim)))


def pages_per_kv_block(
    page_size: int, pages_per_seq: int, requested: int | None, target_tokens: int
) -> int:
    """Pages loaded per inner-loop step; the KV tile is this times page_size tokens.

    Always a power of two with a tile of at least 16 tokens (tl.dot minimum), and
    not much larger than one sequence's page table.
    """
    min_pages = max(1, MIN_TILE // page_size)
    if requested is None:
        pages = max(min_pages, target_tokens // page_size)
        pages = min(pages, max(min_pages, next_power_of_2(pages_per_seq)))
        return pages
    if not is_power_of_2(requested) or requested * page_size < MIN_TILE:
        raise ValueError(
            "pages_per_compute_block must be a power of two with pages_per_compute_block * "
            f"page_size >= {MIN_TILE}; got {requested} with page_size {page_size}"
        )
    return requested


def sanitize_page_indices(
    page_indices: jax.Array, kv_lens: jax.Array, page_size: int, width: int
) -> jax.Array:
    """Page table with every entry a sequence does not own set to page 0.

    Row ``s`` keeps its first ``ceil(kv_lens[s] / page_size)`` entries; the rest
    (stale, -1, or out of range) become 0, a page that always exists, and the
    table is padded with 0 to ``width`` columns.  Kernels mask every key of such
    pages, so their contents (even NaN) never reach the result.
    """
    page_indices = page_indices.astype(jnp.int32)
    rows, cols = page_indices.shape
    if width > cols:
        page_indices = jnp.pad(page_indices, ((0, 0), (0, width - cols)))
    owned = (kv_lens.astype(jnp.int32) + page_size - 1) // page_size
    column = jnp.arange(width, dtype=jnp.int32)
    return jnp.where(column[None, :] < owned[:, None], page_indices, 0)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static tiling of one decode call."""

    group_size: int  # query heads per KV head
    group_rows: int  # group_size padded to a power of two >= 16
    pages_per_block: int  # pages per inner-loop KV tile
    blocks_per_split: int  # KV tiles each split walks at most
    num_splits: int  # split-K partitions of the page table

    @property
    def pages_per_split(self) -> int:
        return self.blocks_per_split * self.pages_per_block

    @property
    def table_width(self) -> int:
        return self.num_splits * self.pages_per_split


# Default split-K size: KV tiles one decode program walks.  Fixed, so a row's
# partition (and with it the order of its reduction) never depends on the batch.
# With 128-token tiles a lone 32k-token row of an 8-KV-head model still gets
# 64 splits x 8 heads = 512 programs (several waves on a 132-SM H100/H200), while
# a short row has few splits, so few partial results to write and merge.
DEFAULT_BLOCKS_PER_SPLIT: int = 4


def plan_decode(
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    pages_per_seq: int,
    *,
    pages_per_compute_block: int | None,
    num_splits: int | None,
    kv_itemsize: int = 2,
    head_dim: int = 128,
) -> DecodePlan:
    """Chooses tiles and the split-K factor for a decode call.

    The default KV tile is 128 tokens for 1- and 2-byte K/V and 64 for float32
    (about the same bytes in registers), fewer at head_dim 512 (2-byte) or > 128
    (float32), to fit shared memory (``MAX_KV_TILE_BYTES``, ``MAX_F32_TILE_BYTES``).
    With ``num_splits=None`` every split walks ``DEFAULT_BLOCKS_PER_SPLIT`` KV tiles of the page table, so the plan
    is a function of the static page-table width (``pages_per_seq``), page size
    and dtype only: it takes no batch size, so a row's tiling, and with it the
    order of its reduction, cannot depend on what else is in the batch.
    """
    group_size = num_q_heads // num_kv_heads
    if kv_itemsize <= 2:
        target_block_tokens = block_tokens(128, head_dim, kv_itemsize, MAX_KV_TILE_BYTES)
    else:
        target_block_tokens = block_tokens(64, head_dim, kv_itemsize, MAX_F32_TILE_BYTES)
    pages_per_block = pages_per_kv_block(
        page_size, pages_per_seq, pages_per_compute_block, target_block_tokens
    )
    num_blocks = max(1, cdiv(pages_per_seq, pages_per_block))
    if num_splits is None:
        num_splits = cdiv(num_blocks, DEFAULT_BLOCKS_PER_SPLIT)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    num_splits = min(num_splits, num_blocks)
    blocks_per_split = cdiv(num_blocks, num_splits)
    num_splits = cdiv(num_blocks, blocks_per_split)  # drop splits that would be empty
    return DecodePlan(
        group_size=group_size,
        group_rows=query_group_rows(group_size),
        pages_per_block=pages_per_block,
        blocks_per_split=blocks_per_split,
        num_splits=num_splits,
    )


def group_sinks(sinks: jax.Array, num_q_heads: int, num_kv_heads: int, rows: int, repeats: int = 1) -> jax.Array:
    """Attention sinks ``[num_q_heads]`` as f32 ``[num_kv_heads, repeats * rows]``: each KV head's query group
    padded to ``rows`` with ``MASK_VALUE`` (no sink), repeated ``repeats`` times (a tile of tokens x heads)."""
    if sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks must be [num_q_heads = {num_q_heads}]; got {sinks.shape}")
    grouped = sinks.astype(jnp.float32).reshape(num_kv_heads, -1)
    grouped = jnp.pad(grouped, ((0, 0), (0, rows - grouped.shape[1])), constant_values=MASK_VALUE)
    return jnp.tile(grouped, (1, repeats))


def merge_split_results(partial_out: jax.Array, partial_lse: jax.Array, sinks: jax.Array | None = None
                        ) -> jax.Array:
    """Combines split-K partials ``[..., splits, rows, D]`` with their log-sum-exp; ``sinks`` (f32, broadcast
    against ``[..., rows]``) are attention-sink logits merged as one more split with a zero output.

    Each split's output is already normalized by its own softmax denominator;
    the weight of split ``s`` is ``exp(lse_s - max_s(lse))``.  Empty splits
    carry ``lse = MASK_VALUE`` and zero output, so they get weight 0 -- and if
    every split is empty the result is 0, not NaN.  The splits are added one by
    one in index order with elementwise ops (a static unroll), not with an XLA
    reduction, whose summation order could change with the other dimensions
    (the batch); so each element's result depends only on its own partials.
    """
    top = jnp.max(partial_lse, axis=-2)  # a max is exact in any order
    numerator = jnp.zeros(partial_out.shape[:-3] + partial_out.shape[-2:], jnp.float32)
    denominator = jnp.zeros(partial_lse.shape[:-2] + partial_lse.shape[-1:], jnp.float32)
    if sinks is not None:
        top = jnp.maximum(top, sinks)
        denominator = denominator + jnp.exp(sinks - top)
    for split in range(partial_lse.shape[-2]):
        weight = jnp.exp(partial_lse[..., split, :] - top)
        denominator = denominator + weight
        numerator = numerator + weight[..., None] * partial_out[..., split, :, :]
    return numerator / denominator[..., None]  # the largest split has weight 1


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """Static tiling of one ragged (prefill / extend) call."""

    group_size: int
    group_padded: int  # group_size rounded up to a power of two
    tokens_per_tile: int  # query tokens per tile (tile rows = this * group_padded)
    pages_per_block: int
    num_tiles: int  # static upper bound on query tiles over all sequences

    @property
    def tile_rows(self) -> int:
        return self.tokens_per_tile * self.group_padded


def plan_ragged(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_seqs: int,
    page_size: int,
    pages_per_seq: int,
    *,
    pages_per_compute_block: int | None,
    target_tile_rows: int = 64,
    target_block_tokens: int = 64,
    kv_itemsize: int = 2,
    head_dim: int = 128,
) -> RaggedPlan:
    """Chooses tiles for a ragged call; only ``num_tiles`` depends on ``num_tokens``.

    A tile holds ``tokens_per_tile`` query tokens of one sequence times its
    padded head group, ~``target_tile_rows`` rows (at least 16).  A call with
    few tokens thus computes some masked rows, the price of a tiling that is
    the same whatever else is in the call.
    """
    group_size = num_q_heads // num_kv_heads
    group_padded = next_power_of_2(group_size)
    # The tile's height depends on the head grouping only, never on num_tokens:
    # which query rows share a tile (and the shape of its dot products) must
    # not change with the other sequences in the call.  At least 16 rows for tl.dot.
    tokens_per_tile = max(1, target_tile_rows // group_padded, cdiv(MIN_TILE, group_padded))
    target_block_tokens = block_tokens(target_block_tokens, head_dim, kv_itemsize, MAX_F32_TILE_BYTES)
    pages_per_block = pages_per_kv_block(
        page_size, pages_per_seq, pages_per_compute_block, target_block_tokens
    )
    # Each sequence (and the padded tail, treated as one more) adds at most one
    # partial tile, so this bound always covers every token.
    num_tiles = cdiv(num_tokens, tokens_per_tile) + max_seqs
    return RaggedPlan(
        group_size=group_size,
        group_padded=group_padded,
        tokens_per_tile=tokens_per_tile,
        pages_per_block=pages_per_block,
        num_tiles=num_tiles,
    )


class RaggedWorkList(NamedTuple):
    """Per-tile scalars telling a ragged kernel program what to do (each int32[num_tiles])."""

    seq: jax.Array  # which page-table row to read
    first_row: jax.Array  # first query token (row of q) of the tile
    rows: jax.Array  # valid query tokens in the tile (0: idle tile)
    first_pos: jax.Array  # absolute position of the tile's first query token
    kv_len: jax.Array  # the sequence's kv length (0 for the padded tail)


def ragged_work_list(
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    num_tokens: int,
    tokens_per_tile: int,
    num_tiles: int,
) -> RaggedWorkList:
    """Cuts each sequence's query tokens into tiles; returns the tile table.

    Segments are the ``max_seqs`` sequences (inactive ones have no tokens) and
    the padded tail ``[cu_q_lens[num_seqs], num_tokens)``, which is given kv
    length 0 so its output rows are written as zeros.  Tiles past the last
    segment are idle (``rows == 0``) and write nothing.
    """
    max_seqs = kv_lens.shape[0]
    cu = cu_q_lens.astype(jnp.int32)
    kv = kv_lens.astype(jnp.int32)
    n = jnp.clip(jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32), 0, max_seqs)
    active = jnp.arange(max_seqs, dtype=jnp.int32) < n
    q_start = jnp.where(active, cu[:-1], 0)
    q_len = jnp.where(active, jnp.maximum(cu[1:] - cu[:-1], 0), 0)
    kv = jnp.where(active, kv, 0)
    used = jnp.clip(cu[n], 0, num_tokens)

    seg_start = jnp.concatenate([q_start, used[None]])
    seg_len = jnp.concatenate([q_len, (num_tokens - used)[None]])
    seg_kv = jnp.concatenate([kv, jnp.zeros((1,), jnp.int32)])
    seg_pos = jnp.concatenate([kv - q_len, jnp.zeros((1,), jnp.int32)])
    seg_seq = jnp.concatenate(
        [jnp.arange(max_seqs, dtype=jnp.int32), jnp.zeros((1,), jnp.int32)]
    )

    seg_tiles = (seg_len + tokens_per_tile - 1) // tokens_per_tile
    tiles_end = jnp.cumsum(seg_tiles)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seg = jnp.searchsorted(tiles_end, tile, side="right").astype(jnp.int32)
    busy = seg <= max_seqs
    seg = jnp.minimum(seg, max_seqs)
    tile_in_seg = tile - (tiles_end[seg] - seg_tiles[seg])
    offset = tile_in_seg * tokens_per_tile
    rows = jnp.where(busy, jnp.clip(seg_len[seg] - offset, 0, tokens_per_tile), 0)
    return RaggedWorkList(
        seq=jnp.where(busy, seg_seq[seg], 0),
        first_row=jnp.where(busy, seg_start[seg] + offset, num_tokens),
        rows=rows,
        first_pos=jnp.where(busy, seg_pos[seg] + offset, 0),
        kv_len=jnp.where(busy, seg_kv[seg], 0),
    )

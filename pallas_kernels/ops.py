"""Public entry points of the GPU kernels: paged attention and the grouped (mixture-of-experts) matmul.

Each function forwards to the backend module that
implements it (today only Pallas' Triton backend, ``pallas_kernels.triton``);
a Mosaic GPU backend can be selected here later without changing callers.
"""

from __future__ import annotations

import jax

from pallas_kernels.triton import decode as _triton_decode
from pallas_kernels.triton import grouped_matmul as _triton_grouped_matmul
from pallas_kernels.triton import mla_decode as _triton_mla_decode
from pallas_kernels.triton import ragged as _triton_ragged


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of one new token per sequence over a paged KV cache.

    Args:
      q: [batch, num_q_heads, head_dim]; query head ``i`` reads KV head
        ``i // (num_q_heads // num_kv_heads)``.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], the
        same dtype as q, or int8 / float8_e4m3fn together with
        ``k_scales``/``v_scales``.
      lengths: int32[batch], keys per sequence (0 gives a zero output row).
      page_indices: int32[batch, pages_per_seq]; only the first
        ``ceil(length / page_size)`` entries of a row are read, the rest may
        hold anything.
      sm_scale: logit scale, default ``1 / sqrt(head_dim)``.
      sliding_window: if set, keys at positions ``< length - sliding_window``
        are masked (Mistral-style), and the tiles before the window are skipped.
      soft_cap: if set, scaled logits are capped as ``soft_cap * tanh(x / soft_cap)``
        (Gemma 2's attention-logit soft-cap).
      sinks: if set, f32[num_q_heads] attention sinks (gpt-oss): one more logit per
        query head in every softmax, with no value (it only adds to the denominator).
      pages_per_compute_block: pages per KV tile (a power of two, tile >= 16
        tokens); default 128 tokens (64 for float32 K/V).
      num_splits: split-K partitions of the page table, merged by log-sum-exp;
        default: one split per 4 KV tiles of ``pages_per_seq`` pages (never
        a function of the batch size).
      k_scales, v_scales: float32 [num_kv_heads, num_pages, page_size]
        per-token scales for int8 or float8_e4m3fn pools (k = k_pages * k_scale).
      interpret: run the Pallas kernel in interpret mode (needed on CPU).

    Returns:
      [batch, num_q_heads, head_dim] in q's dtype.  head_dim and page_size
      must be powers of two (Triton tiles).

    Batch invariance: row ``b``'s result depends only on its own ``q[b]``, the
    K/V its first ``ceil(lengths[b] / page_size)`` page-table entries point at,
    ``lengths[b]``, and the static arguments and shapes (``pages_per_seq``,
    ``page_size``, head counts, head_dim, dtypes, the keyword options) -- not
    on the batch size or the other rows.  With the default ``num_splits`` the
    tiling comes from ``pages_per_seq`` alone, and the split-K merge adds the
    splits in a fixed order, so the same row gives bitwise identical output in
    any batch on one backend and dtype (seeded sampling relies on this).
    Results may differ in the last bits across backends (GPU vs. interpret),
    dtypes, ``pages_per_seq`` values or explicit ``num_splits`` /
    ``pages_per_compute_block`` choices.
    """
    return _triton_decode.paged_attention(
        q,
        k_pages,
        v_pages,
        lengths,
        page_indices,
        k_scales=k_scales,
        v_scales=v_scales,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        pages_per_compute_block=pages_per_compute_block,
        num_splits=num_splits,
        interpret=interpret,
    )


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    query_limits: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention of several sequences' new tokens (chunked prefill, prefix-cache extend): causal, or up to each
    query's limit.

    Args:
      q: [num_tokens, num_q_heads, head_dim]; sequence ``s`` owns rows
        ``cu_q_lens[s]:cu_q_lens[s+1]`` for ``s < num_seqs``; rows from
        ``cu_q_lens[num_seqs]`` on are padding (their output is 0 and their
        contents, even NaN, affect nothing else).
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] (or int8
        / float8_e4m3fn with scales), already holding the new tokens' K/V.
      kv_lens: int32[max_seqs], total keys per sequence including the new tokens.
      page_indices: int32[max_seqs, pages_per_seq].
      cu_q_lens: int32[max_seqs + 1], cumulative query lengths.
      num_seqs: int32[1] or scalar, active sequences.
      sm_scale, sliding_window, soft_cap, sinks, pages_per_compute_block, k_scales,
      v_scales, interpret: as for ``paged_attention``.  Query ``i`` of sequence ``s`` sits
        at position ``kv_lens[s] - q_len_s + i`` and sees keys at positions
        ``<= `` its own (and ``> position - sliding_window`` when set).
      query_limits: if set, int32[num_tokens] (rows as q's): the last key position
        each query sees instead of its own (Gemma 3's image tokens see their
        whole image), clipped to the sequence's keys; it must be at least the
        query's position (not checked: a smaller one hides the query's own key).
        The sliding window still counts back from the query's position.
        Padding rows' limits are ignored.  None: causal, the same compiled kernel
        as before limits existed.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype.

    Batch invariance, as for ``paged_attention``: sequence ``s``'s rows depend
    only on its own query rows, K/V, ``kv_lens[s]``, its query length and the
    static arguments and shapes (``pages_per_seq``, ``page_size``, head
    counts, dtypes, options) -- not on the other sequences, on where its rows
    sit in ``q``, nor on ``num_tokens``; bitwise so on one backend and dtype.
    """
    return _triton_ragged.ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        k_scales=k_scales,
        v_scales=v_scales,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        query_limits=query_limits,
        pages_per_compute_block=pages_per_compute_block,
        interpret=interpret,
    )


def mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of Multi-head Latent Attention (DeepSeek-V2/V3, absorbed) over one latent pool.

    Args:
      q_latent: [batch, num_heads, latent_dim], each head's no-rope query
        moved into latent space.
      q_rope: [batch, num_heads, rope_dim], its rotated rope query.
      pages: [1, num_pages, page_size, width], one latent row ``[c | k_rope]``
        per token (``width >= latent_dim + rope_dim``; columns past them are
        not read).  latent_dim and rope_dim: powers of two >= 16.
      lengths, page_indices, pages_per_compute_block, num_splits, interpret:
        as for ``paged_attention``.
      sm_scale: the logit scale.

    Returns:
      [batch, num_heads, latent_dim] in q_latent's dtype: each head's softmax
      of ``q_latent . c + q_rope . k_rope`` times ``c``.  Rows are
      batch-invariant as ``paged_attention``'s are.
    """
    return _triton_mla_decode.mla_paged_attention(
        q_latent, q_rope, pages, lengths, page_indices, sm_scale=sm_scale,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits, interpret=interpret)


def grouped_matmul(
    x: jax.Array,
    kernel: jax.Array,
    group_sizes: jax.Array,
    *,
    block_scale: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Each group of rows times its own kernel (the mixture-of-experts' expert linears).

    Args:
      x: [R, K], float; rows sorted by group: group ``g`` is rows
        ``[start_g, end_g)`` with ``end = cumsum(group_sizes)``.
      kernel: [G, K, N], float (converted to x's dtype) or int8 (converted
        exactly; the caller applies its scales).
      group_sizes: int32[G], each group's rows, summing to at most R.
      block_scale: float32 [G, K / bk, N / bn] for a float8 kernel in blocks
        of bk x bn (``w = kernel * block_scale`` per block), applied inside
        the kernel; None otherwise.
      interpret: run the Pallas kernel in interpret mode (needed on CPU).

    Returns:
      float32 [R, N]; rows past ``sum(group_sizes)`` are 0.  The work grows
      with R, not with G (one tile per block of rows a group overlaps).
    """
    return _triton_grouped_matmul.grouped_matmul(x, kernel, group_sizes, block_scale=block_scale,
                                                 interpret=interpret)

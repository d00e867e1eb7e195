"""Pallas kernels lowered through Pallas' Triton GPU backend (and run on CPU with interpret=True).

``decode.paged_attention``: one query token per sequence, split-K.
``ragged.ragged_paged_attention``: concatenated multi-token queries (prefill / extend).
A Mosaic GPU variant would sit beside this package (``pallas_kernels/mosaic_gpu/``)
and reuse ``pallas_kernels._planning``.
"""

from pallas_kernels.triton._common import TRITON_AVAILABLE
from pallas_kernels.triton.decode import paged_attention
from pallas_kernels.triton.ragged import ragged_paged_attention

__all__ = ["TRITON_AVAILABLE", "paged_attention", "ragged_paged_attention"]

"""Pallas kernels on the Mosaic GPU backend (Hopper): paged decode attention."""

from pallas_kernels.mosaic_gpu.decode import paged_attention

__all__ = ["paged_attention"]

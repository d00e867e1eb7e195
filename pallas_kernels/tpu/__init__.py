"""jaxserve's Mosaic TPU Pallas kernels: the KV write and ragged paged attention over the page pool.

On a TPU they compile with Mosaic; anywhere else pass `interpret=pltpu.InterpretParams()` to run them in Pallas'
TPU interpreter (which also simulates their DMAs and semaphores, and can detect races between them).
"""

from pallas_kernels.tpu.kv_write import write_to_pages
from pallas_kernels.tpu.ragged import ragged_paged_attention

__all__ = ["ragged_paged_attention", "write_to_pages"]

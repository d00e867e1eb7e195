"""jaxserve's own Pallas kernels (paged attention, the experts' grouped matmul) and their jax.numpy references.

Public API:
  paged_attention                   -- decode, one query token per sequence
  ragged_paged_attention            -- prefill / extend, ragged multi-sequence
  mla_paged_attention               -- decode of Multi-head Latent Attention over one latent pool
  grouped_matmul                    -- each row times its group's matrix (mixture-of-experts linears)
  paged_attention_reference         -- jax.numpy gather + masked softmax
  ragged_paged_attention_reference  -- likewise for the ragged case
Importing works on any jax backend; on CPU call the kernels with interpret=True.
"""

from pallas_kernels.ops import grouped_matmul, mla_paged_attention, paged_attention, ragged_paged_attention
from pallas_kernels.reference import (
    paged_attention_reference,
    ragged_paged_attention_reference,
)

__all__ = [
    "grouped_matmul",
    "mla_paged_attention",
    "paged_attention",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]

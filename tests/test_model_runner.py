"""The model runner's host-side arithmetic: how many KV pages an accelerator's memory holds; how its allocator
makes arrays."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.engine.allocator import DeviceAllocator
from jaxserve.engine.kv_budget import accelerator_kv_bytes, allocator_fraction


def test_kv_bytes_follow_vllms_gpu_memory_utilization():
    """Weights + KV + activations within `utilization` of the device: 80 GiB device, jax's allocator at 75%."""
    gib = 2**30
    stats = {"bytes_limit": 60 * gib, "bytes_in_use": 16 * gib}  # 16 GiB of weights on the device
    # 0.5 of 80 GiB = 40 GiB: 16 for weights, 4 for activations, 20 for the KV pages
    assert accelerator_kv_bytes(stats, 0.5, 0.75, 4 * gib) == 20 * gib
    # 0.9 of 80 GiB is more than the allocator may use (60 GiB): the limit wins
    assert accelerator_kv_bytes(stats, 0.9, 0.75, 4 * gib) == 40 * gib
    assert accelerator_kv_bytes(stats, 0.9, 0.9, 4 * gib) == 40 * gib  # `jaxserve serve`: allocator at 0.9
    assert accelerator_kv_bytes({"bytes_limit": 60 * gib, "bytes_in_use": 59 * gib}, 0.9, 0.75, gib) == 0


def test_a_tpus_allocator_limit_is_its_memory_and_a_gpus_follows_the_allocator_fraction(monkeypatch):
    """jax's XLA_PYTHON_CLIENT_MEM_FRACTION is the GPU allocator's: on a TPU, `bytes_limit` is the chip's memory,
    and gpu_memory_utilization alone bounds the KV pool (it used to be read as 0.75 of it there too)."""
    gib = 2**30
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert allocator_fraction("tpu") == 1.0 and allocator_fraction("gpu") == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert allocator_fraction("gpu") == 0.9 and allocator_fraction("tpu") == 1.0
    stats = {"bytes_limit": 32 * gib, "bytes_in_use": 16 * gib}  # a v6e chip holding an 8B model
    assert accelerator_kv_bytes(stats, 0.9, allocator_fraction("tpu"), gib) // gib == 11  # 28.8 - 16 - 1 GiB


def test_the_device_allocator_makes_a_pinned_layout_in_place():
    """A `Format` asks for the array in that layout from the start (a pool may take most of the memory, so it
    is never made in another layout and relaid)."""
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("model",)), P())
    pinned = Format(Layout(major_to_minor=(0, 1, 2)), sharding)
    array = DeviceAllocator().full((2, 3, 4), jnp.int8, pinned, fill=-1)
    assert array.format.layout.major_to_minor == (0, 1, 2) and array.sharding == sharding
    assert array.dtype == jnp.int8 and int(array.sum()) == -24

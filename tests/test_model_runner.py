"""The model runner's host-side arithmetic: how many KV pages an accelerator's memory holds."""

from jaxserve.engine.kv_budget import accelerator_kv_pages


def test_kv_pages_follow_vllms_gpu_memory_utilization():
    """Weights + KV + activations within `utilization` of the device: 80 GiB device, jax's allocator at 75%."""
    gib = 2**30
    stats = {"bytes_limit": 60 * gib, "bytes_in_use": 16 * gib}  # 16 GiB of weights on the device
    # 0.5 of 80 GiB = 40 GiB: 16 for weights, 4 for activations, 20 for 20 one-GiB pages
    assert accelerator_kv_pages(stats, 0.5, 0.75, 4 * gib, gib) == 20
    # 0.9 of 80 GiB is more than the allocator may use (60 GiB): the limit wins
    assert accelerator_kv_pages(stats, 0.9, 0.75, 4 * gib, gib) == 40
    assert accelerator_kv_pages(stats, 0.9, 0.9, 4 * gib, gib) == 40  # `jaxserve serve`: allocator at 0.9
    assert accelerator_kv_pages({"bytes_limit": 60 * gib, "bytes_in_use": 59 * gib}, 0.9, 0.75, gib, gib) == 2

"""The tensor-parallel layout: how many heads each device holds, the rule that decides it, and the device mesh.

Megatron-style: every device holds `num_q_heads / N` query heads and the KV heads they read, and
`intermediate_size / N` MLP columns (of each expert too, and of a shared expert). With N dividing the KV heads
each device holds `num_kv_heads / N` of them; with N a multiple of the KV heads (vLLM's rule) each KV head is replicated on
`N / num_kv_heads` devices, so every device still holds exactly one. The page pool then has one head
per device ("pool heads"), and device d's pool head is the KV head its query heads read.

A mixture of experts splits each expert's columns the same way, or with `expert_parallel` (vLLM's
`enable_expert_parallel`) its experts: each device holds `num_experts / N` whole experts.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.config import ModelConfig

MODEL_AXIS = "model"  # the mesh axis the weights, heads and KV pages are split over
REPLICATED = P()  # on every device whole


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """`size` devices splitting the model's heads and MLP columns, and the experts' columns or (`expert_parallel`)
    the experts themselves. Hashable, so jitted code can take it as static."""

    size: int = 1
    expert_parallel: bool = False

    def check(self, config: ModelConfig) -> None:
        """ValueError naming the numbers when `config` cannot be split `size` ways (checked before any loading)."""
        n, q = self.size, config.num_q_heads
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
        if q % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the number of attention heads ({q})")
        views = [config.for_layer(layer) for layer in config.layers] or [config]  # each layer's own heads, widths
        for kv in sorted({view.num_kv_heads for view in views}):
            if config.qk_norm_all_heads and kv % n:
                raise ValueError(f"tensor_parallel_size {n} must divide the number of KV heads ({kv}) for model_type "
                                 f"{config.model_type!r}, whose k norm spans every KV head (they cannot be "
                                 "replicated)")
            if kv % n and n % kv:
                raise ValueError(f"tensor_parallel_size {n} must divide the number of KV heads ({kv}), or be a "
                                 f"multiple of it (KV heads are then replicated)")
        dense = {view.intermediate_size for view, layer in zip(views, config.layers) if layer.has_dense}
        widths = {"intermediate_size": math.gcd(*dense) if dense else 0}  # n divides each: divides their gcd
        if config.linear_attention is not None:  # its key heads split, each with its value heads
            widths |= {"linear_num_key_heads": config.linear_attention.key_heads}
        if self.expert_parallel and config.moe is None:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; model_type "
                             f"{config.model_type!r} has no experts")
        if self.expert_parallel and config.moe.num_experts % n:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size {n} must divide num_experts "
                             f"({config.moe.num_experts})")
        if config.moe is not None:
            widths |= {"shared_expert_intermediate_size": config.moe.shared_expert_size}
            if not self.expert_parallel:
                widths |= {"moe_intermediate_size": config.moe.intermediate_size}
        for name, width in widths.items():
            if width % n:
                raise ValueError(f"tensor_parallel_size {n} must divide {name} ({width})")

    @property
    def expert_column_shards(self) -> int:
        """The devices each expert's columns are split over: all of them, or one under expert parallelism."""
        return 1 if self.expert_parallel else self.size

    # `config` below is a layer's view (`ModelConfig.for_layer`) where layers differ in head size or KV heads
    def q_heads_per_device(self, config: ModelConfig) -> int:
        return config.num_q_heads // self.size

    def kv_heads_per_device(self, config: ModelConfig) -> int:
        return max(1, config.num_kv_heads // self.size)

    def pool_heads(self, config: ModelConfig) -> int:
        """KV heads in the page pool: the model's, or one per device when they are replicated."""
        return self.size * self.kv_heads_per_device(config)

    def pool_head_sources(self, config: ModelConfig) -> np.ndarray:
        """The model KV head each pool head holds (the identity unless KV heads are replicated)."""
        pool = self.pool_heads(config)
        return np.arange(pool) * config.num_kv_heads // pool

    def splits_kv_weights(self, config: ModelConfig) -> bool:
        """Whether the k/v projections split over the devices (else every device reads them whole)."""
        return config.num_kv_heads % self.size == 0


def make_mesh(size: int, devices: list | None = None) -> Mesh:
    """A one-axis mesh (`MODEL_AXIS`) over the first `size` devices (of every host, in process order)."""
    devices = jax.devices() if devices is None else devices
    if jax.process_count() > 1 and size != len(devices):
        raise ValueError(f"tensor_parallel_size {size} must equal the number of devices of all {jax.process_count()} "
                         f"hosts ({len(devices)}): every host runs its share of every step")
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices, but only {len(devices)} are visible "
                         f"({', '.join(sorted({d.platform for d in devices}))})")
    return Mesh(np.array(devices[:size]), (MODEL_AXIS,))


def replica_devices(rank: int, size: int) -> list | None:
    """The devices of data-parallel replica `rank` whose engines each span `size` devices: the `rank`-th group of
    `size` in jax's order (None for replica 0: all devices, as a server of one replica uses)."""
    if rank == 0:
        return None
    devices = jax.devices()
    if (rank + 1) * size > len(devices):
        raise ValueError(f"data-parallel replica {rank} with tensor_parallel_size {size} needs devices "
                         f"{rank * size}-{(rank + 1) * size - 1}, but only {len(devices)} are visible")
    return devices[rank * size:(rank + 1) * size]

"""The accelerators `jaxserve compile` compiles for without them: each target's platform, devices and memory, and
its compile-only devices.

TPU targets are GCP accelerator types (`v6e-8`: eight v6e chips on one host); libtpu builds compile-only devices
for a topology with no chip attached (`jax.experimental.topologies.get_topology_desc`). GPU targets are NVIDIA
parts on one host (`h200x8`: eight H200s); jax's CUDA plugin builds compile-only devices from a
`GpuTargetConfigProto` written from the part's public device properties (`gpu_target_config`). Both need the
`[aot]` extra (libtpu, jax's CUDA plugin); `JAX_PLATFORMS=cpu` keeps the CUDA plugin from looking for a GPU.

Pallas' TPU lowering reads the TPU generation off jax's default device, so lowering for a TPU target happens
inside `compiling_for(target)`, which makes one of the target's devices the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator

import jax

GiB = 2**30
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator part: what a compiler and a memory plan need to know of it."""

    kind: str  # "v6e", "h200", ...
    platform: str  # "tpu" | "gpu"
    hbm_bytes: int  # memory per device (a TPU chip's, a GPU's as nvidia-smi reports it)
    hbm_bandwidth: float  # bytes/s, the roofline of a memory-bound step
    bf16_flops: float  # dense bfloat16 FLOP/s
    # TPU: libtpu's topology name prefix ("v6e"); GPU: (compute capability, SMs, L2 bytes, clock GHz)
    tpu_name: str | None = None
    gpu: tuple[tuple[int, int], int, int, float] | None = None


# Public figures: Google Cloud's TPU pages, NVIDIA's data sheets (H100 SXM5, H200 SXM, B200).
CHIPS = {
    "v4": Chip("v4", "tpu", 32 * GiB, 1.2e12, 275e12, tpu_name="v4"),
    "v5e": Chip("v5e", "tpu", 16 * GiB, 8.19e11, 197e12, tpu_name="v5e"),
    "v5p": Chip("v5p", "tpu", 95 * GiB, 2.765e12, 459e12, tpu_name="v5p"),
    "v6e": Chip("v6e", "tpu", 32 * GiB, 1.64e12, 918e12, tpu_name="v6e"),
    "h100": Chip("h100", "gpu", 81559 * MiB, 3.35e12, 989e12, gpu=((9, 0), 132, 50 * MiB, 1.98)),
    "h200": Chip("h200", "gpu", 143771 * MiB, 4.8e12, 989e12, gpu=((9, 0), 132, 50 * MiB, 1.98)),
    "b200": Chip("b200", "gpu", 183359 * MiB, 8.0e12, 2250e12, gpu=((10, 0), 148, 126 * MiB, 1.965)),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A named machine: `num_devices` of one chip on one host."""

    name: str
    chip: Chip
    num_devices: int
    topology: str  # libtpu's topology name ("v6e:2x4"), or the CUDA plugin's "1x1xN"

    @property
    def platform(self) -> str:
        return self.chip.platform


def _tpu_target(name: str, chip: str, devices: int) -> Target:
    # a chip count below a host's (v5e-1) is taken from the smallest topology libtpu builds: 2x2 (v4, v5p: 2x2x1)
    shape = {"v4": "2x2x1", "v5p": "2x2x1"}.get(chip, "2x4" if devices == 8 else "2x2")
    return Target(name, CHIPS[chip], devices, f"{CHIPS[chip].tpu_name}:{shape}")


TARGETS: dict[str, Target] = {
    **{f"{gpu}{suffix}": Target(f"{gpu}{suffix}", CHIPS[gpu], count, f"1x1x{count}")
       for gpu in ("h100", "h200", "b200") for suffix, count in (("", 1), ("x8", 8))},
    **{f"{chip}-{count}": _tpu_target(f"{chip}-{count}", chip, count) for chip in ("v5e", "v6e") for count in (1, 4, 8)},
    # v5p and v4 count TensorCores in their type names; each chip's two cores are one device (megacore)
    "v5p-8": _tpu_target("v5p-8", "v5p", 4),
    "v4-8": _tpu_target("v4-8", "v4", 4),
}


def target(name: str) -> Target:
    """The target `name`; ValueError listing the known ones otherwise."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; jaxserve compile knows {', '.join(TARGETS)}")
    return TARGETS[name]


def gpu_target_config(chip: Chip) -> str:
    """A `GpuTargetConfigProto` (text format) for `chip`: the device description XLA's GPU compiler reads in
    place of a real device's."""
    (major, minor), cores, l2_bytes, clock = chip.gpu
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bandwidth)}
  l2_cache_size: {l2_bytes}
  clock_rate_ghz: {clock}
  device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version: {{
  major: 13
  minor: 0
  patch: 0
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
}}
device_description_str: "NVIDIA {chip.kind.upper()}"
"""


class CompilerMissing(RuntimeError):
    """The compiler of a target's platform is not installed (the `[aot]` extra)."""


@functools.lru_cache(maxsize=None)
def target_devices(name: str) -> tuple:
    """The compile-only devices of target `name` (its first `num_devices` of the topology); `CompilerMissing`
    when the target's compiler is not installed."""
    t = target(name)
    from jax.experimental import topologies

    # libtpu takes a lockfile so that two processes never drive one chip; compiling drives none, and two processes
    # compiling at once (the test suite's workers, a compile beside a server) must not refuse each other
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        if t.platform == "tpu":
            topology = topologies.get_topology_desc(topology_name=t.topology, platform="tpu")
        else:
            topology = topologies.get_topology_desc(t.chip.kind, "cuda", target_config=gpu_target_config(t.chip),
                                                    topology=t.topology)
    except Exception as err:  # jax raises RuntimeError or JaxRuntimeError for a missing plugin
        extra = "libtpu" if t.platform == "tpu" else "jax's CUDA plugin (jax-cuda13-plugin)"
        raise CompilerMissing(f"cannot compile for {name}: {extra} is not usable here ({err}); install the "
                              "'[aot]' extra: pip install -e '.[aot]'") from err
    return tuple(topology.devices[:t.num_devices])


@contextlib.contextmanager
def compiling_for(name: str) -> Iterator[tuple]:
    """Lowering for target `name`: its devices, with the first one jax's default device (Pallas' TPU lowering reads
    the TPU generation off it)."""
    devices = target_devices(name)
    with jax.default_device(devices[0]):
        yield devices

"""Which jax platform a `jaxserve` command runs on, chosen before jax starts: jax's own choice where a GPU or TPU is
attached (or `JAX_PLATFORMS` says), else the CPU alone. Left to itself on a machine without the accelerator its
plugins are for, jax initializes the CUDA and TPU plugins anyway: their failures print tracebacks into the start-up
log, and libtpu takes its lockfile, so `jaxserve compile` for a TPU target beside a CPU server fails."""

from __future__ import annotations

import glob
import logging
import os
import sys

logger = logging.getLogger(__name__)

# device nodes of an attached accelerator: NVIDIA GPUs, TPUs (v4/v5e: accel, v5p/v6e: vfio), AMD GPUs
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def accelerator_attached() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def pick_platform() -> None:
    """Sets `JAX_PLATFORMS=cpu` (and jax's flag, if jax is imported) when it is unset and no accelerator is
    attached; call before jax starts its backends."""
    if os.environ.get("JAX_PLATFORMS") or accelerator_attached():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"  # and so for the processes this one starts
    if "jax" in sys.modules:  # jax read the variable when imported
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    logger.info("no GPU or TPU attached: running on the CPU (JAX_PLATFORMS chooses otherwise)")

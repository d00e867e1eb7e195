"""Where loaded weights go: the sharding of every checkpoint-layout parameter on the device mesh.

Every loader places each parameter with its `NamedSharding` from the sharding table
(`distributed/shardings.py`) as it reads it, so each device receives only its shard. The head counts are
checked against the mesh (`TensorParallel.check`) before anything is read.
"""

from __future__ import annotations

from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import param_shardings
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh


def checkpoint_shardings(config: ModelConfig, dtype: DTypeLike, mesh: Mesh | None = None) -> dict:
    """The tree of `NamedSharding`s of `checkpoint_shapes(config, dtype)` on `mesh` (default: one device);
    ValueError if `config`'s heads cannot be split `mesh.size` ways."""
    from jaxserve.models import checkpoint_shapes

    mesh = make_mesh(1) if mesh is None else mesh
    tp = TensorParallel(mesh.size)
    tp.check(config)
    return param_shardings(checkpoint_shapes(config, dtype), config, tp, mesh)

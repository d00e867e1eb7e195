"""Where loaded weights go: the sharding of every checkpoint-layout parameter on the device mesh.

Every loader places each parameter with its `NamedSharding` from the model spec's sharding rules
(`models.param_shardings`) as it reads it, so each device receives only its shard. The head counts are checked
against the mesh (`TensorParallel.check`) before anything is read.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.layers.quant_dense import cast_floats, serving_weights
from jaxserve.models import (checkpoint_shapes, fuse_layer, group_kind, param_shardings, param_specs,
                             serving_shardings)


def checkpoint_shardings(config: ModelConfig, dtype: DTypeLike, mesh: Mesh | None = None,
                         expert_parallel: bool = False) -> dict:
    """The tree of `NamedSharding`s of `checkpoint_shapes(config, dtype)` on `mesh` (default: one device; the
    experts split by expert with `expert_parallel`); ValueError if `config` cannot be split `mesh.size` ways."""
    mesh = make_mesh(1) if mesh is None else mesh
    tp = TensorParallel(mesh.size, expert_parallel)
    tp.check(config)
    return param_shardings(checkpoint_shapes(config, dtype), config, tp, mesh)


def serving_params(params: dict, config: ModelConfig, tp: TensorParallel, mesh: Mesh, dtype: DTypeLike,
                   quantization: str | None) -> dict:
    """The serving-layout params on `mesh` from the checkpoint-layout tree `params` (numpy or jax arrays, placed
    anywhere; consumed group by group, so the device never holds both copies): floats cast to `dtype`, each
    layer's projections fused on its own devices, and weights quantized as `quantization` says. A tree of
    `jax.ShapeDtypeStruct`s (`jaxserve compile`: no weights) gives the serving layout's, with their shardings."""
    def to_serving(name: str, group: dict) -> dict:
        layer = name.startswith("layers_")
        group = cast_floats(group, dtype)  # quantized leaves (an AWQ or FP8 checkpoint's) keep their dtype
        group = fuse_layer(group, config, tp, int(name.removeprefix("layers_"))) if layer else group
        # int8 weights: per output channel, which commutes with fusing's column permutation; fp8: blocks of each
        # device's columns after fusing, decoder layers only (vLLM keeps the embedding and LM head float)
        if quantization == "fp8" and not layer:
            return group
        return serving_weights(group, quantization, param_specs({name: group}, config, tp)[name], tp.size)

    converters: dict[str, object] = {}  # one compiled conversion serves every group of a kind
    serving = {}
    for name in list(params):
        group = params.pop(name)
        convert = functools.partial(to_serving, name)
        if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(group)):
            out = jax.eval_shape(convert, group)
            serving[name] = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                                     sharding=sharding),
                                         out, serving_shardings({name: out}, config, tp, mesh)[name])
            continue
        group = jax.device_put(group, param_shardings({name: group}, config, tp, mesh)[name])
        kind = group_kind(name, config)
        if kind not in converters:
            out = jax.eval_shape(convert, group)
            converters[kind] = jax.jit(convert,
                                       out_shardings=serving_shardings({name: out}, config, tp, mesh)[name])
        serving[name] = converters[kind](group)
        del group  # freed before the next group is placed
    return serving

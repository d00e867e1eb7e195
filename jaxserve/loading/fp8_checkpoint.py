"""Block-scaled FP8 checkpoints served as FP8 (`quantization="fp8"`): which of their tensors stay FP8, the shapes of
the checkpoint-layout tree that holds them, and reading each device's slice of a weight and of its scales.

A fine-grained FP8 checkpoint (DeepSeek-V3, Kimi K2, GLM-4.5-FP8, MiniMax-M2: `quantization_config: {quant_method:
fp8, weight_block_size: [bo, bi]}`) stores a linear as `weight` e4m3 `[out, in]` and `weight_scale_inv` float32
`[ceil(out / bo), ceil(in / bi)]`. A decoder linear becomes our FP8 format (`layers/fp8.py`: `kernel` float8 `[in,
out]`, `block_scale` `[in / bi, out / bo]`) when `fp8_linear` says so: its blocks tile it on every device, it is
not one the layers read as a matrix or keep float, and the linears fused with it (q/k/v, gate/up) can follow.
The rest (an edge block cut short, as DeepSeek-V3's 576-wide `kv_a_proj_with_mqa`) is dequantized on load.
"""

from __future__ import annotations

import jax
import numpy as np
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import spec_from_rules
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.fp8 import FP8, fp8_blocks_fit, split_ways
from jaxserve.layers.quant_dense import FLOAT_LINEARS, MATRIX_LINEARS
from jaxserve.models import TensorSource, checkpoint_shapes, model_spec

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears a family may fuse into one kernel


def fp8_kernel(path: str, shape: tuple, config: ModelConfig, tp: TensorParallel, block: tuple[int, int],
               stored_fp8) -> bool:
    """Whether the checkpoint-layout kernel at `path` ("layers_0/mlp/gate_proj/kernel", `shape` `[..., in, out]`)
    can load as FP8 in checkpoint blocks `block` (`weight_block_size`, `[bo, bi]`), on its own: a decoder linear
    the layers multiply by, stored as FP8 (`stored_fp8(source)`), whose blocks tile every device's part."""
    parts = path.split("/")
    if not (parts[0].startswith("layers_") and parts[-1] == "kernel" and len(shape) in (2, 3)):
        return False
    if parts[-2] in FLOAT_LINEARS + MATRIX_LINEARS:
        return False
    if parts[-2] in FUSED[0] and config.mla is None and config.head_dim % block[0]:
        return False  # llama's fused qkv cuts its columns per head
    spec_of = model_spec(config.model_type)
    source = spec_of.checkpoint_source(path, config)
    if not source.transposed or source.rows is not None or source.columns is not None or not stored_fp8(source):
        return False
    spec = spec_from_rules(path, spec_of.sharding_rules, config, tp)
    return fp8_blocks_fit(shape, (block[1], block[0]), split_ways(spec, -2, tp.size), split_ways(spec, -1, tp.size))


def fp8_checkpoint_shapes(config: ModelConfig, dtype: DTypeLike, tp: TensorParallel, block: tuple[int, int],
                          stored_fp8) -> dict:
    """`checkpoint_shapes(config, dtype)` with each kernel that loads as FP8 (`fp8_kernel`, and so can every
    linear fused with it) as float8 `kernel` and float32 `block_scale` `[..., in / bi, out / bo]`."""
    def fp8(path: str, module: dict) -> dict:
        kernel = module["kernel"]
        *lead, fan_in, fan_out = kernel.shape
        return {**module, "kernel": jax.ShapeDtypeStruct(kernel.shape, np.dtype(FP8)),
                "block_scale": jax.ShapeDtypeStruct((*lead, fan_in // block[1], fan_out // block[0]), np.float32)}

    def walk(tree: dict, path: str) -> dict:
        linears = {name for name, value in tree.items() if isinstance(value, dict) and "kernel" in value
                   and fp8_kernel(f"{path}/{name}/kernel", value["kernel"].shape, config, tp, block, stored_fp8)}
        out = {}
        for name, value in tree.items():
            fused = next((set(group) & set(tree) for group in FUSED if name in group), {name})
            if name in linears and fused <= linears:
                out[name] = fp8(path, value)
            elif isinstance(value, dict) and "kernel" not in value:
                out[name] = walk(value, f"{path}/{name}")
            else:
                out[name] = value
        return out

    return {name: walk(group, name) if isinstance(group, dict) else group
            for name, group in checkpoint_shapes(config, dtype).items()}


def scale_source(source: TensorSource) -> TensorSource:
    """The tensors holding the block scales of the weights `source` names."""
    return TensorSource(tuple(f"{name}_scale_inv" for name in source.names), source.transposed)


def read_fp8_slice(weight: np.ndarray, index: tuple) -> np.ndarray:
    """Our `index` `[in, out]` of a float8 weight stored `[out, in]` (`hf_files.fp8_view`), as float8."""
    index = tuple(index) + (slice(None),) * (2 - len(index))
    return np.ascontiguousarray(weight[index[1], index[0]].T)


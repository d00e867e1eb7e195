"""The converted-checkpoint store: params saved with orbax beside the model config, tokenizer and generation config.

Params are saved in the checkpoint layout (`models.checkpoint_shapes`: q/k/v and gate/up apart) and keep the dtype
they were saved in (float32 for converted GGUF files). They are restored straight into the serving dtype as jax
arrays with their target shardings (each device receives its own shard), group by group, so a float32 store served
in bfloat16 never holds the float32 model. A store whose saved tree is not the checkpoint layout of its config
(e.g. one saved in the earlier fused layout, `qkv_proj` / `gate_up_proj`) is reported as `CorruptCheckpointError`.

A store directory is written under a temporary name and renamed into place only when complete; its
manifest (written last) lists every file with its size, so a truncated or partial directory is
detected on load and raised as `CorruptCheckpointError` instead of being half-loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import path_name
from jaxserve.loading.placement import checkpoint_shardings
from jaxserve.models import checkpoint_shapes

logger = logging.getLogger(__name__)
MANIFEST = "jaxserve_manifest.json"
CONFIG_FILE = "jaxserve_config.json"
PARAMS_DIR = "params"
GENERATION_CONFIG_FILE = "generation_config.json"


class CorruptCheckpointError(RuntimeError):
    """A converted checkpoint directory is missing files, has truncated files, or does not restore."""


def is_store(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).exists() or (Path(path) / CONFIG_FILE).exists()


def save_store(path: str | os.PathLike, config: ModelConfig, params: dict, tokenizer,
               generation_config: dict | None = None) -> None:
    """Writes `params` (orbax), `config`, `tokenizer` and `generation_config` to `path` atomically (temp dir + rename).

    `generation_config` is the checkpoint's generation_config.json content, saved under that name.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(staging / PARAMS_DIR, params)
        checkpointer.wait_until_finished()
        checkpointer.close()
        (staging / CONFIG_FILE).write_text(config.to_json())
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        if generation_config is not None:
            (staging / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config, indent=2))
        files = {str(f.relative_to(staging)): f.stat().st_size for f in sorted(staging.rglob("*")) if f.is_file()}
        (staging / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def verify_store(path: str | os.PathLike) -> None:
    """Raises `CorruptCheckpointError` naming the first missing or wrongly sized file."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CorruptCheckpointError(f"checkpoint {path} has no {MANIFEST}: the conversion did not finish")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise CorruptCheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({err})") from err
    for name, size in files.items():
        file = path / name
        if not file.exists():
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if file.stat().st_size != size:
            raise CorruptCheckpointError(
                f"checkpoint {path} is corrupt: {name} has {file.stat().st_size} bytes, expected {size}")


def read_store_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` a store was saved with (no weights read); `CorruptCheckpointError` if it is unreadable."""
    file = Path(path) / CONFIG_FILE
    try:
        return ModelConfig.from_json(file.read_text())
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CorruptCheckpointError(f"checkpoint {path}: unreadable {CONFIG_FILE} ({err})") from err


def check_stored_layout(checkpointer, params_dir: Path, config: ModelConfig) -> None:
    """`CorruptCheckpointError` unless the saved tree is exactly the checkpoint layout of `config` (same parameter
    paths and shapes). Orbax's partial restore would return a placeholder, not an error, for a missing parameter."""
    metadata = checkpointer.metadata(params_dir)
    metadata = getattr(metadata, "item_metadata", metadata)
    stored = {path_name(key): tuple(leaf.shape) for key, leaf in jax.tree_util.tree_flatten_with_path(metadata)[0]}
    expected = {path_name(key): leaf.shape
                for key, leaf in jax.tree_util.tree_flatten_with_path(checkpoint_shapes(config))[0]}
    if any(re.search(r"/(qkv_proj|gate_up_proj)/", name) for name in stored):
        raise CorruptCheckpointError(f"checkpoint {params_dir.parent} is in the old fused layout (qkv_proj / "
                                     f"gate_up_proj); it must be converted again")
    missing, unexpected = sorted(expected.keys() - stored.keys()), sorted(stored.keys() - expected.keys())
    if missing or unexpected:
        raise CorruptCheckpointError(f"checkpoint {params_dir.parent} does not hold the parameters of its config: "
                                     f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, shape in expected.items():
        if stored[name] != shape:
            raise CorruptCheckpointError(f"checkpoint {params_dir.parent}: {name} has shape {stored[name]}, "
                                         f"its config implies {shape}")


def restore_store(path: str | os.PathLike, dtype: DTypeLike = np.float32, mesh: Mesh | None = None,
                  expert_parallel: bool = False) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params)` from a verified store: jax arrays in `dtype`, placed on `mesh` (default: one device)
    by the sharding table. The head counts are checked against the mesh before any weight is read.

    Orbax casts each array to `dtype` as it reads it and places it straight onto the devices with its sharding, so
    each device receives only its shard (the store's chunks, one per array as saved from the host, are read whole
    and sliced). It reads all the arrays it is asked for at once, so the params are restored one top-level group
    (the embedding, one layer, the head) at a time: the stored-dtype bytes in flight are one group's, never the
    whole model's.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    verify_store(path)
    config = read_store_config(path)
    shardings = checkpoint_shardings(config, dtype, mesh, expert_parallel)
    params = {}
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            check_stored_layout(checkpointer, path / PARAMS_DIR, config)
            for group, shapes in checkpoint_shapes(config, dtype).items():
                target = {group: jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, dtype, sharding=where),
                                              shapes, shardings[group])}
                restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype), target)
                params.update(checkpointer.restore(path / PARAMS_DIR, args=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore_args, partial_restore=True)))
    except CorruptCheckpointError:
        raise
    except Exception as err:  # orbax raises many types for a damaged directory
        raise CorruptCheckpointError(f"checkpoint {path} does not restore: {err}") from err
    if not all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params)):
        raise CorruptCheckpointError(f"checkpoint {path} does not hold every parameter of its config")
    return config, params


def load_store(path: str | os.PathLike, dtype: DTypeLike = np.float32, mesh: Mesh | None = None):
    """`(ModelConfig, params in dtype on mesh, tokenizer or None)` from a verified store."""
    from transformers import AutoTokenizer

    config, params = restore_store(path, dtype, mesh)
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if (Path(path) / "tokenizer.json").exists() else None
    return config, params, tokenizer

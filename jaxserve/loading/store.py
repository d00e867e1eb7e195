"""The converted-checkpoint store: params saved with orbax beside the model config, tokenizer and generation config.

Params keep the dtype they were saved in (float32 for converted GGUF files) and are restored straight into the
serving dtype, group by group, so a float32 store served in bfloat16 never holds the float32 model.

A store directory is written under a temporary name and renamed into place only when complete; its
manifest (written last) lists every file with its size, so a truncated or partial directory is
detected on load and raised as `CorruptCheckpointError` instead of being half-loaded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig

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


def restore_store(path: str | os.PathLike, dtype: DTypeLike = np.float32) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params as numpy arrays in dtype)` from a verified store.

    Orbax casts each array to `dtype` as it reads it, but it reads all the arrays it is asked for at once (into one
    coalesced buffer of their stored bytes), so the params are restored one top-level group (the embedding, one
    layer, the head) at a time: the stored-dtype bytes in flight are one group's, never the whole model's.
    """
    import orbax.checkpoint as ocp

    from jaxserve.models import checkpoint_shapes

    path = Path(path).absolute()
    verify_store(path)
    config = ModelConfig.from_json((path / CONFIG_FILE).read_text())
    params = {}
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            for group, shapes in checkpoint_shapes(config).items():
                target = {group: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)}
                restore_args = jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), target)
                params.update(checkpointer.restore(path / PARAMS_DIR, args=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore_args, partial_restore=True)))
    except Exception as err:  # orbax raises many types for a damaged directory
        raise CorruptCheckpointError(f"checkpoint {path} does not restore: {err}") from err
    return config, params


def load_store(path: str | os.PathLike, dtype: DTypeLike = np.float32):
    """`(ModelConfig, params in dtype, tokenizer or None)` from a verified store."""
    from transformers import AutoTokenizer

    config, params = restore_store(path, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if (Path(path) / "tokenizer.json").exists() else None
    return config, params, tokenizer

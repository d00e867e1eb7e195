"""The converted-checkpoint store: params saved with orbax beside the model config and tokenizer files.

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

from jaxserve.config import ModelConfig

logger = logging.getLogger(__name__)
MANIFEST = "jaxserve_manifest.json"
CONFIG_FILE = "jaxserve_config.json"
PARAMS_DIR = "params"


class CorruptCheckpointError(RuntimeError):
    """A converted checkpoint directory is missing files, has truncated files, or does not restore."""


def is_store(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).exists() or (Path(path) / CONFIG_FILE).exists()


def save_store(path: str | os.PathLike, config: ModelConfig, params: dict, tokenizer) -> None:
    """Writes `params` (orbax), `config` and `tokenizer` to `path` atomically (temp dir + rename)."""
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


def load_store(path: str | os.PathLike, dtype=np.float32):
    """`(ModelConfig, params, tokenizer)` from a verified store; params cast to `dtype` on the default device."""
    import orbax.checkpoint as ocp
    from transformers import AutoTokenizer

    from jaxserve.models import param_shapes

    path = Path(path).absolute()
    verify_store(path)
    config = ModelConfig.from_json((path / CONFIG_FILE).read_text())
    stored_dtype = np.float32
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, stored_dtype), param_shapes(config))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path / PARAMS_DIR, target)
    except Exception as err:  # orbax raises many types for a damaged directory
        raise CorruptCheckpointError(f"checkpoint {path} does not restore: {err}") from err
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer.json").exists() else None
    return config, params, tokenizer

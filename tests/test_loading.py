"""Loading: weights land in the serving dtype without a float32 copy of the model, generation_config.json's EOS ids
and sampling defaults (vLLM's `--generation-config`), and a tokenizer from another directory (`--tokenizer`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from conftest import save_tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.loading import load_model
from jaxserve.loading.store import save_store
from jaxserve.models import param_shapes

REPO_ROOT = Path(__file__).resolve().parents[1]
BF16 = np.dtype(jnp.bfloat16)
MiB = 1 << 20
# Untied embeddings and wide MLPs: 8 tensors of 1-4 M elements, so no single tensor dominates the model.
LARGE_DIMS = dict(vocab_size=16384, hidden_size=256, intermediate_size=4096, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [0, 7, 9], "do_sample": True, "temperature": 0.6,
                     "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "transformers_version": "4.45.0"}
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def nbytes(params) -> int:
    return sum(leaf.nbytes for leaf in leaves(params))


def largest_leaf_size(params) -> int:
    return max(leaf.size for leaf in leaves(params))


def copy_model_dir(src: str, dst: Path, *, tokenizer: bool = True) -> Path:
    dst.mkdir(parents=True)
    for file in Path(src).iterdir():
        if tokenizer or file.name in ("config.json", "model.safetensors"):
            shutil.copy(file, dst / file.name)
    return dst


@pytest.fixture(scope="module")
def large_bf16_dir(tmp_path_factory) -> str:
    """A checkpoint saved in bfloat16, 14.5 M parameters (29 MiB), no tokenizer."""
    path = tmp_path_factory.mktemp("large_bf16")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LARGE_DIMS), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bfloat16_load_equals_float32_load_cast(tiny_model_dirs, family):
    as_f32 = load_model(tiny_model_dirs[family], dtype=jnp.float32)
    as_bf16 = load_model(tiny_model_dirs[family], dtype=jnp.bfloat16)
    assert jax.tree.structure(as_bf16.params) == jax.tree.structure(as_f32.params)
    for a32, a16 in zip(leaves(as_f32.params), leaves(as_bf16.params)):
        assert a32.dtype == np.float32 and a16.dtype == BF16
        np.testing.assert_array_equal(a16, a32.astype(BF16))


def test_bfloat16_checkpoint_loads_in_float32_exactly(large_bf16_dir):
    from safetensors import safe_open

    loaded = load_model(large_bf16_dir, dtype=np.float32)
    with safe_open(str(Path(large_bf16_dir) / "model.safetensors"), framework="pt") as reader:
        embed = reader.get_tensor("model.embed_tokens.weight").float().numpy()
        gate = reader.get_tensor("model.layers.1.mlp.gate_proj.weight").float().numpy()
    np.testing.assert_array_equal(loaded.params["embed"]["embedding"], embed)
    gate_up = loaded.params["layers_1"]["mlp"]["gate_up_proj"]["kernel"]
    assert gate_up.dtype == np.float32
    np.testing.assert_array_equal(gate_up[:, :LARGE_DIMS["intermediate_size"]], gate.T)


def test_safetensors_load_in_bfloat16_allocates_only_the_params(large_bf16_dir, tiny_llama_dir):
    """Peak numpy allocations while loading a bf16 checkpoint in bf16: the params, plus one tensor's worth of slack.

    Converting through float32 needs a float32 copy of the tensor being converted beside its concatenated float32
    kernel; reading the whole checkpoint before converting it holds the checkpoint and the params together. Each
    exceeds the bound.
    """
    load_model(tiny_llama_dir, dtype=jnp.bfloat16)  # imports and first-call caches stay out of the measurement
    tracemalloc.start()
    try:
        loaded = load_model(large_bf16_dir, dtype=jnp.bfloat16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(leaf.dtype == BF16 for leaf in leaves(loaded.params))
    params_bytes = nbytes(loaded.params)
    bound = params_bytes + 2 * largest_leaf_size(loaded.params) + 2 * MiB
    assert bound < 2 * params_bytes
    assert peak < bound, (peak / MiB, bound / MiB)


RESTORE_PEAK_SCRIPT = """
import ctypes, json, sys
from pathlib import Path
import jax, jax.numpy as jnp
from jaxserve.loading.store import load_store

def resident(key):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))

load_store(sys.argv[1], jnp.bfloat16)  # imports, orbax and tensorstore set-up
ctypes.CDLL("libc.so.6").malloc_trim(0)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
before = resident("VmRSS")
_, params, _ = load_store(sys.argv[2], jnp.bfloat16)
print(json.dumps({"peak": resident("VmHWM") - before, "dtypes": sorted({str(a.dtype) for a in jax.tree.leaves(params)})}))
"""


def store_with_random_params(path: Path, dims: dict) -> ModelConfig:
    config = ModelConfig.from_hf(transformers.LlamaConfig(**dims))
    rng = np.random.default_rng(0)
    save_store(path, config, jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32),
                                          param_shapes(config)), None)
    return config


def test_float32_store_restores_in_bfloat16_without_the_float32_model(tmp_path):
    """Peak resident memory of restoring a float32 store (58 MiB) as bf16 (29 MiB), measured in a fresh process.

    Bound: the bf16 params, the float32 bytes of the largest group restored at once, and 16 MiB for tensorstore's
    threads and caches. Restoring in float32 and casting holds the float32 model and its bf16 copy; restoring every
    array at once holds their float32 read buffers together. Each exceeds the bound.
    """
    config = store_with_random_params(tmp_path / "large", LARGE_DIMS)
    store_with_random_params(tmp_path / "small", {**LARGE_DIMS, "vocab_size": 64, "intermediate_size": 64})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MiB)}  # large buffers are unmapped when freed, not kept
    run = subprocess.run([sys.executable, "-c", RESTORE_PEAK_SCRIPT, str(tmp_path / "small"),
                          str(tmp_path / "large")], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["dtypes"] == ["bfloat16"]
    shapes = param_shapes(config)
    params_bytes = sum(2 * s.size for s in jax.tree.leaves(shapes))
    largest_group_bytes = max(sum(4 * s.size for s in jax.tree.leaves(group)) for group in shapes.values())
    bound = params_bytes + largest_group_bytes + 16 * MiB
    assert bound < 3 * params_bytes
    assert result["peak"] < bound, (result["peak"] / MiB, bound / MiB)


def with_generation_config(model_dir: str, dst: Path, generation_config: dict) -> str:
    copy_model_dir(model_dir, dst)
    (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return str(dst)


def test_generation_config_adds_eos_ids_and_sampling_defaults(tiny_llama_dir, tmp_path):
    plain = load_model(tiny_llama_dir)
    assert plain.generation_config == {}
    path = with_generation_config(tiny_llama_dir, tmp_path / "model", GENERATION_CONFIG)
    loaded = load_model(path)
    assert loaded.config.eos_token_ids == tuple(dict.fromkeys((*plain.config.eos_token_ids, 0, 7, 9)))
    assert loaded.generation_config == SAMPLING_DEFAULTS


def test_generation_config_single_eos_id_and_nulls(tiny_llama_dir, tmp_path):
    path = with_generation_config(tiny_llama_dir, tmp_path / "model",
                                  {"eos_token_id": 5, "temperature": None, "min_p": 0.05, "repetition_penalty": 1.1})
    loaded = load_model(path)
    assert 5 in loaded.config.eos_token_ids
    assert loaded.generation_config == {"min_p": 0.05, "repetition_penalty": 1.1}


def test_generation_config_vllm_drops_the_sampling_defaults_only(tiny_llama_dir, tmp_path):
    """As vLLM's `--generation-config vllm`: neutral sampling defaults, the model's EOS ids still stop generation."""
    path = with_generation_config(tiny_llama_dir, tmp_path / "model", GENERATION_CONFIG)
    loaded = load_model(path, generation_config="vllm")
    assert loaded.generation_config == {}
    assert {0, 7, 9} <= set(loaded.config.eos_token_ids)


def test_generation_config_from_another_directory(tiny_llama_dir, tmp_path):
    elsewhere = tmp_path / "generation"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 12], "top_k": 5}))
    model_dir = with_generation_config(tiny_llama_dir, tmp_path / "model", GENERATION_CONFIG)
    loaded = load_model(model_dir, generation_config=str(elsewhere))
    assert {11, 12} <= set(loaded.config.eos_token_ids) and 7 not in loaded.config.eos_token_ids
    assert loaded.generation_config == {"top_k": 5}


@pytest.mark.parametrize("where", ["missing", "no_file"])
def test_generation_config_unknown_path_is_a_clear_error(tiny_llama_dir, tmp_path, where):
    folder = tmp_path / where
    if where == "no_file":
        folder.mkdir()
    with pytest.raises(ValueError, match=f"generation_config '{folder}'"):
        load_model(tiny_llama_dir, generation_config=str(folder))


def test_store_keeps_the_generation_config(tiny_llama_dir, tmp_path):
    plain = load_model(tiny_llama_dir)
    save_store(tmp_path / "store", plain.config, plain.params, plain.tokenizer, generation_config=GENERATION_CONFIG)
    loaded = load_model(str(tmp_path / "store"), dtype=jnp.bfloat16)
    assert {0, 7, 9} <= set(loaded.config.eos_token_ids)
    assert loaded.generation_config == SAMPLING_DEFAULTS
    for a32, a16 in zip(leaves(plain.params), leaves(loaded.params)):
        assert a16.dtype == BF16
        np.testing.assert_array_equal(a16, a32.astype(BF16))
    assert load_model(str(tmp_path / "store"), generation_config="vllm").generation_config == {}


def test_tokenizer_from_another_directory(tiny_llama_dir, tmp_path):
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "model", tokenizer=False)
    assert load_model(str(model_dir)).tokenizer is None
    tokenizer_dir = tmp_path / "tokenizer"
    save_tiny_tokenizer(str(tokenizer_dir), 512)
    tokenizer = load_model(str(model_dir), tokenizer=str(tokenizer_dir)).tokenizer
    expected = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tokenizer.encode("the theory") == expected.encode("the theory")
    assert tokenizer.eos_token == "<|endoftext|>"


def test_tokenizer_replaces_the_models_own(tiny_llama_dir, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = "{{ messages[0]['content'] }}!"
    tokenizer.save_pretrained(str(tokenizer_dir))
    assert load_model(tiny_llama_dir, tokenizer=str(tokenizer_dir)).tokenizer.chat_template.endswith("!")


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_tokenizer_that_cannot_be_loaded_is_a_clear_error(tiny_llama_dir, tmp_path, where):
    folder = tmp_path / where
    if where == "empty":
        folder.mkdir()
    with pytest.raises(ValueError, match=f"tokenizer '{folder}'|cannot load a tokenizer from '{folder}'"):
        load_model(tiny_llama_dir, tokenizer=str(folder))

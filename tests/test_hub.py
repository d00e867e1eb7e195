"""Models named by hub id (jaxserve/loading/hub.py) through a hub on loopback (tests/hub_server.py) and
huggingface_hub's own cache: only the serving files fetched, offline mode served from the cache, the errors a user
meets named; and the command line as vLLM's (`jaxserve serve MODEL`, `--config`, `--dtype auto`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig, serving_dtype
from jaxserve.loading import hub, load_model, resolve_model
from jaxserve.server.cli_args import build_parser, config_file_args, engine_config, model_argument
from jaxserve.spec_decode.config import CPU_DISABLE_BY_BATCH_SIZE
from tests.conftest import random_prompts
from tests.hub_server import Hub

EXTRAS = {"pytorch_model.bin": b"torch", "original/model.safetensors": b"another layout", "onnx/model.onnx": b"o",
          "README.md": b"# tiny"}


@pytest.fixture
def repos(tiny_llama_dir, tmp_path):
    """Folders served as repositories: org/tiny (the tiny Llama and files serving does not read), org/bins
    (weights as .bin only), org/gguf (two GGUF files), org/remote (a model only its own code runs)."""
    tiny = tmp_path / "repos" / "tiny"
    shutil.copytree(tiny_llama_dir, tiny)
    for name, data in EXTRAS.items():
        (tiny / name).parent.mkdir(exist_ok=True)
        (tiny / name).write_bytes(data)
    bins = tmp_path / "repos" / "bins"
    bins.mkdir()
    (bins / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (bins / "pytorch_model.bin").write_bytes(b"torch")
    gguf = tmp_path / "repos" / "gguf"
    gguf.mkdir()
    for quant in ("Q4_K_M", "Q8_0"):
        (gguf / f"tiny-{quant}.gguf").write_bytes(quant.encode())
    remote = tmp_path / "repos" / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "my_arch", "auto_map": {
        "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    (remote / "model.safetensors").write_bytes(b"")
    return {"org/tiny": tiny, "org/bins": bins, "org/gguf": gguf, "org/remote": remote,
            "org/private": tiny, "org/gated": tiny}


@pytest.fixture
def loopback_hub(repos, tmp_path, monkeypatch):
    hub.cached_snapshot.cache_clear()
    served = Hub(repos, private=("org/private",), gated=("org/gated",))
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield served
    served.close()


def test_a_hub_id_serves_its_model_fetching_only_the_serving_files_and_offline_from_the_cache(
        loopback_hub, tiny_llama_dir, tmp_path, monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 500, 5, 20, seed=3)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM("org/tiny", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, smallest_prefill_bucket=32,
              decode_batch_buckets=(2,), warmup=False)
    assert llm.llm_engine.model.name == "org/tiny"
    served = sorted(loopback_hub.downloads)
    assert served == sorted(p.name for p in Path(tiny_llama_dir).iterdir()), served  # none of EXTRAS
    snapshot = Path(llm.llm_engine.engine_config.model)
    assert snapshot.parent.name == "snapshots" and snapshot.name == Hub.commit("org/tiny")
    theirs = load_model(tiny_llama_dir).params
    ours = load_model(str(snapshot)).params
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), ours, theirs))
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert tokens and all(len(t) == 6 for t in tokens)

    loopback_hub.close()  # offline: the cache alone, the hub never asked
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny").weights == snapshot
    assert resolve_model("org/tiny", revision=Hub.commit("org/tiny")).weights == snapshot
    with pytest.raises(ValueError, match=r"'org/other' \(revision main\) is not in the hub cache .*HF_HUB_OFFLINE=1"):
        resolve_model("org/other")
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the hub unreachable: the cache, as huggingface_hub does
    hub.cached_snapshot.cache_clear()
    assert resolve_model("org/tiny").weights == snapshot
    with pytest.raises(ValueError, match="cannot reach the hub at .* set HF_HUB_OFFLINE=1"):
        resolve_model("org/other")


@pytest.mark.parametrize("model, revision, message", [
    ("org/none", None, r"model 'org/none' was not found on the hub at http://127\.0\.0\.1.*HF_TOKEN"),
    ("org/private", None, r"model 'org/private' was not found on the hub .*private repository set HF_TOKEN"),
    ("org/gated", None, r"org/gated is gated: .*HF_TOKEN"),
    ("org/tiny", "v9", r"org/tiny has no revision 'v9'"),
    ("org/bins", None, r"org/bins has no model\*\.safetensors weights .*\['pytorch_model\.bin'\]"),
    ("org/gguf", None, r"org/gguf: pick one GGUF file with --gguf-file NAME or org/gguf:QUANT .*several"),
    ("org/gguf:Q5", None, r"none matches 'Q5'"),
])
def test_what_the_hub_refuses_is_a_value_error_that_names_it(loopback_hub, model, revision, message):
    with pytest.raises(ValueError, match=message):
        resolve_model(model, revision=revision)


def test_a_model_that_needs_its_own_code_is_refused_by_name(loopback_hub):
    from jaxserve.loading import model_config

    with pytest.raises(ValueError, match=r"auto_map .* which jaxserve does not run, --trust-remote-code or not"):
        model_config(resolve_model(EngineConfig(model="org/remote", trust_remote_code=True).localized().model))


def test_a_gguf_repository_gives_the_file_its_quant_names_and_compile_fetches_the_config_alone(loopback_hub):
    source = resolve_model("org/gguf:q8_0")
    assert source.kind == "gguf" and source.weights.name == "tiny-Q8_0.gguf" and source.name == "org/gguf"
    assert loopback_hub.downloads == ["tiny-Q8_0.gguf"]
    assert resolve_model("org/gguf", gguf_file="tiny-Q4_K_M.gguf").weights.name == "tiny-Q4_K_M.gguf"
    loopback_hub.downloads.clear()
    config = EngineConfig(model="org/tiny").localized("config")
    assert sorted(loopback_hub.downloads) == ["config.json", "generation_config.json"]
    assert sorted(p.name for p in Path(config.model).iterdir()) == ["config.json", "generation_config.json"]


def test_a_draft_model_named_by_hub_id_is_fetched_at_its_revision(loopback_hub, tiny_llama_dir):
    local = EngineConfig(model=tiny_llama_dir, speculative_config={"model": "org/tiny", "num_speculative_tokens": 2},
                         max_model_len=64).localized()
    snapshot = Path(local.speculative_config["model"])
    assert snapshot.name == Hub.commit("org/tiny") and (snapshot / "model.safetensors").is_file()
    assert local.model == tiny_llama_dir
    spec = local.resolve(64, "cpu").speculative_config  # the dict's unset keys still take the platform's defaults
    assert spec.method == "draft_model" and spec.disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE
    assert load_model(spec.model).config.vocab_size == load_model(tiny_llama_dir).config.vocab_size
    with pytest.raises(ValueError, match=r"org/tiny has no revision 'v9'"):
        EngineConfig(model=tiny_llama_dir, speculative_config='{"model": "org/tiny", "revision": "v9", '
                     '"num_speculative_tokens": 2}').localized()
    with pytest.raises(ValueError, match=r"speculative_config 'revision' must be a string, beside a hub id"):
        EngineConfig(model=tiny_llama_dir, speculative_config={"method": "ngram", "revision": "main",
                                                               "num_speculative_tokens": 2})


def test_a_config_transformers_refuses_is_a_value_error_naming_the_file(tmp_path):
    from jaxserve.loading.hf_files import hf_model_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 100,
                                                      "num_attention_heads": 3}))
    with pytest.raises(ValueError, match=r"(?s)config\.json: .*hidden size \(100\) is not a multiple"):
        hf_model_config(str(tmp_path))


def test_the_serve_command_takes_the_model_first_and_its_flags_from_a_yaml_file(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["Qwen/Qwen3-8B", "--port", "9000", "--dtype", "half", "--revision", "v1"])
    assert model_argument(args) == "Qwen/Qwen3-8B" and args.port == 9000
    args.model = model_argument(args)
    config = engine_config(args)
    assert (config.model, config.dtype, config.revision) == ("Qwen/Qwen3-8B", "half", "v1")
    assert parser.parse_args([]).dtype == "auto"
    with pytest.raises(ValueError, match="the model is given twice"):
        model_argument(parser.parse_args(["a/b", "--model", "c/d"]))
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text("model: org/file\nport: 7000\nenable_prefix_caching: false\nenable-lora: true\n"
                         "served-model-name: [one, two]\n")
    args = parser.parse_args(config_file_args(["--config", str(yaml_file), "--port", "7100"], parser))
    assert (args.model, args.port, args.enable_prefix_caching, args.enable_lora, args.served_model_name) == (
        "org/file", 7100, False, True, ["one", "two"])
    args = parser.parse_args(config_file_args(["org/line", "--config", str(yaml_file)], parser))
    assert model_argument(args) == "org/line"  # the command line's model wins
    yaml_file.write_text("no_such_flag: 1\n")
    with pytest.raises(ValueError, match="'no_such_flag' is not a flag of jaxserve serve"):
        config_file_args(["--config", str(yaml_file)], parser)


@pytest.mark.parametrize("requested, checkpoint, platform, served", [
    (None, "bfloat16", "cpu", "float32"), ("auto", "float32", "gpu", "bfloat16"), ("auto", "float16", "tpu", "bfloat16"),
    ("half", None, "gpu", "bfloat16"), ("float16", None, "cpu", "bfloat16"), ("float", "bfloat16", "gpu", "float32"),
    ("bfloat16", "float32", "cpu", "bfloat16"),
])
def test_vllms_dtype_choices_resolve_to_a_serving_dtype_with_a_reason(requested, checkpoint, platform, served):
    dtype, why = serving_dtype(requested, checkpoint, platform)
    assert dtype == served and why


def test_a_path_into_the_hub_cache_is_named_by_its_repository(tiny_llama_dir, tmp_path):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_llama_dir, snapshot)
    assert resolve_model(str(snapshot)).name == "org/tiny"
    assert not hub.is_hub_id(str(snapshot)) and hub.is_hub_id("org/tiny:Q4_K_M") and not hub.is_hub_id("a/b/c")


def test_a_truncated_safetensors_file_in_the_cache_is_a_value_error_naming_it(tiny_llama_dir, tmp_path):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / ("b" * 40)
    shutil.copytree(tiny_llama_dir, snapshot)
    weights = snapshot / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"{weights}: .*truncated or damaged"):
        load_model(str(snapshot))


@pytest.mark.parametrize("platform, kv_cache_dtype, page_size", [
    ("tpu", "int8", 128), ("tpu", "fp8", 128), ("tpu", "auto", 16), ("gpu", "int8", 16), ("cpu", "fp8", 16)])
def test_the_default_page_size_is_one_the_backend_keeps_in_its_kernels_layout(platform, kv_cache_dtype, page_size):
    """vLLM's block size of 16, except where the backend needs larger pages: a TPU's Mosaic kernels with per-token
    scales (`jaxserve compile --target v5e-8 --kv-cache-dtype int8` refused the old default of 16)."""
    resolved = EngineConfig(kv_cache_dtype=kv_cache_dtype).resolve(512, platform)
    assert resolved.page_size == page_size
    assert EngineConfig(kv_cache_dtype=kv_cache_dtype, page_size=32).resolve(512, platform).page_size == 32

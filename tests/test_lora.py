"""LoRA adapters against HF transformers + PEFT: random adapters on a small random Llama, mixed with the base model
in one batch (one device, and tensor parallelism over 2 and 4 simulated devices, the latter with replicated KV
heads), slots evicted and adapters re-read, no compile when adapters change, the prefix cache never crossing
adapters, and bad adapters refused before they touch the device."""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.lora.peft_format import read_adapter
from jaxserve.models import config_from_hf
from tests.conftest import random_prompts, tiny_hf_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# no warm-up (each shape compiles when first run), but where compiles are counted after it
# one prefill shape (128 tokens: the budget the 512 default gave these prompts) and one decode shape
OPTIONS = dict(max_num_seqs=8, max_model_len=128, num_kv_pages=96, enable_lora=True, max_lora_rank=16, warmup=False,
               max_num_batched_tokens=128, smallest_prefill_bucket=128, decode_batch_buckets=(8,))
# name -> PEFT LoraConfig fields: attention only, every projection with rsLoRA, and per-module ranks and alphas
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(r=16, lora_alpha=4, target_modules=["o_proj", "up_proj", "down_proj"],
                     rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 32}),
}


def save_peft_adapter(base: str, path: str, seed: int, model_class=None, **lora_config) -> str:
    """A PEFT LoRA adapter of `base` with random A and B (large enough to change greedy tokens), saved to `path`;
    `model_class`: transformers' class of `base` (default: AutoModelForCausalLM)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = (model_class or transformers.AutoModelForCausalLM).from_pretrained(base, dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    adapted.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, index + 1, save_peft_adapter(tiny_llama_dir, str(root / name), index, **config))
            for index, (name, config) in enumerate(ADAPTERS.items())}


PROMPTS = random_prompts(3, 512, 6, 40, seed=3)


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters) -> dict[str | None, list[list[int]]]:
    """Every prompt's greedy tokens under the base model and under each adapter, from PEFT."""
    refs = {None: peft_greedy(tiny_llama_dir, None, PROMPTS, GREEDY.max_tokens)}
    for name, request in adapters.items():
        refs[name] = peft_greedy(tiny_llama_dir, request.lora_path, PROMPTS, GREEDY.max_tokens)
        assert refs[name] != refs[None], f"adapter {name} changes nothing: the test would prove nothing"
    return refs


def mixed_batch(adapters) -> tuple[list[dict], list[LoRARequest | None], list[tuple[str | None, int]]]:
    """Every prompt under the base model and every adapter, interleaved in one batch."""
    names = [None, *adapters]
    cases = [(names[(i + j) % len(names)], i) for j in range(len(names)) for i in range(len(PROMPTS))]
    return ([{"prompt_token_ids": PROMPTS[i]} for _, i in cases], [adapters.get(n) if n else None for n, _ in cases],
            cases)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2, 4])
def test_mixed_adapters_in_one_batch_match_peft(tiny_llama_dir, adapters, references, tensor_parallel_size):
    """Three adapters and the base model in one batch, two device slots: identical to PEFT token for token."""
    llm = LLM(tiny_llama_dir, **OPTIONS, max_loras=2, tensor_parallel_size=tensor_parallel_size)
    prompts, loras, cases = mixed_batch(adapters)
    ours = token_ids(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert ours == [references[name][i] for name, i in cases]


def test_adapters_evicted_and_read_again_without_compiling(tiny_llama_dir, adapters, references, caplog):
    """One device slot and one host entry for three adapters: rows wait for the slot, adapters are written into it
    again and read from disk again, and none of it compiles after warm-up."""
    llm = LLM(tiny_llama_dir, **{**OPTIONS, "warmup": True}, max_loras=1, max_cpu_loras=1)
    engine = llm.llm_engine
    prompts, loras, cases = mixed_batch(adapters)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        ours = token_ids(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
        again = token_ids(llm.generate(prompts[:2], GREEDY, lora_request=loras[:2], use_tqdm=False))
        compiles = [r.getMessage() for r in caplog.records
                    if "Compiling" in r.getMessage() or "warm-up missed it" in r.getMessage()]
    assert ours == [references[name][i] for name, i in cases]
    assert again == ours[:2]
    assert compiles == []
    assert engine.scheduler.adapter_slots.num_loads >= len(adapters) + 1
    assert engine.adapters.num_reads > len(adapters)  # evicted from the host cache, read again
    assert engine.adapters.cached_ids() == [loras[1].lora_int_id]


def test_prefix_cache_does_not_cross_adapters(tiny_llama_dir, adapters, references):
    llm = LLM(tiny_llama_dir, **OPTIONS, max_loras=2)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    cached = (len(PROMPTS[2]) - 1) // 16 * 16  # its full pages, leaving one token to compute
    assert cached > 0

    def run(name):
        output = llm.generate(prompt, GREEDY, lora_request=adapters.get(name) if name else None)[0]
        return list(output.outputs[0].token_ids), output.num_cached_tokens
    assert run(None) == (references[None][2], 0)
    assert run("qv") == (references["qv"][2], 0)  # the base model's pages hold other K/V
    assert run("all") == (references["all"][2], 0)
    assert run("qv") == (references["qv"][2], cached)  # its own pages are found
    assert run(None) == (references[None][2], cached)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculative_decoding_with_adapters(tiny_llama_dir, adapters, references, method, tmp_path):
    """Drafts (n-gram, the base model's as a draft model, or an EAGLE-3 head's over the adapted model's hidden
    states; draft model and head run without adapters) are verified by the adapted model: the tokens stay the
    adapters'."""
    import transformers

    from tests.eagle3_heads import save_eagle3_head

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        spec = {"model": tiny_llama_dir, "num_speculative_tokens": 2}
    if method == "eagle3":
        head = save_eagle3_head(str(tmp_path / "head"), transformers.AutoConfig.from_pretrained(tiny_llama_dir),
                                draft_vocab_size=128, aux_layers=(0, 1, 1))
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    llm = LLM(tiny_llama_dir, **OPTIONS, max_loras=2, speculative_config={**spec, "disable_by_batch_size": None})
    prompts, loras, cases = mixed_batch(adapters)
    ours = token_ids(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert ours == [references[name][i] for name, i in cases]
    assert llm.llm_engine.stats().spec_decode_num_drafts > 0



def test_stats_name_running_and_waiting_adapters(tiny_llama_dir, adapters, references):
    """One slot, two adapters: the first adapter's sequences run while the other's wait, then the other runs; the
    snapshot (vLLM's lora_requests_info labels) says so at each step, and counts slot loads and disk reads."""
    from jaxserve.engine.llm_engine import LLMEngine

    # the default prefill buckets: the first step admits every prompt its slot allows
    engine = LLMEngine(model=tiny_llama_dir, **{**OPTIONS, "max_num_batched_tokens": 512, "smallest_prefill_bucket": None,
                                                "decode_batch_buckets": None}, max_loras=1)
    assert engine.stats().max_loras == 1 and engine.stats().lora_running_adapters == ()
    engine.add_request("qv-0", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=adapters["qv"])
    engine.add_request("all-0", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=adapters["all"])
    engine.add_request("qv-1", {"prompt_token_ids": PROMPTS[1]}, GREEDY, lora_request=adapters["qv"])
    engine.add_request("base", {"prompt_token_ids": PROMPTS[2]}, GREEDY)
    seen, tokens = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        seen.append((engine.stats().lora_running_adapters, engine.stats().lora_waiting_adapters))
    assert seen[0] == (("qv",), ("all",))
    assert (("all",), ()) in seen and seen[-1] == ((), ())
    assert seen.index((("all",), ())) > max(i for i, state in enumerate(seen) if state[0] == ("qv",))
    assert tokens == {"qv-0": references["qv"][0], "all-0": references["all"][0], "qv-1": references["qv"][1],
                      "base": references[None][2]}
    # the host cache holds one adapter (max_cpu_loras defaults to max_loras): qv-1's arrival read qv again
    assert (engine.stats().lora_slot_loads, engine.stats().lora_adapter_reads) == (2, 3)

def test_attention_adapter_on_a_mixture_of_experts_model(tiny_model_dirs, tmp_path):
    base = tiny_model_dirs["qwen3_moe"]
    path = save_peft_adapter(base, str(tmp_path / "moe"), 7, r=8, lora_alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    llm = LLM(base, **OPTIONS)
    prompts = PROMPTS[:2]
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                  lora_request=[LoRARequest("moe", 1, path), None], use_tqdm=False))
    assert ours == [peft_greedy(base, path, prompts[:1], 8)[0], peft_greedy(base, None, prompts[1:], 8)[0]]



def test_fused_phi3_adapter_matches_peft(tiny_model_dirs, tmp_path):
    """Phi-3's checkpoint fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and so do its adapters: each
    fused module is served as its projections, sharing A, with their rows of B."""
    base = tiny_model_dirs["phi3"]
    path = save_peft_adapter(base, str(tmp_path / "phi3"), 11, r=8, lora_alpha=16, rank_pattern={"gate_up_proj": 4},
                             target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    llm = LLM(base, **OPTIONS, max_loras=1)
    adapter = LoRARequest("phi3", 1, path)
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                  lora_request=[adapter, None, adapter], use_tqdm=False))
    assert ours == [peft_greedy(base, path, PROMPTS[:1], 8)[0], peft_greedy(base, None, PROMPTS[1:2], 8)[0],
                    peft_greedy(base, path, PROMPTS[2:], 8)[0]]
    assert ours[0] != peft_greedy(base, None, PROMPTS[:1], 8)[0], "the adapter changes nothing: the test proves nothing"
    phi3 = config_from_hf(tiny_hf_config("phi3"))
    separate = _write_adapter(tmp_path / "separate", CONFIG, _lora_pair(0, "self_attn", "q_proj", 4, 64, 64))
    with pytest.raises(ValueError, match=r"target_modules \['q_proj'\] are not supported \(supported: qkv_proj"):
        read_adapter("separate", separate, phi3, max_rank=16)


def test_adapters_on_awq_base_weights_match_peft_on_the_dequantized_model(tmp_path):
    """An AWQ int4 checkpoint with adapters: PEFT's tokens over the float model holding the dequantized weights."""
    from tests.test_awq import build_awq_pair

    _, awq_dir, reference_dir = build_awq_pair(tmp_path, "llama")
    path = save_peft_adapter(reference_dir, str(tmp_path / "adapter"), 5, r=8, lora_alpha=16,
                             target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    llm = LLM(awq_dir, **OPTIONS, max_loras=1)
    assert llm.llm_engine.engine_config.quantization == "awq"
    adapter = LoRARequest("awq", 1, path)
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                  lora_request=[adapter, None, adapter], use_tqdm=False))
    base = peft_greedy(reference_dir, None, PROMPTS, 8)
    assert ours == [peft_greedy(reference_dir, path, PROMPTS[:1], 8)[0], base[1],
                    peft_greedy(reference_dir, path, PROMPTS[2:], 8)[0]]
    assert ours[0] != base[0], "the adapter changes nothing: the test proves nothing"

def _write_adapter(path, config: dict, tensors: dict[str, np.ndarray]) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def _lora_pair(layer: int, group: str, target: str, rank: int, fan_in: int, fan_out: int) -> dict:
    prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
    return {f"{prefix}.lora_A.weight": np.ones((rank, fan_in), np.float32),
            f"{prefix}.lora_B.weight": np.ones((fan_out, rank), np.float32)}


LLAMA = config_from_hf(tiny_hf_config("llama"))
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


@pytest.mark.parametrize("case, config, tensors, message", [
    ("rank", {**CONFIG, "r": 32}, _lora_pair(0, "self_attn", "q_proj", 32, 64, 64), "r 32 exceeds max_lora_rank"),
    ("target", {**CONFIG, "target_modules": ["lm_head"]}, {}, r"target_modules \['lm_head'\] are not supported"),
    ("fused", {**CONFIG, "target_modules": ["qkv_proj"]}, {}, r"target_modules \['qkv_proj'\] are not supported"),
    ("tensor", CONFIG, {"base_model.model.lm_head.lora_A.weight": np.ones((4, 64), np.float32)},
     "is not a LoRA weight of a decoder projection"),
    ("shape", CONFIG, _lora_pair(0, "self_attn", "q_proj", 4, 32, 32), "an adapter of another base model"),
    ("layer", CONFIG, _lora_pair(5, "self_attn", "q_proj", 4, 64, 64), "the base model has 2 layers"),
    ("half", CONFIG, dict(list(_lora_pair(0, "self_attn", "q_proj", 4, 64, 64).items())[:1]), "without its other"),
    ("dora", {**CONFIG, "use_dora": True}, {}, "use_dora is not supported"),
    ("bias", {**CONFIG, "bias": "all"}, {}, "bias must be 'none'"),
    ("saved", {**CONFIG, "modules_to_save": ["lm_head"]}, {}, "modules_to_save is not supported"),
    ("json", None, {}, "is not valid JSON"),
])
def test_bad_adapters_are_refused_naming_the_field(tmp_path, case, config, tensors, message):
    path = _write_adapter(tmp_path / case, config or {}, tensors or _lora_pair(0, "self_attn", "q_proj", 4, 64, 64))
    if config is None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write("{not json")
    with pytest.raises(ValueError, match=message) as error:
        read_adapter(case, path, LLAMA, max_rank=16)
    assert repr(case) in str(error.value)  # the adapter is named



def test_half_precision_adapters_are_read_as_saved_and_reading_compiles_nothing(tmp_path):
    """bfloat16 and float16 adapter files read to the same float32 values; reading one is numpy only (a first
    version parsed the file with safetensors.flax, whose arrays compiled a jax function per new tensor shape on
    the request that read the adapter). Run in a fresh process, so no earlier test has compiled anything."""
    import subprocess
    import sys

    import ml_dtypes

    pair = _lora_pair(0, "self_attn", "q_proj", 4, 64, 64)
    values = {key: np.random.default_rng(0).standard_normal(t.shape).astype(np.float32) for key, t in pair.items()}
    for name, dtype in (("f32", np.float32), ("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
        _write_adapter(tmp_path / name, CONFIG, {key: value.astype(dtype) for key, value in values.items()})
    script = f"""
import logging, jax, numpy as np
from jaxserve.lora.peft_format import read_adapter
from jaxserve.models import config_from_hf
from tests.conftest import tiny_hf_config
config = config_from_hf(tiny_hf_config("llama"))
compiled = []
logging.getLogger("jax").addHandler(logging.Handler())
logging.getLogger("jax").handlers[-1].emit = lambda record: compiled.append(record.getMessage())
with jax.log_compiles(True):
    read = {{name: read_adapter(name, "{tmp_path}/" + name, config, 16) for name in ("f32", "bf16", "f16")}}
assert not [m for m in compiled if "Compiling" in m], compiled
a32, b32 = read["f32"].modules[(0, "q_proj")]
for name, dtype in (("bf16", "bfloat16"), ("f16", "float16")):
    a, b = read[name].modules[(0, "q_proj")]
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, a32.astype(dtype).astype(np.float32), rtol=0, atol=0)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]

def test_moe_layer_mlp_adapter_refused(tmp_path):
    moe = config_from_hf(tiny_hf_config("qwen3_moe"))
    path = _write_adapter(tmp_path / "moe", {**CONFIG, "target_modules": ["gate_proj"]},
                          _lora_pair(0, "mlp", "gate_proj", 4, 64, 128))
    with pytest.raises(ValueError, match="mixture-of-experts layer's MLP"):
        read_adapter("moe", path, moe, max_rank=16)


def test_lora_requests_refused_by_the_engine_which_keeps_serving(tiny_llama_dir, adapters, references, tmp_path):
    llm = LLM(tiny_llama_dir, **{**OPTIONS, "max_lora_rank": 4}, max_loras=1)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    with pytest.raises(ValueError, match="r 8 exceeds max_lora_rank"):
        llm.generate(prompt, GREEDY, lora_request=adapters["qv"])
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path / "nowhere")))
    assert token_ids(llm.generate(prompt, GREEDY, lora_request=adapters["all"])) == [references["all"][0]]
    with pytest.raises(ValueError, match="lora_int_id 2 is already adapter 'all'"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("other", 2, adapters["qv"].lora_path))
    with pytest.raises(ValueError, match="got 2 lora_requests for 1 prompts"):
        llm.generate(prompt, GREEDY, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, adapters["qv"].lora_path)
    assert token_ids(llm.generate(prompt, GREEDY)) == [references[None][0]]
    base_only = LLM(tiny_llama_dir, max_num_seqs=2, max_model_len=128, num_kv_pages=32, warmup=False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        base_only.generate(prompt, GREEDY, lora_request=adapters["qv"])


def test_server_serves_adapters_by_model_name(tiny_llama_dir, adapters, references, monkeypatch, tmp_path):
    """`--lora-modules` names in /v1/models with their parent; `model` chooses the adapter; unknown names 404; a
    bad adapter is a 400 and the server goes on; adapters load and unload at run time when allowed."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.config import EngineConfig
    from jaxserve.server.lora_modules import RUNTIME_UPDATING_ENV
    from tests.test_server_app import run_in_process

    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "true")
    bad = _write_adapter(tmp_path / "bad", {**CONFIG, "r": 64}, _lora_pair(0, "self_attn", "q_proj", 64, 64, 64))

    def completion(model: str, prompt_index: int) -> dict:
        return {"model": model, "prompt": PROMPTS[prompt_index], "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}

    async def check(http, _) -> None:
        models = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("qv", "base"), ("all", "base")]
        for model, name in (("qv", "qv"), ("base", None), ("all", "all")):
            answer = (await http.post("/v1/completions", json=completion(model, 1))).json()
            assert answer["choices"][0]["token_ids"] == references[name][1], model
        missing = await http.post("/v1/completions", json=completion("patterns", 0))
        assert missing.status_code == 404 and "`patterns` does not exist" in missing.json()["error"]["message"]
        refused = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": bad})
        assert refused.status_code == 400 and "exceeds max_lora_rank" in refused.json()["error"]["message"]
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "patterns",
                                                                "lora_path": adapters["patterns"].lora_path})
        assert loaded.status_code == 200, loaded.text
        answer = (await http.post("/v1/completions", json=completion("patterns", 0))).json()
        assert answer["choices"][0]["token_ids"] == references["patterns"][0]
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "patterns"})).status_code == 200
        assert (await http.post("/v1/completions", json=completion("patterns", 0))).status_code == 404
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "patterns"})).status_code == 404
        metrics = (await http.get("/metrics")).text
        assert ('jaxserve:lora_requests_info{max_lora="2",model_name="base",running_lora_adapters="",'
                'waiting_lora_adapters=""}') in metrics
        assert 'jaxserve:lora_adapter_reads_total{model_name="base"} 3.0' in metrics

    modules = [("qv", adapters["qv"].lora_path, None), ("all", adapters["all"].lora_path, None)]
    run_in_process(lambda: LLMEngine(EngineConfig(model=tiny_llama_dir, **OPTIONS, max_loras=2)), check,
                   served_model_names=["base"], lora_modules=modules)


def test_lora_flags():
    from jaxserve.server.cli_args import build_parser, engine_config, server_settings

    args = build_parser().parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras",
                                      "8", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b", '
                                      '"base_model_name": "m"}'])
    config = engine_config(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 4, 64, 8)
    assert server_settings(args).lora_modules == [("a", "/x/a", None), ("b", "/x/b", "m")]
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        server_settings(build_parser().parse_args(["--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="must be name=path"):
        server_settings(build_parser().parse_args(["--enable-lora", "--lora-modules", "a"]))
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        engine_config(build_parser().parse_args(["--max-loras", "4", "--max-cpu-loras", "2"]))


def test_adapters_on_int8_base_weights_match_peft_on_the_dequantized_model(tiny_llama_dir, adapters, tmp_path):
    """quantization="int8" with adapters: the adapters' contribution is added to the int8 matmuls, so the tokens
    are PEFT's over the base model whose weights are the int8 round trip (per output channel, as `quant_dense`)."""
    import torch
    import transformers

    from tests.conftest import save_tiny_tokenizer
    from tests.test_quantization import numpy_int8

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):  # [out, in] / [vocab, hidden]: per row
                q, scale = numpy_int8(module.weight.numpy(), axis=1)
                module.weight.copy_(torch.from_numpy(q.astype(np.float32) * scale[:, None]))
    dequantized = str(tmp_path / "dequantized")
    model.save_pretrained(dequantized, safe_serialization=True)
    save_tiny_tokenizer(dequantized, model.config.vocab_size)
    llm = LLM(tiny_llama_dir, **OPTIONS, max_loras=2, quantization="int8")
    names = ["qv", "all", None]
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                  lora_request=[adapters[n] if n else None for n in names], use_tqdm=False))
    assert ours == [peft_greedy(dequantized, adapters[n].lora_path if n else None, [p], GREEDY.max_tokens)[0]
                    for n, p in zip(names, PROMPTS)]


def test_preempted_adapter_rows_recompute_with_their_adapter(tiny_llama_dir, adapters, references):
    """A pool too small for the batch: rows are preempted (releasing their adapter's slot pin) and re-admitted,
    possibly into another slot, and still give PEFT's tokens."""
    llm = LLM(tiny_llama_dir, **{**OPTIONS, "num_kv_pages": 10}, max_loras=2)
    prompts, loras, cases = mixed_batch(adapters)
    ours = token_ids(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert ours == [references[name][i] for name, i in cases]

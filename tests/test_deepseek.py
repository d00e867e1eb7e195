"""The DeepSeek-V3 line against transformers: Multi-head Latent Attention over the latent cache (with and without
query compression, YaRN with DeepSeek's mscale), DeepSeek's routing, and the engine's features on it."""

from __future__ import annotations

import jax
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.aot.compile import compile_engine
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_plan import MLASpec
from tests.conftest import TINY_DIMS, random_prompts, save_tiny_model
from tests.test_compile_targets import SMALL, assert_compiles_and_fits, compilers_present
from tests.test_model import assert_matches_transformers

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}


def tiny_deepseek_config(**overrides) -> transformers.DeepseekV3Config:
    """Three layers (the first dense), 8 experts in 4 groups, head sizes that all differ."""
    dims = {**TINY_DIMS, "num_hidden_layers": 3, "num_key_value_heads": 4}
    return transformers.DeepseekV3Config(**{**dims, **dict(
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, rope_parameters=YARN, tie_word_embeddings=False,
        num_mtp_layers=0), **overrides})


def save_deepseek(path: str, **overrides) -> str:
    """A random-weight model (the score-correction bias random too: transformers starts it at zero)."""
    config = tiny_deepseek_config(**overrides)
    save_tiny_model("deepseek_v3", path, config=config)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    return save_deepseek(str(tmp_path_factory.mktemp("deepseek_v3")))


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "rope_interleave": False}],
                         ids=["query-compression", "one-query-projection"])
def test_logits_and_greedy_match_transformers(tmp_path, deepseek_dir, overrides):
    path = save_deepseek(str(tmp_path / "model"), **overrides) if overrides else deepseek_dir
    assert_matches_transformers(path, f"deepseek_v3 {overrides}")


def test_engine_greedy_equals_transformers_over_the_latent_cache(deepseek_dir):
    """Chunked prefill, prefix caching and preemption over pages of latent rows, batched."""
    shared = random_prompts(1, 500, 24, 24, seed=11)[0]
    prompts = random_prompts(4, 500, 20, 60, seed=12) + [shared + tail for tail in random_prompts(2, 500, 2, 9, 13)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(deepseek_dir, max_num_seqs=6, max_model_len=128, page_size=8, num_kv_pages=28,
              max_num_batched_tokens=32, smallest_prefill_bucket=32, decode_batch_buckets=(6,), warmup=False)
    ours = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    engine = llm.llm_engine
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    (group,) = engine.runner.kv_plan.groups
    assert group.spec == MLASpec(32 + 8)
    assert group.page_bytes == 3 * 8 * (32 + 8) * 4  # one latent row per token and layer, float32, no V
    hf = transformers.AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref, len(prompt)


def test_decompressed_attention_matches_transformers(deepseek_dir, monkeypatch):
    """Steps of two or more query tokens a row decompress the latent rows into every head's keys and values (what a
    long prefill does, `mla.decompressed_attention`): logits and greedy tokens equal transformers', and through the
    engine with chunked prefill over cached pages."""
    from jaxserve.layers import mla

    monkeypatch.setattr(mla, "DECOMPRESS_MIN_TOKENS", {"cpu": 2})
    assert_matches_transformers(deepseek_dir, "decompressed")
    prompts = random_prompts(2, 500, 20, 40, seed=21)
    llm = LLM(deepseek_dir, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=16, decode_batch_buckets=(2,),
              warmup=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


def test_tensor_and_expert_parallel_on_four_devices_match_one_device(deepseek_dir):
    """The heads split (q_b_proj and kv_b_proj on their output features, o_proj on its input), the latent and its
    cache whole on every device, the experts whole per device, with int8 weights (float weights split so in
    `test_the_pallas_backends_attend_over_the_latent_pool_with_their_kernels` and the KV tiers test)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 500, 10, 40, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(**options):
        llm = LLM(deepseek_dir, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, smallest_prefill_bucket=64,
                  decode_batch_buckets=(4,), warmup=False, quantization="int8", **options)
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, llm.llm_engine.runner.params["layers_1"]["attn"]

    reference, _ = run()
    tokens, attn = run(tensor_parallel_size=4, enable_expert_parallel=True)
    assert tokens == reference
    assert {shard.data.shape for shard in attn["kv_b_proj"]["kernel"].addressable_shards} == {(32, 4 * 40 // 4)}
    assert {shard.data.shape for shard in attn["o_proj"]["kernel"].addressable_shards} == {(4 * 24 // 4, 64)}


@pytest.mark.parametrize("backend", ["pallas-interpret", "pallas-tpu-interpret"])
def test_the_pallas_backends_attend_over_the_latent_pool_with_their_kernels(tmp_path, monkeypatch, backend):
    """A latent of 128 and a rope key of 16 (the kernels' tiles: powers of two, whole TPU lanes), the heads split
    over two devices: the Triton backend's decode steps run the MLA decode kernel, the TPU backend's steps the
    ragged kernel over the latent pool (both interpreted here), and the greedy tokens equal transformers'."""
    import pallas_kernels
    from jaxserve.layers import attention_tpu

    path = save_deepseek(str(tmp_path / "model"), kv_lora_rank=128, qk_rope_head_dim=16, num_hidden_layers=2)
    owner, name = ((pallas_kernels, "mla_paged_attention") if backend == "pallas-interpret"
                   else (attention_tpu, "ragged_paged_attention"))
    kernel, calls = getattr(owner, name), []
    monkeypatch.setattr(owner, name, lambda *args, **kw: calls.append(kw.get("value_dim", 128)) or kernel(*args, **kw))
    prompts = random_prompts(2, 500, 5, 20, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(path, attention_backend=backend, tensor_parallel_size=2, max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=32, smallest_prefill_bucket=32, decode_batch_buckets=(2,), warmup=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == expected
    assert calls and set(calls) == {128}, calls  # the latent pool's kernel, not the per-head one


def test_host_and_disk_tiers_keep_latent_pages_on_two_devices(deepseek_dir, tmp_path):
    """The KV tiers store and restore pages of latent rows (one leaf per layer, whole on every device): the second
    round restores pages the pool had evicted, and both equal transformers' greedy tokens."""
    from tests.test_kv_tiers import OPTIONS

    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 60, 80, seed=29)]  # 12 pages: the pool's
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    hf = transformers.AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p["prompt_token_ids"]]), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, -6:].tolist() for p in prompts]
    llm = LLM(deepseek_dir, **OPTIONS, tensor_parallel_size=2, kv_offloading_size=0.05,
              kv_offloading_dir=str(tmp_path), warmup=False)
    for _ in range(2):  # the second round finds the prompts in the tiers
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.llm_engine.runner.transfers.pages_restored > 0


@pytest.mark.parametrize("options, named", [(dict(kv_cache_dtype="int8"), "kv_cache_dtype")])
def test_what_the_latent_cache_cannot_take_yet_is_refused_by_name(deepseek_dir, options, named):
    with pytest.raises(ValueError, match=named):
        LLM(deepseek_dir, warmup=False, **options)


@pytest.mark.skipif(not compilers_present(), reason="the target compilers (the [aot] extra) are not installed")
@pytest.mark.parametrize("target, devices", [("v6e-1", 1), ("h200", 1), ("h200x8", 8)])
def test_the_latent_attention_steps_compile_for_the_targets(tmp_path, target, devices):
    """DeepSeek-V3's attention shapes (64 heads, a 512 + 64 latent row, 128 + 64 query dims, bfloat16) on a TPU and
    a GPU, around a small model: the engine's activation reserve holds the latent queries the compiler plans. On
    eight GPUs (8 heads and the decode kernel per device) XLA failed to compile the latent row's concatenation."""
    config = tiny_deepseek_config(hidden_size=256, intermediate_size=256, num_attention_heads=64, kv_lora_rank=512,
                                  q_lora_rank=192, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  num_hidden_layers=2)  # one dense layer, one of experts
    config.save_pretrained(tmp_path)
    options = {**SMALL, "max_num_batched_tokens": 512, "smallest_prefill_bucket": 512}  # one long chunk
    result = compile_engine(EngineConfig(model=str(tmp_path), tensor_parallel_size=devices, **options), target,
                            {"prefill", "decode"})
    assert_compiles_and_fits(result)
    (group,) = result.plan.kv_plan.groups
    stored = 640 if target == "v6e-1" else 576  # a TPU's pool rows padded to 128 lanes
    page = 2 * result.plan.engine_config.page_size * stored * 2
    assert group.spec == MLASpec(576) and group.page_bytes == devices * page  # a whole copy on every device


def save_fp8(source: str, fp8_dir: str, reference_dir: str, block: tuple[int, int] = (16, 16)) -> None:
    """DeepSeek-V3's fine-grained FP8 layout made from `source`: every linear weight in e4m3 with a float32
    `weight_scale_inv` per `block` (blocks at the edges partial), into `fp8_dir`; the same weights dequantized, in
    float32, into `reference_dir` (what the FP8 checkpoint means)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(f"{source}/model.safetensors")
    fp8, reference = {}, {}
    for name, tensor in state.items():
        if tensor.dim() != 2 or not name.endswith("proj.weight"):
            fp8[name] = reference[name] = tensor
            continue
        rows, cols = (-(-size // b) for size, b in zip(tensor.shape, block))
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:tensor.shape[0], :tensor.shape[1]] = tensor
        blocks = padded.reshape(rows, block[0], cols, block[1])
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:tensor.shape[0],
                                                                                       :tensor.shape[1]]
        fp8[name] = (tensor / expanded).to(torch.float8_e4m3fn)
        fp8[f"{name}_scale_inv"] = scale
        reference[name] = fp8[name].float() * expanded
    for directory, tensors in ((fp8_dir, fp8), (reference_dir, reference)):
        shutil.copytree(source, directory)
        save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    with open(f"{fp8_dir}/config.json") as handle:
        config = json.load(handle)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(f"{fp8_dir}/config.json", "w") as handle:
        json.dump(config, handle)


def test_a_block_scaled_fp8_checkpoint_serves_its_linears_in_fp8(tmp_path, deepseek_dir):
    """Each linear whose blocks tile it loads as FP8 with its block scales (their product is the dequantized
    weight, exactly); the rest (kv_a_proj_with_mqa's 40 columns, kv_b_proj read as a matrix, the router) load
    dequantized. Under -tp 4 with expert parallelism the experts stay FP8 and the split q_b_proj/o_proj (24
    columns or rows a device) dequantized; the greedy tokens equal transformers' on the dequantized weights."""
    import numpy as np

    from jaxserve.layers.fp8 import FP8, dequantize
    from jaxserve.loading import load_model

    fp8_dir, reference_dir = str(tmp_path / "fp8"), str(tmp_path / "reference")
    save_fp8(deepseek_dir, fp8_dir, reference_dir)
    ours, theirs = load_model(fp8_dir).params, load_model(reference_dir).params
    kept = set()

    def compare(mine: dict, reference: dict, path: str) -> None:
        if "block_scale" in mine:
            kept.add(path.rsplit("/", 1)[-1])
            np.testing.assert_array_equal(np.asarray(dequantize(mine["kernel"], mine["block_scale"], np.float32)),
                                          np.asarray(reference["kernel"]), err_msg=path)
            return
        for name, value in mine.items():
            if isinstance(value, dict):
                compare(value, reference[name], f"{path}/{name}")
            else:
                np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[name]), err_msg=path)

    compare(ours, theirs, "")
    assert kept == {"q_a_proj", "q_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # experts' too
    assert ours["layers_1"]["attn"]["kv_b_proj"]["kernel"].dtype == np.float32

    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 10, 30, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(fp8_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, smallest_prefill_bucket=64,
              decode_batch_buckets=(4,), tensor_parallel_size=4, enable_expert_parallel=True, warmup=False)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    served = llm.llm_engine.runner.params["layers_1"]
    assert served["mlp"]["experts"]["gate_up_proj"]["kernel"].dtype == FP8
    assert served["attn"]["q_b_proj"]["kernel"].dtype == np.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    for prompt, mine in zip(prompts, tokens):
        with torch.no_grad():
            ids = prompt["prompt_token_ids"]
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert mine == ref


def test_fp8_scales_that_do_not_fit_their_weight_are_refused_by_name(tmp_path, deepseek_dir):
    from jaxserve.loading import load_model

    fp8_dir = str(tmp_path / "fp8")
    save_fp8(deepseek_dir, fp8_dir, str(tmp_path / "reference"), block=(16, 16))
    import json

    with open(f"{fp8_dir}/config.json") as handle:
        config = json.load(handle)
    config["quantization_config"]["weight_block_size"] = [32, 16]
    with open(f"{fp8_dir}/config.json", "w") as handle:
        json.dump(config, handle)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape .* in blocks of \[32, 16\]"):
        load_model(fp8_dir)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_matches_transformers(tmp_path, topk_method):
    """DeepSeek-V2(-Lite)'s shape: one query projection, softmax routing never renormalized, groups by their best
    expert, rope on complex pairs."""
    config = transformers.DeepseekV2Config(
        **{**TINY_DIMS, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, topk_method=topk_method,
        n_shared_experts=2, routed_scaling_factor=1.7, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, tie_word_embeddings=False)
    assert_matches_transformers(save_tiny_model("deepseek_v2", str(tmp_path / "v2"), config=config), topk_method)


@pytest.mark.parametrize("field, value, named", [("scoring_func", "softmax", "scoring_func"),
                                                 ("topk_method", "greedy", "topk_method"),
                                                 ("n_group", 3, "n_group"), ("topk_group", 5, "topk_group"),
                                                 ("moe_layer_freq", 2, "moe_layer_freq")])
def test_routing_this_code_cannot_compute_is_refused_by_name_before_any_read(field, value, named):
    from jaxserve.models import config_from_hf

    config = tiny_deepseek_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=named):
        config_from_hf(config)

"""Mixture of experts: the grouped matmul against a float64 reference, its tile schedule, the routers against
transformers', work that grows with top-k, not with the expert count, and the MoE families without latent attention
that route as DeepSeek does (GLM-4.5, MiniMax-M2) against transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.config import LayerSpec, ModelConfig, MoEConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.moe import MoE, grouped_matmul, route, tile_rows, tile_schedule
from jaxserve.layers.quant_dense import quantize_params
from tests.conftest import TINY_DIMS, random_prompts, save_tiny_model, shard_shapes
from tests.test_model import assert_matches_transformers


def random_groups(rng, num_rows: int, num_groups: int, empty: float = 0.3) -> np.ndarray:
    """Group sizes summing to at most `num_rows`, some groups empty."""
    weights = rng.random(num_groups) * (rng.random(num_groups) > empty)
    weights = weights if weights.sum() else np.ones(num_groups)
    sizes = np.floor(weights / weights.sum() * num_rows * rng.uniform(0.7, 1.0)).astype(np.int32)
    return sizes


@pytest.mark.parametrize("num_rows, num_groups", [(1, 1), (7, 4), (64, 16), (300, 8), (40, 64)])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_grouped_matmul_matches_a_float64_reference(num_rows, num_groups, dtype):
    """Each row times its group's kernel; rows past the groups' sum are 0 (fresh random inputs each case)."""
    rng = np.random.default_rng(num_rows * 100 + num_groups)
    sizes = random_groups(rng, num_rows, num_groups)
    x = rng.standard_normal((num_rows, 48)).astype(np.float32)
    if dtype == "int8":
        w = rng.integers(-127, 128, size=(num_groups, 48, 24)).astype(np.int8)
    else:
        w = rng.standard_normal((num_groups, 48, 24)).astype(np.float32)
    group_of_row = np.repeat(np.arange(num_groups), sizes)
    expected = np.zeros((num_rows, 24))
    expected[:len(group_of_row)] = np.einsum("ri,rio->ro", x[:len(group_of_row)].astype(np.float64),
                                             w[group_of_row].astype(np.float64))
    ours = jax.jit(grouped_matmul)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-4)


def test_the_tile_schedule_covers_every_row_once_and_counts_rows_not_experts():
    rng = np.random.default_rng(0)
    for num_rows, num_groups in [(16, 8), (16, 128), (512, 128), (4096, 128), (100, 3)]:
        sizes = random_groups(rng, num_rows, num_groups, empty=0.8)
        rows = tile_rows(num_rows, num_groups)
        count, group, block = (np.asarray(a) for a in tile_schedule(jnp.asarray(sizes), num_rows, rows))
        ends = np.cumsum(sizes)
        covered = np.zeros(num_rows, int)
        for g, b in zip(group[:count], block[:count]):
            row = np.arange(b * rows, (b + 1) * rows)
            covered[row[(row >= ends[g] - sizes[g]) & (row < ends[g])]] += 1
        assert (covered[:ends[-1]] == 1).all() and (covered[ends[-1]:] == 0).all()
        assert count <= -(-num_rows // rows) + np.count_nonzero(sizes) - 1


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_routing_is_transformers(family):
    """Top-k experts and weights equal to transformers' routers (Qwen: renormalized or not; Mixtral: always)."""
    torch.manual_seed(0)
    for normalize in ((False, True) if family == "qwen2_moe" else (True,)):
        if family == "qwen2_moe":
            config = transformers.Qwen2MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                                 norm_topk_prob=normalize)
            router = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter(config)
        else:
            config = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
            router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
        with torch.no_grad():
            router.weight.normal_()
            hidden = torch.randn(50, 32)
            logits, their_weights, their_experts = router(hidden)
        moe = MoEConfig(num_experts=logits.shape[-1], top_k=config.num_experts_per_tok, intermediate_size=1,
                        normalize_top_k=normalize)
        weights, experts = route(jnp.asarray(logits.numpy()), moe)
        np.testing.assert_array_equal(np.asarray(experts), their_experts.numpy())
        np.testing.assert_allclose(np.asarray(weights), their_weights.numpy(), rtol=1e-6)


@pytest.mark.parametrize("normalize", [True, False])
def test_deepseek_routing_is_transformers(normalize):
    """DeepSeek-V3's router: sigmoid scores, a correction bias for choosing, the best 2 of 4 groups (each scored by
    its two best experts), the routed scaling; transformers returns the experts unsorted, so both are sorted."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=normalize)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0.0, 0.5)
        logits, their_weights, their_experts = router(torch.randn(50, 32))
    moe = MoEConfig(num_experts=16, top_k=4, intermediate_size=1, normalize_top_k=normalize, scoring="sigmoid",
                    score_correction_bias=True, num_groups=4, top_k_groups=2, routed_scaling=2.5)
    weights, experts = route(jnp.asarray(logits.numpy()), moe, jnp.asarray(router.e_score_correction_bias.numpy()))
    order, their_order = np.argsort(np.asarray(experts)), their_experts.numpy().argsort()
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(their_experts.numpy(), their_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(their_weights.numpy(), their_order, 1), rtol=1e-6)


def moe_config(num_experts: int, top_k: int = 2) -> ModelConfig:
    return ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_q_heads=4, num_kv_heads=4, head_dim=16, layers=(LayerSpec(feed_forward="moe"),),
                       moe=MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=96,
                                     normalize_top_k=True))


def moe_flops(num_experts: int, top_k: int, num_tokens: int = 16) -> tuple[float, float]:
    """XLA's FLOPs of the compiled MoE block (the expert tile loop's body counted once) and the router's."""
    cfg = moe_config(num_experts, top_k)
    block = MoE(cfg, TensorParallel(), jnp.float32)
    x = jnp.ones((num_tokens, cfg.hidden_size))
    params = block.init(jax.random.key(0), x)
    compiled = jax.jit(block.apply).lower(params, x).compile()
    return compiled.cost_analysis()["flops"], 2 * num_tokens * cfg.hidden_size * num_experts


def test_expert_work_grows_with_top_k_not_with_the_expert_count():
    """The compiled block's FLOPs beyond the router's matmul are within 10% for 8 and 128 experts (the rest of
    the routing is O(tokens x experts) elementwise work; jax's CPU ragged_dot, a dense dot of every row with every
    expert, has 16x more), and its tiles are about one per routed row block, not one per expert
    (`test_the_tile_schedule_...`)."""
    (few, few_router), (many, many_router) = moe_flops(8, 2), moe_flops(128, 2)
    assert (many - many_router) / (few - few_router) < 1.1
    dense_ragged_dot = jax.jit(jax.lax.ragged_dot).lower(
        jnp.ones((32, 64)), jnp.ones((128, 64, 192)), jnp.ones((128,), jnp.int32)).compile()
    assert dense_ragged_dot.cost_analysis()["flops"] > 20 * (many - many_router)


def test_int8_experts_are_quantized_per_expert_and_channel_and_the_router_stays_float():
    cfg = moe_config(8)
    block = MoE(cfg, TensorParallel(), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (12, cfg.hidden_size))
    params = block.init(jax.random.key(0), x)
    quantized = quantize_params(params)
    experts = quantized["params"]["experts"]
    assert experts["gate_up_proj"]["kernel"].dtype == jnp.int8
    assert experts["gate_up_proj"]["scale"].shape == (8, 2 * 96)
    assert experts["down_proj"]["scale"].shape == (8, cfg.hidden_size)
    assert quantized["params"]["router"]["kernel"].dtype == jnp.float32
    ref, ours = block.apply(params, x), block.apply(quantized, x)
    assert float(jnp.abs(ours - ref).max() / jnp.abs(ref).max()) < 0.02


def test_expert_parallel_and_tensor_parallel_on_four_devices_match_one_device(tiny_model_dirs):
    """On 4 devices, experts split inside each expert (the default) or by expert, greedy tokens identical to one
    device's: Qwen2-MoE (a shared expert, a dense layer; each device 2 of the 8 experts under EP), and gpt-oss with
    int8 experts (biases on every expert linear and the router, the down bias added once over the devices'
    partial sums; sinks split with the heads; scales split like their kernels)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 500, 5, 40, seed=14)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=64, warmup=False,
                   smallest_prefill_bucket=64, decode_batch_buckets=(4,))  # one prefill and one decode shape

    def run(family, **extra):
        llm = LLM(tiny_model_dirs[family], **options, **extra)
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, llm.llm_engine.runner.params["layers_0"]

    reference, _ = run("qwen2_moe")
    tokens, layer = run("qwen2_moe", tensor_parallel_size=4)
    assert tokens == reference
    assert shard_shapes(layer["mlp"]["experts"]["gate_up_proj"]["kernel"]) == {(8, 64, 2 * 32 // 4)}
    assert shard_shapes(layer["mlp"]["experts"]["down_proj"]["kernel"]) == {(8, 32 // 4, 64)}
    tokens, layer = run("qwen2_moe", tensor_parallel_size=4, enable_expert_parallel=True)
    assert tokens == reference
    assert shard_shapes(layer["mlp"]["experts"]["gate_up_proj"]["kernel"]) == {(2, 64, 2 * 32)}
    assert shard_shapes(layer["mlp"]["experts"]["down_proj"]["kernel"]) == {(2, 32, 64)}

    int8_reference, _ = run("gpt_oss", quantization="int8")
    tokens, layer = run("gpt_oss", tensor_parallel_size=4, quantization="int8")
    assert tokens == int8_reference
    assert shard_shapes(layer["mlp"]["experts"]["gate_up_proj"]["bias"]) == {(4, 2 * 32 // 4)}
    assert shard_shapes(layer["attn"]["sinks"]) == {(1,)}
    tokens, layer = run("gpt_oss", tensor_parallel_size=4, enable_expert_parallel=True, quantization="int8")
    assert tokens == int8_reference
    experts = layer["mlp"]["experts"]
    assert experts["down_proj"]["kernel"].dtype == jnp.int8
    assert shard_shapes(experts["gate_up_proj"]["scale"]) == {(1, 2 * 32)}
    assert shard_shapes(experts["gate_up_proj"]["bias"]) == {(1, 2 * 32)}
    assert shard_shapes(experts["down_proj"]["scale"]) == {(1, 64)}


def test_a_split_the_experts_cannot_take_is_a_value_error_before_loading(tiny_llama_dir):
    with pytest.raises(ValueError, match="must divide num_experts \\(6\\)"):
        TensorParallel(4, expert_parallel=True).check(moe_config(6))
    TensorParallel(4).check(moe_config(6))  # split inside each expert: 96 columns over 4 devices
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model"):
        LLM(tiny_llama_dir, tensor_parallel_size=2, enable_expert_parallel=True)


def save_glm4_moe(path: str) -> str:
    """A tiny GLM-4.5: half of each head rotated, q/k/v biases, q/k norms, DeepSeek's routing with one group of two
    chosen, the first layer dense."""
    config = transformers.Glm4MoeConfig(**{**TINY_DIMS, "num_hidden_layers": 3}, head_dim=32, moe_intermediate_size=32,
                                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                        n_shared_experts=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
                                        use_qk_norm=True, attention_bias=True, tie_word_embeddings=False)
    return save_tiny_model("glm4_moe", path, config=config)


def test_glm4_moe_matches_transformers(tmp_path):
    """GLM-4.5's decoder (`save_glm4_moe`), its biases randomized."""
    path = save_glm4_moe(str(tmp_path / "glm"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # transformers starts the biases and the correction bias at zero
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "e_score_correction_bias")):
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    assert_matches_transformers(path, "glm4_moe")


def test_minimax_m2_matches_transformers_on_one_and_two_devices(tmp_path):
    """MiniMax-M2's decoder: q and k norms over all heads at once (summed over the devices under a split), half
    of each head rotated, sigmoid routing with the correction bias and no groups."""
    config = transformers.MiniMaxM2Config(**{**TINY_DIMS, "intermediate_size": 32}, head_dim=32,
                                          num_local_experts=8, num_experts_per_tok=2, rotary_dim=16,
                                          tie_word_embeddings=False)
    path = save_tiny_model("minimax_m2", str(tmp_path / "minimax"), config=config)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    assert_matches_transformers(path, "minimax_m2")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 10, 30, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    two = [out.outputs[0].token_ids for out in LLM(path, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                                   smallest_prefill_bucket=64, decode_batch_buckets=(4,), warmup=False,
                                                   tensor_parallel_size=2).generate(prompts, params, use_tqdm=False)]
    with torch.no_grad():
        assert two == [model.generate(torch.tensor([p["prompt_token_ids"]]), max_new_tokens=8, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, -8:].tolist() for p in prompts]
    with pytest.raises(ValueError, match="k norm spans every KV head"):
        LLM(path, tensor_parallel_size=4, warmup=False)

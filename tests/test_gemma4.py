"""Gemma 4 against transformers: global layers with their own head size, KV heads and proportional rope beside
sliding ones (two shapes of pool), per-layer inputs, layers reading an earlier layer's KV (no pages of their own),
values from keys, the experts beside the MLP; served through the engine with chunked prefill, prefix caching,
preemption and tensor parallelism; greedy tokens equal transformers' own loop in float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.engine.kv_plan import FullAttentionSpec, SlidingWindowSpec
from tests.conftest import engine_greedy, hf_greedy, random_prompts, save_randomized_model, save_tiny_tokenizer

# global layers: 32-wide heads (sliding: 16) under a proportional rope over a quarter of each head
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, max_position_embeddings=512, sliding_window=16, rms_norm_eps=1e-5,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=512)
LAYOUTS = {
    # 5 sliding : 1 global, per-layer inputs
    "default": dict(num_hidden_layers=6),
    # layers 4 and 5 read layers 2 and 3's KV, with doubled MLPs; final logits capped
    "shared": dict(num_hidden_layers=6, num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "full_attention"] * 3),
    # experts beside each MLP; the global layers' one KV head gives both keys and values; no per-layer inputs
    "moe": dict(num_hidden_layers=4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                layer_types=["sliding_attention", "full_attention"] * 2),
}
MAX_TOKENS = 10


def randomize_vectors(model) -> None:
    """transformers starts norms, router scales and layer scalars at one: random, so each enters the outputs."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {layout: save_randomized_model("gemma4", str(tmp_path_factory.mktemp(layout)),
                                          transformers.Gemma4TextConfig(**{**BASE, **overrides}), randomize_vectors)
            for layout, overrides in LAYOUTS.items()}


def transformers_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(path, prompts, MAX_TOKENS)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return engine_greedy(llm, prompts, MAX_TOKENS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_transformers_under_chunked_prefill_prefix_caching_and_preemption(model_dirs, layout):
    """Prompts of 10-60 tokens (two pairs sharing 24 tokens: prefix hits) in chunks of 16, batched, with a page
    pool small enough that sequences are preempted and recomputed; the sliding layers past their 16-token window.
    The sliding and the global layers keep pools of their own shapes, and a layer reading another's KV none."""
    shared = random_prompts(1, 500, 24, 24, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(2, 500, 4, 30, seed=6)] + random_prompts(3, 500, 10, 60, 7)
    llm = LLM(model_dirs[layout], max_num_seqs=4, max_model_len=128, page_size=8, num_kv_pages=20,
              max_num_batched_tokens=16, enable_prefix_caching=True, decode_batch_buckets=(4,), warmup=False)
    greedy(llm, prompts[:1])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == transformers_greedy(model_dirs[layout], prompts)
    assert outs[0].num_cached_tokens >= 24 and outs[1].num_cached_tokens == 24  # the first ran once before
    engine = llm.llm_engine
    assert engine.stats().num_preemptions > 0
    plan, kv_cache = engine.runner.kv_plan, engine.runner.kv_cache
    full, window = plan.groups
    assert full.spec == FullAttentionSpec(1 if layout == "moe" else 2, 32)
    assert window.spec == SlidingWindowSpec(2, 16, 16)
    first_global = 5 if layout == "default" else 1
    assert kv_cache[first_global].k.shape[-1] == 32 and kv_cache[0].k.shape[-1] == 16
    if layout == "shared":  # layers 4 (sliding) and 5 (global) read layers 2 and 3: no pools, no pages, no bytes
        assert full.layers == (1, 3) and window.layers == (0, 2)
        assert plan.layer_groups[4:] == (1, 0) and plan.layer_pages[4:] == [0, 0]
        assert kv_cache[4] is None and kv_cache[5] is None
        assert full.page_bytes == 2 * 2 * 8 * 2 * 32 * 4  # K and V of two layers of 2 heads of 32, float32


def test_one_group_of_two_shapes_with_the_hybrid_cache_off_and_ngram_speculation(model_dirs):
    """With the hybrid KV cache off every layer keeping pages is in group 0, in pools of two shapes named by the same
    page indices; n-gram drafts verified over them (the shared layers reading the verify step's K/V) change no
    greedy token."""
    prompts = [p * 3 for p in random_prompts(3, 500, 5, 12, seed=3)]
    llm = LLM(model_dirs["shared"], max_num_seqs=4, max_model_len=128, page_size=8, warmup=False,
              max_num_batched_tokens=64, smallest_prefill_bucket=64, decode_batch_buckets=(4,),
              disable_hybrid_kv_cache_manager=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    assert greedy(llm, prompts) == transformers_greedy(model_dirs["shared"], prompts)
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0
    (group,) = llm.llm_engine.runner.kv_plan.groups
    assert group.layers == (0, 1, 2, 3) and group.shapes == (FullAttentionSpec(2, 16), FullAttentionSpec(2, 32))


@pytest.mark.parametrize("layout", ["default", "moe"])
def test_heads_and_experts_split_over_two_devices(model_dirs, layout):
    """Tensor parallelism: query heads, the sliding layers' two KV heads and the experts' columns split; the
    global layers' one KV head (moe) is replicated, one per device; the per-layer inputs' columns split."""
    prompts = random_prompts(3, 500, 10, 50, seed=8)
    llm = LLM(model_dirs[layout], max_num_seqs=4, max_model_len=128, tensor_parallel_size=2,
              max_num_batched_tokens=32, smallest_prefill_bucket=32, decode_batch_buckets=(4,), warmup=False)
    assert greedy(llm, prompts) == transformers_greedy(model_dirs[layout], prompts)
    global_pool = llm.llm_engine.runner.kv_cache[5 if layout == "default" else 1].k
    assert global_pool.shape[0] == 2 and {shard.data.shape[0] for shard in global_pool.addressable_shards} == {1}
    assert global_pool.shape[-1] == 32


def test_an_image_and_text_checkpoint_serves_its_text_decoder(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint (what Google publishes): `text_config` and the language model's
    tensors under `model.language_model.`; the vision tower is not read."""
    path = str(tmp_path / "gemma4")
    text = {**BASE, **LAYOUTS["shared"]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    randomize_vectors(model)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, text["vocab_size"])
    prompts = random_prompts(2, 500, 5, 30, seed=9)
    llm = LLM(path, max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=32, smallest_prefill_bucket=32,
              decode_batch_buckets=(2,), warmup=False)
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert greedy(llm, prompts) == expected


def test_what_gemma4_cannot_take_is_refused_by_name(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="the KV tiers: not supported yet for models whose layers keep KV of "
                                         "different shapes"):
        LLM(model_dirs["default"], max_model_len=64, kv_offloading_size=0.01, warmup=False)
    config = transformers.Gemma4TextConfig(**{**BASE, **LAYOUTS["default"]}, use_bidirectional_attention="all")
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_bidirectional_attention='all' is not supported"):
        LLM(str(tmp_path), max_model_len=64, warmup=False)


@pytest.mark.parametrize("target", ["v5e-1", "h200"])
def test_the_steps_compile_for_the_targets(tmp_path, target):
    """Prefill and decode of a Gemma-4-shaped model (256-wide sliding heads, 512-wide global heads with values from
    keys, a layer reading another's KV, per-layer inputs) compile for a TPU and an H200 with their default Pallas
    kernels (the Triton tiles at head_dim 512 overflowed an H200's shared memory before they were capped), and the
    plan has a pool per shape and none for the shared layer."""
    from jaxserve.aot.compile import compile_engine
    from jaxserve.engine.config import EngineConfig
    from tests.test_compile_targets import SMALL, assert_compiles_and_fits, compilers_present

    if not compilers_present():
        pytest.skip("the target compilers (the [aot] extra) are not installed")
    transformers.Gemma4TextConfig(**{**BASE, "hidden_size": 256, "intermediate_size": 256, "head_dim": 256,
                                     "global_head_dim": 512, "num_global_key_value_heads": 1, "sliding_window": 32,
                                     "attention_k_eq_v": True, "num_hidden_layers": 3, "num_kv_shared_layers": 1,
                                     "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
                                  ).save_pretrained(tmp_path)
    result = compile_engine(EngineConfig(model=str(tmp_path), **SMALL), target, {"prefill", "decode"})
    assert_compiles_and_fits(result)
    assert {step.shape for step in result.steps if step.name == "decode"} == {"rows=4"}  # not its 2 groups
    plan = result.plan.kv_plan
    assert [(group.spec, group.layers) for group in plan.groups] == [(FullAttentionSpec(1, 512), (1,)),
                                                                     (SlidingWindowSpec(2, 256, 32), (0,))]
    assert plan.layer_groups == (1, 0, 0) and plan.layer_pages[2] == 0


def test_the_31b_shape_keeps_80_kib_per_token_beyond_its_windows():
    """`benchmarks/kv_bytes.py` on the Gemma-4-31B shape: a token's K/V in the 10 global layers (4 heads of 512,
    bfloat16) is 80 KiB; without the hybrid KV cache the 50 sliding layers' (16 heads of 256) add 800 KiB; 20
    KV-shared layers (a variant) take no pages."""
    from benchmarks import kv_bytes

    hybrid, every_token = kv_bytes.main(["--shape", "gemma-4-31b"])
    assert hybrid["kib_per_token"] == 10 * 4 * 512 * 2 * 2 / 1024 == 80
    assert every_token["kib_per_token"] == (10 * 4 * 512 + 50 * 16 * 256) * 2 * 2 / 1024 == 880
    shared, _ = kv_bytes.main(["--shape", "gemma-4-31b", "--set", "num_kv_shared_layers=20"])
    assert (shared["full_layers"], shared["window_layers"], shared["no_pages"]) == (6, 34, 20)

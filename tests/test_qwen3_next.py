"""Qwen3-Next and Qwen3.5 against transformers: hybrid decoders whose Gated DeltaNet layers keep a per-sequence state
in the engine's state slots (no pages) beside gated full-attention layers, served through the engine with chunked
prefill, preemption, batching and tensor parallelism; greedy tokens equal transformers' own loop in float32."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.engine.kv_plan import FullAttentionSpec, StateSpec
from tests.conftest import (TINY_DIMS, engine_greedy, hf_greedy, random_prompts, save_randomized_model,
                            save_tiny_tokenizer)

# 4 layers (3 Gated DeltaNet + 1 full attention); 2 key heads serving 4 value heads of another size than the keys
DIMS = {**TINY_DIMS, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "tie_word_embeddings": False}
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONFIGS = {"qwen3_next": lambda: transformers.Qwen3NextConfig(**DIMS, **EXPERTS),
           "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**DIMS),
           "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**DIMS, **EXPERTS)}
MAX_TOKENS = 10


def randomize_vectors(model) -> None:
    """transformers starts the `(1 + w)` norms at zero and the decay parameters at fixed values: random, so each
    enters the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(1.0 if name.endswith("dt_bias") else 0.0, 0.3)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {family: save_randomized_model(family, str(tmp_path_factory.mktemp(family)), config(), randomize_vectors)
            for family, config in CONFIGS.items()}


def transformers_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(path, prompts, MAX_TOKENS)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return engine_greedy(llm, prompts, MAX_TOKENS)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_equals_transformers_under_chunked_prefill_preemption_and_batching(model_dirs, family):
    """Prompts of 20-90 tokens in chunks of 16 (each chunk continues the state the last one left; chunks cross the
    chunked form's 64-token blocks), batched with each other (a row's state is its own), with a page pool small
    enough that sequences are preempted and recomputed from a fresh state. Only the full-attention layer takes
    pages."""
    prompts = random_prompts(5, 500, 20, 90, seed=7)
    llm = LLM(model_dirs[family], max_num_seqs=4, max_model_len=160, page_size=8, num_kv_pages=24,
              max_num_batched_tokens=16, decode_batch_buckets=(4,), warmup=False)
    assert greedy(llm, prompts) == transformers_greedy(model_dirs[family], prompts)
    engine = llm.llm_engine
    assert engine.stats().num_preemptions > 0
    plan = engine.runner.kv_plan
    (group,) = plan.groups
    assert group.layers == (3,) and group.spec == FullAttentionSpec(2, 16)
    assert plan.state == StateSpec((2 * 2 * 16 + 4 * 8, 3), (4, 16, 8)) and plan.state_slots == 4
    assert plan.state_slot_bytes == 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4)  # 3 layers, float32 conv inputs and state
    assert group.page_bytes == 2 * 8 * 2 * 16 * 4  # K and V of one layer


def test_heads_and_states_split_over_two_devices(model_dirs):
    """Tensor parallelism: each device keeps one key head, its two value heads, their channels and states."""
    prompts = random_prompts(3, 500, 10, 70, seed=8)
    llm = LLM(model_dirs["qwen3_next"], max_num_seqs=4, max_model_len=128, tensor_parallel_size=2,
              max_num_batched_tokens=32, smallest_prefill_bucket=32, decode_batch_buckets=(4,), warmup=False)
    assert greedy(llm, prompts) == transformers_greedy(model_dirs["qwen3_next"], prompts)
    recurrent = llm.llm_engine.runner.kv_cache[0].recurrent
    assert {shard.data.shape for shard in recurrent.addressable_shards} == {(4, 2, 16, 8)}


def test_an_image_and_text_checkpoint_serves_text_and_images(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (what Qwen3.5 publishes): text prompts and prompts with images
    (Qwen3-VL's tower without deepstack; M-RoPE interleaved over the rotated quarter of the full-attention layer's
    heads, the Gated DeltaNet layers reading the image embeddings) in chunks of 16, greedy tokens equal
    transformers'."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.vision_models import VISION_TOKENS, drawn_image

    path = str(tmp_path / "qwen3_5")
    vocab = DIMS["vocab_size"]
    text = {**CONFIGS["qwen3_5_text"]().to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
        "mrope_interleaved": True}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  num_position_embeddings=64)
    first = vocab - len(VISION_TOKENS)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, vision_start_token_id=first, vision_end_token_id=first + 1,
        image_token_id=first + 2, video_token_id=first + 3))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    randomize_vectors(model)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, vocab, VISION_TOKENS)
    processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, patch_size=16)
    processor.save_pretrained(path)
    image = drawn_image(100, 70, seed=5)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 500, 5, 30, seed=9)]
    prompts.append({"prompt_token_ids": [5, 6, first, first + 2, first + 1, 7, 8],
                    "multi_modal_data": {"image": image}})
    llm = LLM(path, max_num_seqs=3, max_model_len=64, page_size=8, max_num_batched_tokens=16,
              decode_batch_buckets=(3,), warmup=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    features = processor(images=[image], return_tensors="pt")
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([output.prompt_token_ids])
        images = dict(pixel_values=features["pixel_values"], image_grid_thw=features["image_grid_thw"],
                      mm_token_type_ids=(ids == first + 2).int()) if "multi_modal_data" in prompt else {}
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=0, **images)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist()
    assert outputs[2].prompt_token_ids.count(first + 2) > 1


def test_what_the_state_cannot_take_yet_is_refused_by_name(model_dirs):
    with pytest.raises(ValueError, match="the KV tiers: not supported yet for models with linear-attention layers"):
        LLM(model_dirs["qwen3_5_text"], max_model_len=64, warmup=False, kv_offloading_size=0.01)
    with pytest.raises(ValueError, match="has linear-attention layers: a draft model with a per-sequence state"):
        LLM(model_dirs["qwen3_5_text"], max_model_len=64, warmup=False,
            speculative_config={"model": model_dirs["qwen3_5_moe_text"], "num_speculative_tokens": 2})


def test_speculation_rolls_the_state_back_to_the_last_accepted_token(model_dirs):
    """n-gram drafts over prompts that repeat a phrase, some accepted and most rejected: the Gated DeltaNet layers
    keep the state after each verified token and go on from the last accepted one, so greedy tokens equal
    transformers' (under chunked prefill, batching and preemption); the pools hold K + 1 states per sequence. A
    later turn hits the state a step saved at position 64."""
    path = model_dirs["qwen3_next"]
    prompts = [(phrase * 40)[:70] for phrase in random_prompts(4, 500, 2, 5, seed=60)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": None}
    llm = LLM(path, max_num_seqs=4, max_model_len=160, page_size=8, num_kv_pages=36, max_num_batched_tokens=32,
              smallest_prefill_bucket=32, decode_batch_buckets=(4,), mamba_block_size=64, warmup=False,
              speculative_config=spec)
    assert engine_greedy(llm, prompts, 24) == hf_greedy(path, prompts, 24)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and 0 < stats.spec_decode_accepted_per_pos[0]
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert llm.llm_engine.runner.kv_plan.state_slots == 4 * 4
    turn = random_prompts(1, 500, 60, 60, seed=3)[0]
    first = engine_greedy(llm, [turn], 24)[0]
    second = turn + first + [5, 6, 7]  # its first 64 tokens' state: saved by the step whose first token is 63
    out = llm.generate([{"prompt_token_ids": second}],
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == transformers_greedy(path, [second])[0]


def test_prefix_hits_start_from_the_state_kept_where_they_end(model_dirs):
    """Prefix caching with state checkpoints every 64 tokens: prompts sharing 150 tokens hit 128 of them (the
    deepest checkpoint), in chunks of up to 48 that start off the chunked form's 64-token grid and under preemption;
    a second turn hits the state a decode step saved (turn one's 50 + 40 tokens pass position 64). Greedy tokens
    equal transformers', and the cached-token counts say what was hit."""
    path = model_dirs["qwen3_next"]
    shared = random_prompts(1, 500, 150, 150, seed=11)[0]
    prompts = [shared + tail for tail in random_prompts(3, 500, 3, 20, seed=13)] + random_prompts(2, 500, 20, 90, 7)
    llm = LLM(path, max_num_seqs=4, max_model_len=256, page_size=8, num_kv_pages=36, max_num_batched_tokens=48,
              smallest_prefill_bucket=64, decode_batch_buckets=(4,), mamba_block_size=64, warmup=False)
    greedy(llm, prompts[:1])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == transformers_greedy(path, prompts)
    assert [out.num_cached_tokens for out in outs] == [128, 128, 128, 0, 0]
    assert llm.llm_engine.stats().num_preemptions > 0

    turn = random_prompts(1, 500, 50, 50, seed=3)[0]
    first = llm.generate([{"prompt_token_ids": turn}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)[0]
    second = turn + first.outputs[0].token_ids + [5, 6, 7]
    out = llm.generate([{"prompt_token_ids": second}],
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == transformers_greedy(path, [second])[0]


def test_state_checkpoints_evict_least_recent_and_never_a_row_a_step_reads():
    from jaxserve.engine.state_checkpoints import StateCheckpoints

    states = StateCheckpoints(capacity=2, interval=64, page_size=16)
    assert states.saves(1, 0, 130) == ((64, 0), (128, 1))  # every checkpoint position the tokens pass
    assert states.saves(2, 0, 64) == ()  # every row is claimed
    states.register(1, 3, serial=10)  # the page ending at 64
    states.register(1, 7, serial=11)  # at 128
    assert states.usable_hit([0, 1, 2, 10, 4, 5, 6, 11, 12]) == 8 and states.usable_hit([0, 1, 2, 10, 4]) == 4
    assert states.usable_hit([0, 1, 2, 9]) == 0
    states.admit(3, [0, 1, 2, 10])  # seq 3 starts from row 0, now the most recently used
    assert states.saves(4, 100, 40) == ((128, 1),)  # evicts the least recent (serial 11), not the row seq 3 reads
    assert states.saves(5, 0, 64) == ()
    states.forget(10)  # its page left the cache while seq 3 is still to read its row
    assert states.take_source(3) == 0 and states.saves(5, 0, 64) == ()
    states.end_step()  # freed once the step reading it is built
    assert states.saves(5, 0, 64) == ((64, 0),)


def test_no_compile_after_warm_up_and_the_state_pools_are_donated(model_dirs, caplog):
    """Prefill chunks and decodes of every bucket run the executables warm-up compiled, and each step consumes the
    state pools it was given (updated in place, never copied)."""
    import logging

    import jax

    llm = LLM(model_dirs["qwen3_5_text"], max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=16,
              decode_batch_buckets=(1, 2))
    old = llm.llm_engine.runner.kv_cache[0]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        greedy(llm, random_prompts(3, 500, 1, 40, seed=10))
    assert not [record for record in caplog.records if "Compiling" in record.getMessage()]
    assert old.conv.is_deleted() and old.recurrent.is_deleted()


@pytest.mark.parametrize("target", ["v6e-1", "h200"])
def test_the_hybrid_steps_compile_for_the_targets(tmp_path, target):
    """The prefill (chunked form, saving state checkpoints) and decode steps of a Qwen3-Next-shaped model (128-wide
    linear heads, 256-wide attention heads) compile for a TPU and an H200 with their default kernels, and the plan
    counts the state slots and checkpoints. For the H200 with its MTP layer proposing 2 tokens too: the verify step
    keeping 3 states per sequence, and the layer's prefill, keep and propose steps."""
    from jaxserve.aot.compile import compile_engine
    from jaxserve.aot.report import kv_group_lines, result_json
    from jaxserve.engine.config import EngineConfig
    from tests.test_compile_targets import SMALL, assert_compiles_and_fits, compilers_present

    if not compilers_present():
        pytest.skip("the target compilers (the [aot] extra) are not installed")
    config = transformers.Qwen3NextConfig(**{**DIMS, "hidden_size": 256, "intermediate_size": 256, "head_dim": 256,
                                             "linear_key_head_dim": 128, "linear_value_head_dim": 128}, **EXPERTS,
                                          num_nextn_predict_layers=1)
    config.save_pretrained(tmp_path)
    mtp = target == "h200"
    names = {"prefill", "decode", *(("verify", "head_prefill", "head_keep", "head_propose") if mtp else ())}
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}} if mtp else {}
    result = compile_engine(EngineConfig(model=str(tmp_path), **SMALL, **spec), target, names)
    assert {step.name for step in result.steps} == names
    assert_compiles_and_fits(result)
    plan = result.plan.kv_plan
    slots = 4 * (3 if mtp else 1)
    assert plan.state_slots == slots and plan.state_checkpoints == 8
    assert plan.state_bytes == (slots + 8) * plan.state_slot_bytes
    if mtp:  # the verify writes each token's state as it is made: its temporaries hold no layer's stacked states
        # (stacked over the tokens, they stayed alive across the layers: 12.8 MB here, where decode takes 1.1)
        temp = {step.name: step.temp_bytes for step in result.steps}
        stacked = SMALL["max_num_seqs"] * 3 * math.prod(plan.state.recurrent) * 4  # rows x (K + 1) states, float32
        assert temp["verify"] < temp["decode"] + stacked, temp
    assert result_json(result)["state_bytes"] == plan.state_bytes
    assert any(line.startswith(f"  state slots: {slots} slots and 8 checkpoints") for line in kv_group_lines(plan))


# Built in a fresh process of two CPU devices: a one-device engine, deleted, then each hybrid family split over both,
# then two replicas' engines side by side (a data-parallel server's), each deleted in turn. Before issue 68's fix the
# first split engine never finished its warm-up (the CPU triangular solve waited on XLA's intra-op threads from
# inside them); Qwen3.5 has the dimensions and default shapes, which hit it where smaller ones did not. After
# each deletion no device array of the engine is left.
AFTER_ANOTHER_ENGINE = """
import gc, tempfile
import jax, transformers
from jaxserve import LLM, SamplingParams
from tests.conftest import random_prompts, save_randomized_model, save_tiny_model
from tests.test_qwen3_next import CONFIGS, DIMS, randomize_vectors

def serve(llm):
    out = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 500, 10, 30, seed=3)],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in out]

def left():
    gc.collect()
    return len(jax.live_arrays())

first = LLM(save_tiny_model("llama", tempfile.mkdtemp()), max_model_len=64, warmup=False)
del first
print("llama left", left())
issue = transformers.Qwen3_5TextConfig(**{**DIMS, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32,
                                          "linear_value_head_dim": 16})
paths = {family: save_randomized_model(family, tempfile.mkdtemp(), issue if family == "qwen3_5_text" else config(),
                                       randomize_vectors) for family, config in CONFIGS.items()}
for family in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
    shapes = {} if family == "qwen3_5_text" else dict(max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(paths[family], max_model_len=128, tensor_parallel_size=2, **shapes)
    print(family, "tokens", serve(llm))
    del llm
    print(family, "left", left())
replicas = [LLM(paths["qwen3_5_moe_text"], max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                data_parallel_rank=rank) for rank in range(2)]
print("replicas tokens", [serve(llm) for llm in replicas])
del replicas
print("replicas left", left())
"""

EXPECTED = """llama left 0
qwen3_5_text tokens [4, 4]
qwen3_5_text left 0
qwen3_5_moe_text tokens [4, 4]
qwen3_5_moe_text left 0
qwen3_next tokens [4, 4]
qwen3_next left 0
replicas tokens [[4, 4], [4, 4]]
replicas left 0
"""


def test_split_engines_and_replicas_start_after_other_engines_and_leave_no_array():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace("device_count=4", "device_count=2")}
    try:
        run = subprocess.run([sys.executable, "-c", AFTER_ANOTHER_ENGINE], cwd=Path(__file__).parents[1], env=env,
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as error:
        printed = [(text or b"").decode(errors="replace") for text in (error.stdout, error.stderr)]
        pytest.fail(f"not done in 300 s (~100 s when it works); it printed:\n{printed[0]}\n{printed[1][-2000:]}")
    assert run.returncode == 0 and run.stdout == EXPECTED, run.stdout + run.stderr[-3000:]

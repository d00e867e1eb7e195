"""The Flax model against Hugging Face transformers: logits and greedy tokens for every supported family."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.layers.attention import AttentionMetadata, KVPages, make_attention_backend
from jaxserve.loading import load_model
from jaxserve.layers.rotary import rope_attention_factor, rope_inverse_frequencies
from jaxserve.models import forward, fuse_params
from jaxserve.models.hf_config import parse_rope, rope_parameters
from tests.conftest import TINY_FAMILIES, random_prompts, save_tiny_model, save_tiny_tokenizer, tiny_hf_config

FAMILIES = TINY_FAMILIES
PAGE_SIZE = 8


def full_forward_logits(params, cfg, token_ids: list[int], backend: str = "xla", pad_to: int | None = None
                        ) -> np.ndarray:
    """Logits of every position of one sequence, computed through the paged cache (pages 1.., page 0 scratch).

    `params` are in the serving layout (`fuse_params` of what the loader returns). With `pad_to` the batch is
    padded to that many tokens (their K/V written to the scratch page, as the engine pads), so calls of other
    lengths reuse one compiled forward."""
    attn = make_attention_backend(backend)
    num_tokens = len(token_ids)
    length = max(num_tokens, pad_to or 0)
    num_pages = -(-length // PAGE_SIZE)
    shape = attn.pool_shape(num_pages + 1, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    cache = [KVPages(jnp.zeros(shape), None if cfg.mla else jnp.zeros(shape)) for _ in range(cfg.num_layers)]
    positions = jnp.arange(length, dtype=jnp.int32)
    meta = AttentionMetadata(
        positions=positions[None],
        slot_mapping=jnp.where(positions < num_tokens, positions + PAGE_SIZE, 0)[None],
        page_tables=jnp.arange(1, num_pages + 1, dtype=jnp.int32)[None],
        context_lens=jnp.array([num_tokens], jnp.int32),
        query_lens=jnp.array([num_tokens], jnp.int32))
    padded = jnp.array([token_ids + [0] * (length - num_tokens)], jnp.int32)
    logits, _ = jax.jit(forward, static_argnums=(1, 2))(params, cfg, attn, padded, cache, meta)
    return np.asarray(logits[0, :num_tokens])


def hf_logits(hf_model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(tiny_model_dirs, family):
    assert_matches_transformers(tiny_model_dirs[family], family)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "phi3", "gpt_oss"])
def test_engine_greedy_equals_transformers_with_chunked_prefill_prefix_caching_and_preemption(tiny_model_dirs,
                                                                                              family):
    """With windows, under the hybrid KV cache (the window layers' pages released behind the window)."""
    path = tiny_model_dirs[family]
    shared = random_prompts(1, 500, 24, 24, seed=11)[0]
    tails = random_prompts(3, 500, 2, 9, seed=13)
    prompts = random_prompts(5, 500, 20, 60, seed=12) + [shared + tail for tail in tails]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, max_num_seqs=8, max_model_len=128, page_size=8, num_kv_pages=30, max_num_batched_tokens=32,
              smallest_prefill_bucket=32, decode_batch_buckets=(8,), warmup=False)
    ours = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert (len(llm.llm_engine.runner.kv_plan.groups) > 1) == (family not in ("qwen2_moe", "qwen3_moe"))  # windowed: the hybrid cache
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref, (family, len(prompt))


def test_yarn_rope_matches_transformers(tmp_path):
    """Qwen2 with YaRN (as Qwen2.5 configs extend their context): an original context shorter than the prompts,
    so the interpolated, ramped and kept frequencies all turn, and the attention factor scales cos and sin."""
    path = save_tiny_model("qwen2", str(tmp_path / "yarn"), rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    assert_matches_transformers(path, "qwen2-yarn")


@pytest.mark.parametrize("extra", [{}, {"beta_fast": 16, "beta_slow": 2}, {"mscale": 1.0, "mscale_all_dim": 0.5},
                                   {"attention_factor": 0.9}, {"truncate": False}, {"factor": None}])
def test_yarn_frequencies_and_attention_factor_are_transformers(extra):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, **extra}
    config = transformers.Qwen2Config(hidden_size=128, num_attention_heads=2, max_position_embeddings=1024,
                                      rope_theta=500000.0, rope_scaling=dict(scaling))
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    theta, ours_scaling = rope_parameters(config)
    ours = rope_inverse_frequencies(64, theta, dict(ours_scaling))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)  # theirs is float32
    assert rope_attention_factor(dict(ours_scaling)) == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.parametrize("factor", [None, 2.0])
def test_proportional_rope_frequencies_are_transformers(factor):
    """Gemma 4's global layers: a quarter of the head's pairs turned at the whole head's frequencies, the rest not
    turned (zero frequency), over the whole head (not the partial-rotary path)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    full = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
    if factor is not None:
        full["factor"] = factor
    config = transformers.Gemma4TextConfig(
        hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        global_head_dim=64, vocab_size=100, hidden_size_per_layer_input=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": full})
    theirs, their_factor = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    theta, scaling = parse_rope(full, None, 1024)
    np.testing.assert_allclose(rope_inverse_frequencies(64, theta, dict(scaling)), theirs.numpy(), rtol=1e-6)
    assert rope_attention_factor(dict(scaling)) == their_factor == 1.0


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "needs rope parameter 'original_max_position_embeddings'"),
    ({"rope_type": "fourier", "factor": 2.0}, "rope_type 'fourier' is not supported"),
    ({"rope_type": "dynamic"}, "rope_type 'dynamic' needs rope parameter 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # was ignored
])
def test_rope_configs_this_code_cannot_serve_are_value_errors(scaling, message):
    config = types.SimpleNamespace(rope_scaling=scaling, rope_theta=10000.0, max_position_embeddings=64)
    with pytest.raises(ValueError, match=message):
        rope_parameters(config)


def assert_matches_transformers(path: str, label: str) -> None:
    """Logits of several prompt lengths and 24 greedy tokens equal to transformers' own in float32."""
    loaded = load_model(path)
    params = fuse_params(loaded.params, loaded.config)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    # the 40-token prompt crosses the Mistral sliding window (16) and several pages
    prompts = [rng.integers(0, loaded.config.vocab_size, size=n).tolist() for n in (1, 7, 16, 40)]
    for prompt in prompts:
        ours, theirs = full_forward_logits(params, loaded.config, prompt), hf_logits(hf_model, prompt)
        rel_err = np.abs(ours - theirs).max() / np.abs(theirs).max()
        assert rel_err < 1e-4, (label, len(prompt), rel_err)

    prompt = prompts[2]
    with torch.no_grad():
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ours = list(prompt)
    for _ in range(24):  # one compiled forward for every length (padded to 40)
        ours.append(int(np.argmax(full_forward_logits(params, loaded.config, ours, pad_to=40)[-1])))
    assert ours[len(prompt):] == hf_tokens


def test_gemma3_image_and_text_checkpoints_serve_their_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (the published Gemma 3 4B-27B are): its text decoder's greedy
    tokens through the engine equal transformers' on text prompts (its images: tests/test_gemma3_images.py)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = str(tmp_path / "gemma3")
    text = tiny_hf_config("gemma3_text")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, text.vocab_size)
    Gemma3ImageProcessorPil(size={"height": 28, "width": 28}).save_pretrained(path)
    prompts = random_prompts(3, 500, 5, 30, seed=41)
    llm = LLM(path, max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=32, smallest_prefill_bucket=32,
              decode_batch_buckets=(4,), warmup=False)
    assert llm.llm_engine.runner.model_config.model_type == "gemma3"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_bias_covers_the_output_projection(tmp_path, family):
    """Llama and Qwen3's attention_bias puts a bias on o_proj too (Qwen2's q/k/v biases do not)."""
    path = save_tiny_model(family, str(tmp_path / family), attention_bias=True)
    loaded = load_model(path)
    assert loaded.config.o_bias and loaded.config.qkv_bias
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(3, 40))
    ours = full_forward_logits(fuse_params(loaded.params, loaded.config), loaded.config, prompt)
    theirs = hf_logits(hf_model, prompt)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4


def test_unsupported_model_type_is_a_clear_error(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither the default model"):
        load_model(str(tmp_path / "nope"))

"""Ropes whose frequencies change with the sequence's length (LongRoPE: Phi-3's 128k variants; dynamic NTK) against
transformers: the frequencies either side of the threshold, and greedy tokens of prompts shorter and longer than
it, generated across it, through the engine with chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxserve import LLM, SamplingParams
from jaxserve.layers.rotary import rope_attention_factor, token_inverse_frequencies
from jaxserve.models.hf_config import rope_parameters
from tests.conftest import random_prompts, save_tiny_model

THRESHOLD = 32  # the original (LongRoPE) or model (dynamic) length of the tiny models: prompts cross it
HEAD_DIM = 16
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.0 + 2.0 * i for i in range(HEAD_DIM // 2)]}


def configs() -> dict[str, transformers.PretrainedConfig]:
    phi3 = transformers.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * THRESHOLD,
                                   original_max_position_embeddings=THRESHOLD, rope_scaling=dict(LONGROPE),
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    llama = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=THRESHOLD,
                                     rope_scaling={"rope_type": "dynamic", "factor": 3.0}, tie_word_embeddings=False)
    return {"longrope": phi3, "dynamic": llama}


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
@pytest.mark.parametrize("length", [1, THRESHOLD, THRESHOLD + 1, 3 * THRESHOLD])
def test_frequencies_and_attention_factor_are_transformers(kind, length):
    config = configs()[kind]
    theirs, their_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
    theta, scaling = rope_parameters(config)
    ours = token_inverse_frequencies(HEAD_DIM, theta, dict(scaling), np.asarray([length]))
    np.testing.assert_allclose(np.asarray(ours)[0], theirs.numpy(), rtol=2e-6)  # both float32
    assert rope_attention_factor(dict(scaling)) == pytest.approx(their_factor, rel=1e-6)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_greedy_tokens_equal_transformers_with_chunked_prefill_prefix_caching_and_preemption(tmp_path, kind):
    """Prompts shorter than the threshold (generating across it) and longer (every prompt token rotated by the
    prompt's length, as transformers' single forward does), two sharing a short prefix; chunks of 16 tokens split the
    long prompts, and too few pages preempt."""
    family = "phi3" if kind == "longrope" else "llama"
    path = save_tiny_model(family, str(tmp_path / kind), config=configs()[kind])
    shared = random_prompts(1, 500, 16, 16, seed=31)[0]
    prompts = [shared + tail for tail in random_prompts(2, 500, 3, 9, seed=32)]
    prompts += random_prompts(2, 500, 20, 30, seed=33) + random_prompts(2, 500, 40, 80, seed=34)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, max_num_seqs=4, max_model_len=3 * THRESHOLD, page_size=8, num_kv_pages=16,
              max_num_batched_tokens=16, warmup=False)
    ours = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for prompt, tokens in zip(prompts, ours):  # a fresh model each: transformers keeps a grown dynamic rope
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref, (kind, len(prompt))

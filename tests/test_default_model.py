"""The embedded default model (SmolLM2-135M-Instruct from its GGUF) against transformers loading the same GGUF,
and the converted-checkpoint store: round trip, corruption detection and rebuild."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading import DEFAULT_MODEL, checkpoint_root, default_gguf_path, load_model
from jaxserve.loading.store import CorruptCheckpointError, load_store, save_store, verify_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128, warmup=False,  # compiles as used
               smallest_prefill_bucket=128, decode_batch_buckets=(4,))  # one prefill, one decode bucket


@pytest.fixture(scope="module")
def hf_default():
    """transformers' model from the same GGUF (float32), read once for the tests that compare with it."""
    import torch
    import transformers

    gguf = Path(default_gguf_path())
    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


def test_greedy_tokens_match_transformers_on_the_same_gguf(default_llm, hf_default):
    import torch

    hf = hf_default
    tokenizer = default_llm.get_tokenizer()
    prompts = [
        default_llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tokenizer.encode("The three primary colors are"),
        tokenizer.encode("def fibonacci(n):\n    "),
        tokenizer.encode("Once upon a time, in a small village by the sea,"),
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = default_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.set_num_threads(2)
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, tokenizer.decode(prompt)
    assert "Paris" in ours[0].outputs[0].text


def test_gguf_tokenizer_matches_transformers_gguf_tokenizer(default_llm):
    import transformers

    gguf = Path(default_gguf_path())
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ours = default_llm.get_tokenizer()
    for text in ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🚀", "x = [i**2 for i in y]"]:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text)) == text


def test_store_round_trip_gives_identical_params(tmp_path):
    store = checkpoint_root() / DEFAULT_MODEL
    config, params, tokenizer = load_store(store)
    # the checkpoint layout (q/k/v and gate/up apart), as jax arrays placed on the default one-device mesh
    assert set(params["layers_0"]["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(params["layers_0"]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    assert all(isinstance(leaf, jax.Array) and len(leaf.devices()) == 1 for leaf in jax.tree.leaves(params))
    copy = tmp_path / "copy"
    save_store(copy, config, params, tokenizer)
    config2, params2, _ = load_store(copy)
    assert config2 == config
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, params2))


def test_truncated_store_is_detected_and_rebuilt(tmp_path, monkeypatch):
    shutil.copytree(checkpoint_root() / DEFAULT_MODEL, tmp_path / DEFAULT_MODEL)
    monkeypatch.setenv("JAXSERVE_CHECKPOINT_DIR", str(tmp_path))
    store = tmp_path / DEFAULT_MODEL
    biggest = max((f for f in store.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(biggest, "r+b") as handle:
        handle.truncate(biggest.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match="corrupt"):
        verify_store(store)
    loaded = load_model(None)  # detects the damage, deletes the store and converts again
    verify_store(store)
    assert loaded.config.num_layers == 30
    os.remove(store / "jaxserve_manifest.json")
    with pytest.raises(CorruptCheckpointError, match="did not finish"):
        verify_store(store)


HELD_OUT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps out of habit. "
            "Below him the harbour emptied as the fishing boats slipped out past the breakwater. "
            "In 1887 a storm tore the lantern from its mount, and the town paid for a new one with a lottery. "
            "Today the light is automatic, but visitors still ask which of the 112 steps creaks the loudest. "
            "The keeper's logbooks, kept in a glass case at the museum, record fog on one day in three and a whale "
            "that stayed in the bay for most of a week. His daughter later wrote that the worst part of the job "
            "was not the weather but the silence, and that she learned to read by the beam's slow turn across "
            "the bedroom ceiling. When the coast guard finally replaced him, the town rang the church bell twice.")


def test_prompt_logprobs_match_transformers_log_softmax(default_llm, hf_default):
    """Prompt scoring in the prefill (chunks of 128 tokens) against transformers' float32 log_softmax over the whole
    text, on the same GGUF: every token's logprob within 2e-3, and the top-5 ranks agree."""
    import torch

    hf = hf_default
    ids = default_llm.get_tokenizer().encode(HELD_OUT)
    assert len(ids) > 128  # more than one prefill chunk
    out = default_llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=5))[0]
    torch.set_num_threads(2)
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ours = np.array([entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])])
    expected = reference[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(ours, expected, atol=2e-3)
    for position, entry in enumerate(out.prompt_logprobs[1:]):
        top = sorted((lp.rank, token) for token, lp in entry.items() if lp.rank <= 5)
        np.testing.assert_allclose([reference[position, token] for _, token in top],
                                   np.sort(reference[position])[::-1][:len(top)], atol=2e-3)

"""EAGLE-3 heads: the drafts the engine proposes equal a float64 reference of the head over transformers' hidden
states of the target (through chunked prefill, verify steps and plain decode steps between them), greedy outputs
equal plain decoding, and heads that cannot serve are refused before serving."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import random_prompts, save_tiny_model, tiny_hf_config
from tests.eagle3_heads import reference_drafts, save_eagle3_head

OPTIONS = dict(max_num_seqs=4, max_model_len=128, page_size=8, max_num_batched_tokens=16, decode_batch_buckets=(1, 4),
               warmup=False)
K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    config = tiny_hf_config("llama", num_hidden_layers=4)
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("eagle3") / "target"), config=config), config


def spec(head: str, **options) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": K, "disable_by_batch_size": None, **options}


def recorded_proposals(llm) -> list[tuple[int, int, list[int]]]:
    """Every proposal the engine's head makes, as (slot, latest position, drafts) per active row (the drafts it
    may have: near max_tokens fewer than K)."""
    head = llm.llm_engine.runner.speculator.head
    propose, seen = head.propose, []

    def recording(batch):
        proposal = propose(batch)
        drafts = np.asarray(proposal.draft_tokens)
        seen.extend((int(batch.slots[r]), int(batch.positions[r]), drafts[r, :batch.num_draft[r]].tolist())
                    for r in np.flatnonzero(batch.active))
        return proposal
    head.propose = recording
    return seen


@pytest.mark.parametrize("variant", ["target_embedding", "own_embedding"])
def test_drafts_equal_the_float64_reference(target, tmp_path, variant):
    """Default: the target's embedding, vLLM's default layers (2, 2, 1), a draft vocabulary of every 4th target id.
    Own embedding: the head's table, `norm_before_residual`, layers (0, 1, 3). Two
    prompts of 37 and 29 tokens prefill in chunks of 16; the second stops after 3 tokens, so while both run the
    steps decode without drafts (`disable_by_batch_size` 2) and the head catches up on their positions after."""
    target_dir, config = target
    options = (dict(own_embedding=True, norm_before_residual=True, aux_layers=(0, 1, 3))
               if variant == "own_embedding" else {})
    head = save_eagle3_head(str(tmp_path / "head"), config, seed=3, draft_vocab_size=128, **options)
    llm = LLM(target_dir, **OPTIONS, speculative_config=spec(head, disable_by_batch_size=2))
    seen = recorded_proposals(llm)
    prompts = random_prompts(2, 500, 29, 37, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = prompts[0] + outputs[0].outputs[0].token_ids
    assert len(seen) >= 4 and {slot for slot, _, _ in seen} == {0}
    for _, position, drafts in seen:
        assert drafts == reference_drafts(target_dir, head, tokens[:position + 1], K)[:len(drafts)], position


def test_greedy_outputs_equal_plain_decoding_under_preemption(target, tmp_path):
    """Six sequences in batches of up to 4 in a pool too small for them (preempted and recomputed), with shared
    prefixes: tokens as without speculation, and the metrics count the drafts."""
    target_dir, config = target
    head = save_eagle3_head(str(tmp_path / "head"), config, draft_vocab_size=128)
    shared = random_prompts(1, 500, 20, 20, seed=8)[0]
    prompts = [{"prompt_token_ids": shared + p} for p in random_prompts(6, 500, 3, 20, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target_dir, **OPTIONS, num_kv_pages=20).generate(prompts, params, use_tqdm=False)
    llm = LLM(target_dir, **OPTIONS, num_kv_pages=20, speculative_config=spec(head))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
    assert stats.prefix_cache_hits > 0


def test_no_compiles_after_warmup_and_tensor_parallel_equals_one_device(target, tmp_path, caplog):
    """Warm-up compiles the head's steps for every bucket (greedy and sampled rows, prefill chunks, plain decodes
    while two sequences run), and under tensor parallelism on 2 devices (the head's attention split like the
    target's; no warm-up there) the drafts and tokens are those of one device."""
    import logging

    import jax

    target_dir, config = target
    head = save_eagle3_head(str(tmp_path / "head"), config, draft_vocab_size=128)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 5, 40, seed=11)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=12, logprobs=1, ignore_eos=True)]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(target_dir, **{**OPTIONS, "warmup": tp == 1}, tensor_parallel_size=tp,
                  speculative_config=spec(head, disable_by_batch_size=3))
        seen = recorded_proposals(llm)
        caplog.clear()
        with jax.log_compiles(tp == 1), caplog.at_level(logging.WARNING):
            got = llm.generate(prompts, [params[i % 2] for i in range(3)], use_tqdm=False)
        if tp == 1:  # the run after warm-up compiles nothing
            assert [r.getMessage() for r in caplog.records
                    if "Compiling" in r.getMessage() or "warm-up missed it" in r.getMessage()] == []
        outputs[tp] = [o.outputs[0].token_ids for o in got], seen
    assert outputs[1] == outputs[2] and outputs[1][1]


@pytest.mark.parametrize("case, message", [
    ("hidden_size", "reads hidden states of size 96, the target's are 64"),
    ("missing", "is missing tensor 'midlayer.mlp.down_proj.weight'"),
    ("d2t", "d2t maps draft id 127 to 512, outside the target's vocabulary of 512"),
    ("layers", "eagle_aux_hidden_state_layer_ids [0, 1, 4] must name layers in [0, 3]"),
    ("shape", "tensor 'fc.weight' has shape (64, 128), expected (64, 192)"),
    ("not_a_head", "is not an EAGLE-3 head"),
])
def test_heads_that_cannot_serve_are_refused_before_serving(target, tmp_path, case, message):
    from safetensors.numpy import load_file, save_file

    target_dir, config = target
    path = str(tmp_path / "head")
    options = {"hidden_size": dict(target_hidden_size=96), "layers": dict(aux_layers=(0, 1, 4)),
               "missing": dict(drop=("midlayer.mlp.down_proj.weight",))}.get(case, {})
    save_eagle3_head(path, config, draft_vocab_size=128, **options)
    if case in ("d2t", "shape"):
        tensors = load_file(f"{path}/model.safetensors")
        if case == "d2t":
            tensors["d2t"][-1] = 512 - 127
        else:
            tensors["fc.weight"] = tensors["fc.weight"][:, :128].copy()
        save_file(tensors, f"{path}/model.safetensors")
    if case == "not_a_head":
        path = target_dir
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        LLM(target_dir, **OPTIONS, speculative_config=spec(path))

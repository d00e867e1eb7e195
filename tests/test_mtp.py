"""A model's own multi-token-prediction layer as the proposer (`method: mtp`, DeepSeek-V3's layout): the drafts the
engine proposes equal a float64 reference built from transformers' DeepSeek-V3 decoder layer, greedy outputs
equal plain decoding (and with an EAGLE-3 head on the same latent-attention model), and a model without MTP
tensors is refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.test_deepseek import save_deepseek, tiny_deepseek_config
from tests.test_eagle3 import recorded_proposals

OPTIONS = dict(max_num_seqs=4, max_model_len=128, page_size=8, max_num_batched_tokens=16, decode_batch_buckets=(1, 4),
               warmup=False)
K = 3


def add_mtp_layer(path: str, seed: int = 5) -> str:
    """Writes the MTP layer of the checkpoint at `path` (`model.layers.{L}.*`: a decoder layer as transformers
    builds layer L of a model one layer deeper, `enorm`, `hnorm`, `eh_proj`, `shared_head`) into a file of its
    own, and `num_nextn_predict_layers: 1` into its config."""
    import tempfile

    from safetensors.torch import load_file, save_file

    config = transformers.AutoConfig.from_pretrained(path)
    index = config.num_hidden_layers
    deeper = transformers.AutoConfig.from_pretrained(path)
    deeper.num_hidden_layers = index + 1
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(deeper, dtype=torch.float32)
    prefix = f"model.layers.{index}."
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.startswith(prefix):
                value.normal_(0.0, 0.08) if value.dim() >= 2 else value.normal_(1.0, 0.1)
        for name, value in model.named_buffers():
            if name.startswith(prefix) and name.endswith("e_score_correction_bias"):
                value.normal_(0.0, 0.3)
    with tempfile.TemporaryDirectory() as saved:  # as checkpoints store it (one tensor per expert)
        model.save_pretrained(saved, safe_serialization=True)
        tensors = {name: value for name, value in load_file(os.path.join(saved, "model.safetensors")).items()
                   if name.startswith(prefix)}
    with torch.no_grad():
        h, vocab = config.hidden_size, config.vocab_size
        tensors[prefix + "enorm.weight"] = 1 + 0.1 * torch.randn(h)
        tensors[prefix + "hnorm.weight"] = 1 + 0.1 * torch.randn(h)
        tensors[prefix + "eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h)
        tensors[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h)
        tensors[prefix + "shared_head.head.weight"] = 0.08 * torch.randn(vocab, h)
    save_file({name: value.contiguous() for name, value in tensors.items()}, os.path.join(path, "mtp.safetensors"))
    raw = json.load(open(os.path.join(path, "config.json")))
    raw["num_nextn_predict_layers"] = 1
    json.dump(raw, open(os.path.join(path, "config.json"), "w"))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 with an MTP layer; its final norm's weights randomized (transformers starts them at 1,
    where normalizing the hidden state again in `hnorm` would hide whether the final norm was applied)."""
    from safetensors.torch import load_file, save_file

    path = save_deepseek(str(tmp_path_factory.mktemp("deepseek_mtp") / "model"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    torch.manual_seed(3)
    tensors["model.norm.weight"] = 1 + 0.5 * torch.randn_like(tensors["model.norm.weight"])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return add_mtp_layer(path)


def causal_layer(model, layer, x):
    """transformers' decoder `layer` (of `model`) over one sequence `x [n, hidden]` at positions 0 .. n-1, causal."""
    n = len(x)
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    out = layer(x[None], attention_mask=mask, position_ids=positions,
                position_embeddings=model.model.rotary_emb(x[None], positions))
    return (out[0] if isinstance(out, tuple) else out)[0]


class Reference:
    """The MTP layer's greedy drafts in float64: transformers' layer L of the model one layer deeper (its MLA and
    experts, loaded from the checkpoint with the MTP file as layer L) over positions 0 .. p-1, each the target's
    final (normed) hidden state at j with the token at j + 1 (embedding zero at position 0), then chained on its
    own drafts and outputs."""

    def __init__(self, path: str):
        import shutil
        import tempfile

        from safetensors.torch import load_file

        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, experts_implementation="eager").eval()
        index = self.target.config.num_hidden_layers
        self.mtp = {name: value.double() for name, value in load_file(os.path.join(path, "mtp.safetensors")).items()}
        self.prefix = f"model.layers.{index}."
        with tempfile.TemporaryDirectory() as deeper_dir:  # the checkpoint with its MTP layer as one more layer
            weight_map = {}
            for part, name in enumerate(("model.safetensors", "mtp.safetensors"), 1):
                shard = f"model-{part:05d}-of-00002.safetensors"
                shutil.copy(os.path.join(path, name), os.path.join(deeper_dir, shard))
                weight_map.update(dict.fromkeys(load_file(os.path.join(path, name)), shard))
            json.dump({"metadata": {}, "weight_map": weight_map},
                      open(os.path.join(deeper_dir, "model.safetensors.index.json"), "w"))
            raw = json.load(open(os.path.join(path, "config.json")))
            json.dump({**raw, "num_hidden_layers": index + 1, "num_nextn_predict_layers": 0},
                      open(os.path.join(deeper_dir, "config.json"), "w"))
            self.deeper = transformers.AutoModelForCausalLM.from_pretrained(
                deeper_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
        self.layer = self.deeper.model.layers[index]

    def rms(self, x, name):
        eps = self.target.config.rms_norm_eps
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * self.mtp[self.prefix + name]

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The K drafts after `tokens` (the latest at position p = len - 1)."""
        mtp, prefix = self.mtp, self.prefix
        with torch.no_grad():
            hidden = self.target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
            table = self.target.get_input_embeddings().weight
            embeds = table[torch.tensor(tokens[1:])].clone()
            drafts = []
            for _ in range(k):
                e = embeds.clone()
                e[0] = 0
                x = torch.cat([self.rms(e, "enorm.weight"), self.rms(hidden, "hnorm.weight")], -1)
                x = x @ mtp[prefix + "eh_proj.weight"].T
                out = causal_layer(self.deeper, self.layer, x)
                logits = self.rms(out[-1], "shared_head.norm.weight") @ mtp[prefix + "shared_head.head.weight"].T
                draft = int(torch.argmax(logits))
                drafts.append(draft)
                embeds = torch.cat([embeds, table[draft][None]])
                hidden = torch.cat([hidden, out[-1][None]])
        return drafts


PROMPTS = random_prompts(2, 500, 29, 37, seed=7)
PARAMS = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]


def generate(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    return generate(LLM(target, **OPTIONS))


def test_drafts_equal_the_float64_reference_and_outputs_equal_plain(target, plain):
    """Two prompts prefill in chunks of 16; the second stops after 3 tokens, so while both run the steps decode
    without drafts and the layer catches up after (`disable_by_batch_size` 2)."""
    llm = LLM(target, **OPTIONS, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": K,
                                                     "disable_by_batch_size": 2})
    seen = recorded_proposals(llm)
    outputs = generate(llm)
    assert outputs == plain
    tokens = PROMPTS[0] + outputs[0]
    assert len(seen) >= 4
    reference = Reference(target)
    for _, position, drafts in seen:
        assert drafts == reference.drafts(tokens[:position + 1], K)[:len(drafts)], position


def test_glm4_5_reads_its_mtp_layer_as_deepseek_v3_lays_it_out(tmp_path):
    """GLM-4.5 stores its MTP layer as DeepSeek-V3 does (`model.layers.{L}.*`; its own decoder layer: GQA with
    biases and q/k norms, its experts): the drafts equal the float64 reference, greedy outputs plain decoding's."""
    from tests.test_moe import save_glm4_moe

    path = add_mtp_layer(save_glm4_moe(str(tmp_path / "glm")))
    llm = LLM(path, **OPTIONS, speculative_config={"method": "mtp", "num_speculative_tokens": K,
                                                   "disable_by_batch_size": None})
    seen = recorded_proposals(llm)
    prompt = PROMPTS[0]
    outputs = llm.generate([{"prompt_token_ids": prompt}], PARAMS[0], use_tqdm=False)[0].outputs[0].token_ids
    assert outputs == LLM(path, **OPTIONS).generate([{"prompt_token_ids": prompt}], PARAMS[0],
                                                    use_tqdm=False)[0].outputs[0].token_ids
    reference = Reference(path)
    assert len(seen) >= 4
    for _, position, drafts in seen:
        assert drafts == reference.drafts((prompt + outputs)[:position + 1], K)[:len(drafts)], position


def test_an_eagle3_head_on_the_latent_attention_target(target, plain, tmp_path):
    """EAGLE-3 over the same MLA model (its layers' inputs; the head's own K/V pool beside the latent one): greedy
    outputs equal plain decoding's, drafts counted."""
    from tests.eagle3_heads import save_eagle3_head

    head = save_eagle3_head(str(tmp_path / "head"), tiny_deepseek_config(), draft_vocab_size=128,
                            aux_layers=(0, 1, 2))
    llm = LLM(target, **OPTIONS, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": K,
                                                     "disable_by_batch_size": None})
    assert generate(llm) == plain
    assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0


def test_models_without_mtp_layers_are_refused_by_name(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="has no multi-token-prediction layers"):
        LLM(tiny_llama_dir, **OPTIONS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    path = save_deepseek(str(tmp_path / "model"))
    raw = json.load(open(os.path.join(path, "config.json")))
    json.dump({**raw, "num_nextn_predict_layers": 1}, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="no tensor 'model.layers.3.enorm.weight'"):
        LLM(path, **OPTIONS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_the_mtp_steps_compile_from_the_config_alone(tmp_path):
    """DeepSeek-V3's attention shapes (64 heads, a 512 + 64 latent row, bfloat16) with one MTP layer, for an H200:
    the layer's latent pool, its prefill, keep and propose steps, and the target's forwards returning their last
    layer's output."""
    from jaxserve.aot.compile import compile_engine
    from jaxserve.engine.config import EngineConfig
    from tests.test_compile_targets import SMALL, assert_compiles_and_fits, compilers_present

    if not compilers_present():
        pytest.skip("the target compilers (the [aot] extra) are not installed")
    config = tiny_deepseek_config(hidden_size=256, intermediate_size=256, num_attention_heads=64, kv_lora_rank=512,
                                  q_lora_rank=192, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  num_mtp_layers=1)
    config.save_pretrained(tmp_path)
    names = {"prefill", "decode", "verify", "head_prefill", "head_keep", "head_propose"}
    result = compile_engine(EngineConfig(model=str(tmp_path), speculative_config={
        "method": "mtp", "num_speculative_tokens": 2}, **SMALL), "h200", names)
    assert {step.name for step in result.steps} == names
    assert_compiles_and_fits(result)

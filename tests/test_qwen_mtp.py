"""Qwen3-Next's and Qwen3.5's own multi-token-prediction layer as the proposer (`method: mtp`, their `mtp.*`
tensors) on hybrid targets: the drafts equal a float64 reference built from transformers' gated full-attention
decoder layer, greedy outputs equal plain decoding while the Gated DeltaNet states roll back to each accepted
token, a verify step's saved state serves a later prefix hit, and a checkpoint missing a tensor is refused by name
(the steps compile for an H200 in `test_qwen3_next.py`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from tests.conftest import engine_greedy, random_prompts, save_randomized_model
from tests.test_eagle3 import recorded_proposals
from tests.test_mtp import causal_layer
from tests.test_qwen3_next import CONFIGS, randomize_vectors

OPTIONS = dict(max_num_seqs=4, max_model_len=128, page_size=8, max_num_batched_tokens=16, decode_batch_buckets=(1, 4),
               mamba_block_size=64, warmup=False)
K = 3
COUNT_KEYS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5_text": "mtp_num_hidden_layers"}


def deeper_config(path: str):
    """The target's config one full-attention layer deeper: layer L is where transformers builds the MTP layer."""
    config = transformers.AutoConfig.from_pretrained(path)
    config.layer_types = [*config.layer_types, "full_attention"]
    config.num_hidden_layers += 1
    return config


def add_qwen_mtp_layer(path: str, seed: int = 5) -> str:
    """Writes an MTP layer into the checkpoint at `path` as Qwen's publish it (`mtp.layers.0.*`: the decoder layer
    transformers builds as layer L of a model one layer deeper; `mtp.fc`, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.norm`; no head of its own), in a file of its own, and its count into the
    config."""
    from safetensors.torch import load_file, save_file

    config = transformers.AutoConfig.from_pretrained(path)
    index = config.num_hidden_layers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(deeper_config(path), dtype=torch.float32)
    prefix = f"model.layers.{index}."
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.startswith(prefix):
                value.normal_(0.0, 0.08) if value.dim() >= 2 else value.normal_(0.0, 0.3)
    with tempfile.TemporaryDirectory() as saved:  # as checkpoints store it
        model.save_pretrained(saved, safe_serialization=True)
        tensors = {"mtp.layers.0." + name.removeprefix(prefix): value
                   for name, value in load_file(os.path.join(saved, "model.safetensors")).items()
                   if name.startswith(prefix)}
    h = config.hidden_size
    with torch.no_grad():
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensors[f"mtp.{name}.weight"] = 0.3 * torch.randn(h)  # (1 + w) norms
        tensors["mtp.fc.weight"] = 0.08 * torch.randn(h, 2 * h)
    save_file({name: value.contiguous() for name, value in tensors.items()}, os.path.join(path, "mtp.safetensors"))
    raw = json.load(open(os.path.join(path, "config.json")))
    raw[COUNT_KEYS[raw["model_type"]]] = 1
    json.dump(raw, open(os.path.join(path, "config.json"), "w"))
    return path


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, str]:
    return {family: add_qwen_mtp_layer(save_randomized_model(family, str(tmp_path_factory.mktemp(family)),
                                                             CONFIGS[family](), randomize_vectors))
            for family in COUNT_KEYS}


class Reference:
    """The MTP layer's greedy drafts in float64: transformers' layer L of the model one layer deeper (loaded from the
    checkpoint with the MTP layer as layer L) over positions 0 .. p-1, each the target's final (normed) hidden state
    at j with the token at j + 1, its output normed by `mtp.norm` before the target's LM head, then chained on its
    own drafts and normed outputs."""

    def __init__(self, path: str):
        from safetensors.torch import load_file, save_file

        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, experts_implementation="eager").eval()
        index = self.target.config.num_hidden_layers
        self.mtp = {name: value.double() for name, value in load_file(os.path.join(path, "mtp.safetensors")).items()}
        with tempfile.TemporaryDirectory() as deeper_dir:
            shutil.copy(os.path.join(path, "model.safetensors"), os.path.join(deeper_dir, "model-1.safetensors"))
            layer = {f"model.layers.{index}." + name.removeprefix("mtp.layers.0."): value.float()
                     for name, value in self.mtp.items() if name.startswith("mtp.layers.0.")}
            save_file(layer, os.path.join(deeper_dir, "model-2.safetensors"), metadata={"format": "pt"})
            weight_map = {**dict.fromkeys(load_file(os.path.join(path, "model.safetensors")), "model-1.safetensors"),
                          **dict.fromkeys(layer, "model-2.safetensors")}
            json.dump({"metadata": {}, "weight_map": weight_map},
                      open(os.path.join(deeper_dir, "model.safetensors.index.json"), "w"))
            deeper_config(path).save_pretrained(deeper_dir)
            self.deeper = transformers.AutoModelForCausalLM.from_pretrained(
                deeper_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
        self.layer = self.deeper.model.layers[index]

    def rms(self, x, name):
        eps = self.target.config.rms_norm_eps
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + self.mtp[f"mtp.{name}.weight"])

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The K drafts after `tokens` (the latest at position p = len - 1)."""
        with torch.no_grad():
            hidden = self.target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
            table = self.target.get_input_embeddings().weight
            embeds = table[torch.tensor(tokens[1:])].clone()
            drafts = []
            for _ in range(k):
                x = torch.cat([self.rms(embeds, "pre_fc_norm_embedding"), self.rms(hidden, "pre_fc_norm_hidden")], -1)
                x = x @ self.mtp["mtp.fc.weight"].T
                out = self.rms(causal_layer(self.deeper, self.layer, x), "norm")
                draft = int(torch.argmax(out[-1] @ self.target.lm_head.weight.T))
                drafts.append(draft)
                embeds = torch.cat([embeds, table[draft][None]])
                hidden = torch.cat([hidden, out[-1][None]])
        return drafts


PROMPTS = random_prompts(3, 500, 29, 60, seed=7)
PARAMS = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]


def generate(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def mtp(path: str, disable_by_batch_size: int | None = 3) -> LLM:
    return LLM(path, **OPTIONS, speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": K,
                                                    "disable_by_batch_size": disable_by_batch_size})


def test_drafts_equal_the_float64_reference_and_outputs_equal_plain(targets):
    """Three prompts prefill in chunks of 16; the second stops after 3 tokens, so while all three run the steps
    decode without drafts and the layer catches up after (`disable_by_batch_size` 3). Then a conversation's second
    turn hits the state a verify step saved after its first token (position 63: every decode is a verify here)."""
    path = targets["qwen3_next"]
    llm, plain = mtp(path), LLM(path, **OPTIONS)
    seen = recorded_proposals(llm)
    outputs = generate(llm)
    assert outputs == generate(plain)
    assert len(seen) >= 8
    reference = Reference(path)
    for slot, position, drafts in seen:  # prompt i runs in slot i
        tokens = PROMPTS[slot] + outputs[slot]
        assert drafts == reference.drafts(tokens[:position + 1], K)[:len(drafts)], (slot, position)

    turn = random_prompts(1, 500, 60, 60, seed=3)[0]
    first = engine_greedy(llm, [turn], 10)[0]
    second = turn + first + [5, 6, 7]
    out = llm.generate([{"prompt_token_ids": second}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == engine_greedy(plain, [second], 6)[0]


def test_qwen3_5_reads_mtp_num_hidden_layers_and_missing_tensors_are_refused(targets, tmp_path):
    path = targets["qwen3_5_text"]
    llm = mtp(path, disable_by_batch_size=None)
    assert generate(llm) == generate(LLM(path, **OPTIONS))
    assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0
    broken = shutil.copytree(path, tmp_path / "broken")
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(broken, "mtp.safetensors"))
    del tensors["mtp.fc.weight"]
    save_file(tensors, os.path.join(broken, "mtp.safetensors"))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers 1 but no tensor 'mtp.fc.weight'"):
        mtp(str(broken))

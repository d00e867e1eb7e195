"""gpt-oss checkpoints store their experts as MXFP4 (`{name}_blocks`, `{name}_scales`): checked against
transformers' own dequantization (`convert_moe_packed_tensors`, and the model it loads with
`Mxfp4Config(dequantize=True)`), whole, in every device's slice, and end to end."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxserve import LLM, SamplingParams
from jaxserve.distributed.tensor_parallel import make_mesh
from jaxserve.loading import load_model
from jaxserve.loading.hf_files import read_mxfp4_slice
from tests.conftest import random_prompts

EXPERT_LINEARS = ("gate_up_proj", "down_proj")


def mxfp4_checkpoint(float_dir: str, path: str, seed: int = 0) -> str:
    """`float_dir`'s gpt-oss checkpoint with its experts replaced by random MXFP4 blocks and scales, as the
    published checkpoints store them (and a quantization_config saying so)."""
    shutil.copytree(float_dir, path)
    state = load_file(f"{path}/model.safetensors")
    rng = np.random.default_rng(seed)
    for name in [n for n in state if n.endswith(tuple(f"experts.{linear}" for linear in EXPERT_LINEARS))]:
        experts, fan_in, fan_out = state.pop(name).shape
        state[f"{name}_blocks"] = rng.integers(0, 256, (experts, fan_out, fan_in // 32, 16), dtype=np.uint8)
        state[f"{name}_scales"] = rng.integers(121, 126, (experts, fan_out, fan_in // 32), dtype=np.uint8)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as handle:
        config = json.load(handle)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(f"{path}/config.json", "w") as handle:
        json.dump(config, handle)
    return path


@pytest.fixture(scope="module")
def mxfp4_dir(tiny_model_dirs, tmp_path_factory) -> str:
    return mxfp4_checkpoint(tiny_model_dirs["gpt_oss"], str(tmp_path_factory.mktemp("mxfp4") / "gpt_oss"))


def transformers_dequantized(path: str, name: str) -> np.ndarray:
    """transformers' `[E, in, out]` float32 of MXFP4 tensor `name`."""
    with safe_open(f"{path}/model.safetensors", framework="pt") as reader:
        blocks, scales = reader.get_tensor(f"{name}_blocks"), reader.get_tensor(f"{name}_scales")
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()


@pytest.mark.parametrize("index, columns", [
    ((), None),
    ((slice(1, 3), slice(0, 64), slice(0, 64)), None),  # two experts (expert parallelism)
    ((slice(None), slice(16, 32), slice(None)), None),  # half of one 32-value group (down_proj split by rows)
    ((slice(None), slice(8, 56), slice(None)), None),  # across groups, aligned to neither
    ((slice(None), slice(None), slice(8, 24)), (1, 2)),  # up columns of one device (interleaved gate/up)
    ((slice(0, 1), slice(None), slice(0, 32)), (0, 2)),  # all gate columns of one expert
])
def test_every_slice_dequantizes_as_transformers_does(mxfp4_dir, index, columns):
    name = "model.layers.0.mlp.experts.gate_up_proj"
    expected = transformers_dequantized(mxfp4_dir, name)
    if columns is not None:
        expected = expected[..., columns[0]::columns[1]]
    expected = expected[tuple(index)]
    with safe_open(f"{mxfp4_dir}/model.safetensors", framework="np") as reader:
        ours = read_mxfp4_slice(reader.get_slice(f"{name}_blocks"), reader.get_slice(f"{name}_scales"), index,
                                np.dtype(np.float32), columns)
    np.testing.assert_array_equal(ours, expected)  # FP4 values times powers of two: exact in float32


def test_experts_load_as_transformers_dequantizes_them_on_one_and_two_devices(mxfp4_dir):
    loaded = load_model(mxfp4_dir)
    for layer in range(loaded.config.num_layers):
        experts = loaded.params[f"layers_{layer}"]["mlp"]["experts"]
        gate_up = transformers_dequantized(mxfp4_dir, f"model.layers.{layer}.mlp.experts.gate_up_proj")
        np.testing.assert_array_equal(np.asarray(experts["gate_proj"]["kernel"]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(experts["up_proj"]["kernel"]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(experts["down_proj"]["kernel"]),
                                      transformers_dequantized(mxfp4_dir, f"model.layers.{layer}.mlp.experts.down_proj"))
    for expert_parallel in (False, True):
        split = load_model(mxfp4_dir, mesh=make_mesh(2), expert_parallel=expert_parallel)
        experts, whole = split.params["layers_1"]["mlp"]["experts"], loaded.params["layers_1"]["mlp"]["experts"]
        for linear in ("gate_proj", "up_proj", "down_proj"):
            assert len(experts[linear]["kernel"].sharding.device_set) == 2
            np.testing.assert_array_equal(np.asarray(experts[linear]["kernel"]), np.asarray(whole[linear]["kernel"]))


def test_greedy_tokens_equal_transformers_on_the_mxfp4_checkpoint(mxfp4_dir):
    prompts = random_prompts(2, 500, 10, 30, seed=21)
    llm = LLM(mxfp4_dir, max_num_seqs=2, max_model_len=64, page_size=8, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref

"""AWQ int4 checkpoints (issue 13): AutoAWQ's packing, the loaded 4-bit model against a float model holding the
dequantized weights (logits and greedy tokens, one device and two), no float copy of a weight in the compiled
decode step, and the bad-input errors raised before any weight is read.

No AWQ checkpoint can be downloaded here: each test model is a tiny random HF model RTN-quantized to int4 and
written in AutoAWQ's GEMM format (`loading.awq.write_awq_checkpoint`), next to a float checkpoint of exactly the
weights it holds (its linears dequantized), the reference.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.layers import matmul_blocks
from jaxserve.layers.awq import awq_matmul
from jaxserve.loading import load_model
from jaxserve.loading.awq import (AWQ_ORDER, pack_awq, quantize_rtn_int4, unpack_awq,
                                  write_awq_checkpoint)
from jaxserve.models import fuse_params
from tests.conftest import decode_hlo, save_tiny_model, shard_shapes
from tests.test_model import full_forward_logits

GROUP = 16  # divides 96 and 160, and their halves (two devices split o_proj's and down_proj's input features)
DIMS = dict(hidden_size=96, intermediate_size=160)  # weight shapes that match no activation's
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, warmup=False)
PROMPTS = [[5, 17, 200, 33, 9], list(range(40, 70))]


def build_awq_pair(root: Path, family: str) -> tuple[str, str, str]:
    """`(float model, its AWQ checkpoint, the dequantized float reference)` directories."""
    float_dir = save_tiny_model(family, str(root / "float"), **DIMS)
    state = load_file(str(Path(float_dir) / "model.safetensors"))
    hf_config = json.loads((Path(float_dir) / "config.json").read_text())
    dequantized = write_awq_checkpoint(root / "awq", state, hf_config, GROUP)
    (root / "reference").mkdir()
    save_file(dequantized, str(root / "reference" / "model.safetensors"), metadata={"format": "pt"})
    (root / "reference" / "config.json").write_text(json.dumps(hf_config))
    for file in Path(float_dir).iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            for target in ("awq", "reference"):
                shutil.copy(file, root / target / file.name)
    return float_dir, str(root / "awq"), str(root / "reference")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, str, str]:
    return build_awq_pair(tmp_path_factory.mktemp("awq_llama"), "llama")


def autoawq_pack(values: np.ndarray) -> np.ndarray:
    """AutoAWQ's own packing loop (WQLinear_GEMM.from_linear), column by column."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


def test_packing_is_autoawqs_and_unpacking_recovers_the_ints():
    values = np.random.default_rng(0).integers(0, 16, (5, 64)).astype(np.uint8)
    np.testing.assert_array_equal(pack_awq(values), autoawq_pack(values))
    np.testing.assert_array_equal(unpack_awq(pack_awq(values)), values)
    assert (pack_awq(np.full((1, 8), 15)) == -1).all()  # the sign bit is a nibble like the others


@pytest.mark.parametrize("tp", [1, 2])
def test_loaded_leaves_are_the_checkpoints_ints(llama, tp):
    float_dir, awq_dir, _ = llama
    from jaxserve.distributed.tensor_parallel import make_mesh

    loaded = load_model(awq_dir, mesh=make_mesh(tp))
    w = load_file(str(Path(float_dir) / "model.safetensors"))
    for module, hf in (("attn/k_proj", "self_attn.k_proj"), ("mlp/down_proj", "mlp.down_proj")):
        leaves = loaded.params["layers_1"]
        for part in module.split("/"):
            leaves = leaves[part]
        q, z, s = quantize_rtn_int4(w[f"model.layers.1.{hf}.weight"].T, GROUP)
        assert leaves["kernel"].dtype == jnp.uint4 and leaves["zeros"].dtype == jnp.uint4
        np.testing.assert_array_equal(np.asarray(leaves["kernel"]).astype(np.uint8), q)
        np.testing.assert_array_equal(np.asarray(leaves["zeros"]).astype(np.uint8), z)
        np.testing.assert_array_equal(np.asarray(leaves["scales"]), s.astype(np.float32))
    assert loaded.params["embed"]["embedding"].dtype == jnp.float32


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases and a tied LM head
def test_logits_match_the_dequantized_reference(tmp_path, family):
    float_dir, awq_dir, reference_dir = build_awq_pair(tmp_path, family)
    awq = load_model(awq_dir)
    params = fuse_params(awq.params, awq.config)
    assert params["layers_0"]["attn"]["qkv_proj"]["kernel"].dtype == jnp.uint4
    reference = fuse_params(load_model(reference_dir).params, awq.config)
    floats = fuse_params(load_model(float_dir).params, awq.config)
    for prompt in PROMPTS:
        ours = full_forward_logits(params, awq.config, prompt)
        theirs = full_forward_logits(reference, awq.config, prompt)
        scale = np.abs(theirs).max()
        assert np.abs(ours - theirs).max() / scale < 2e-5, family
        # the reference really is the 4-bit model, not the float one
        assert np.abs(full_forward_logits(floats, awq.config, prompt) - theirs).max() / scale > 1e-3


def test_greedy_tokens_match_the_reference_on_one_device_and_two(llama):
    _, awq_dir, reference_dir = llama
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    expected = tokens(LLM(model=reference_dir, **SMALL))
    one = LLM(model=awq_dir, **SMALL)  # detected from config.json, as vLLM does
    assert one.llm_engine.engine_config.quantization == "awq"
    assert tokens(one) == expected
    two = LLM(model=awq_dir, quantization="awq", tensor_parallel_size=2, **SMALL)
    assert tokens(two) == expected
    layer = two.llm_engine.runner.params["layers_0"]
    qkv, o_proj = layer["attn"]["qkv_proj"], layer["attn"]["o_proj"]
    gate_up, down = layer["mlp"]["gate_up_proj"], layer["mlp"]["down_proj"]
    assert shard_shapes(qkv["kernel"]) == {(96, 96)} and shard_shapes(qkv["scales"]) == {(6, 96)}
    assert shard_shapes(gate_up["kernel"]) == {(96, 160)} and shard_shapes(gate_up["zeros"]) == {(6, 160)}
    assert shard_shapes(o_proj["kernel"]) == {(48, 96)} and shard_shapes(o_proj["scales"]) == {(3, 96)}
    assert shard_shapes(down["kernel"]) == {(80, 96)} and shard_shapes(down["zeros"]) == {(5, 96)}


def float_weight_buffers(hlo: str, params: dict) -> list[str]:
    """Float arrays in `hlo` as large as a whole 4-bit kernel and with its output features as a dimension."""
    kernels = [leaf.shape for leaf in jax.tree.leaves(params) if leaf.dtype == jnp.uint4 and leaf.shape[0] > 16]
    found = []
    for dtype, dims in re.findall(r"\b(f32|bf16|f16)\[([\d,]+)\]", hlo):
        shape = tuple(int(d) for d in dims.split(","))
        if any(np.prod(shape) == rows * cols and cols in shape for rows, cols in kernels):
            found.append(f"{dtype}[{dims}]")
    return found


def test_decode_step_never_materializes_a_float_weight(llama, monkeypatch):
    _, awq_dir, _ = llama
    # blocks of a real model's size (1 MiB of float) would hold a tiny model's whole weights
    monkeypatch.setattr(matmul_blocks, "BLOCK_BYTES", (16 * 1024, 16 * 1024))
    llm = LLM(model=awq_dir, **SMALL)
    params = llm.llm_engine.runner.params
    for rows in (1, 4):
        assert float_weight_buffers(decode_hlo(llm, rows), params) == []
    # the check sees the bug it is for: on XLA:CPU the plain dequantize-then-dot writes a float copy of the weight
    monkeypatch.setattr(matmul_blocks, "blocked_matmuls", lambda: False)
    unblocked = LLM(model=awq_dir, **SMALL)
    assert len(float_weight_buffers(decode_hlo(unblocked, 1), params)) >= 4


@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("block_bytes", [1024, 4096, 1 << 20])  # part of a group, one group, several per block
def test_blocked_matmul_matches_numpy(shards, block_bytes, monkeypatch):
    monkeypatch.setattr(matmul_blocks, "BLOCK_BYTES", (block_bytes, block_bytes))
    rng = np.random.default_rng(shards)
    q, z = rng.integers(0, 16, (128, 48)), rng.integers(0, 16, (8, 48))
    s = rng.random((8, 48)).astype(np.float32)
    x = rng.standard_normal((3, 2, 128)).astype(np.float32)
    ours = awq_matmul(jnp.asarray(x), jnp.asarray(q.astype(ml_dtypes.uint4)), jnp.asarray(z.astype(ml_dtypes.uint4)),
                      jnp.asarray(s), in_shards=shards)
    np.testing.assert_allclose(ours, x @ ((q - np.repeat(z, 16, 0)) * np.repeat(s, 16, 0)), rtol=1e-5, atol=1e-3)


def config_only_copy(source: str, target: Path, **quantization_config) -> str:
    """A directory with `source`'s config.json only (its quantization_config updated) and no weights: a check
    that passes on it would fail on reading the weights instead."""
    config = json.loads((Path(source) / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **quantization_config}
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_bad_input_is_a_value_error_before_any_weight_is_read(llama, tmp_path):
    float_dir, awq_dir, _ = llama
    with pytest.raises(ValueError, match=r"quantization='awq' needs an AutoAWQ checkpoint.*no quantization_config"):
        EngineConfig(model=float_dir, quantization="awq").resolve(2048)
    with pytest.raises(ValueError, match=r"quantization='awq' needs an AutoAWQ checkpoint.*default model"):
        EngineConfig(quantization="awq").resolve(2048)
    with pytest.raises(ValueError, match=r"quantization='int8' does not match .* AutoAWQ checkpoint"):
        EngineConfig(model=awq_dir, quantization="int8").resolve(2048)
    with pytest.raises(ValueError, match=r"quantization='awq' needs an AutoAWQ checkpoint"):
        load_model(float_dir, quantization="awq")
    odd_group = config_only_copy(awq_dir, tmp_path / "group64", group_size=64)
    with pytest.raises(ValueError, match=r"group_size 64 does not divide hidden_size .* = 96"):
        EngineConfig(model=odd_group).resolve(2048)
    with pytest.raises(ValueError, match=r"group_size 64 does not divide hidden_size"):
        load_model(odd_group)
    split_group = config_only_copy(awq_dir, tmp_path / "group32", group_size=32)
    EngineConfig(model=split_group).resolve(2048)  # 32 divides 96 and 160 ...
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: q_size .* = 96 split 2 ways is not whole groups"):
        EngineConfig(model=split_group, tensor_parallel_size=2).resolve(2048)  # ... but not their halves
    with pytest.raises(ValueError, match=r"4-bit GEMM .*'bits': 8"):
        EngineConfig(model=config_only_copy(awq_dir, tmp_path / "bits8", bits=8)).resolve(2048)
    with pytest.raises(ValueError, match=r"4-bit GEMM .*'version': 'gemv'"):
        EngineConfig(model=config_only_copy(awq_dir, tmp_path / "gemv", version="gemv")).resolve(2048)
    with pytest.raises(ValueError, match=r"quant_method 'gptq'.*cannot load"):
        EngineConfig(model=config_only_copy(awq_dir, tmp_path / "gptq", quant_method="gptq")).resolve(2048)

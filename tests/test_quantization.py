"""Weight-only int8 (issue 13): quantization against numpy, the int8 model's logits against a model run on weights
dequantized in numpy, no float copy of a weight in the compiled decode step, tensor parallelism, bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.config import EngineConfig
from jaxserve.layers import matmul_blocks, quant_dense
from jaxserve.layers.quant_dense import is_quantized, quantize_params
from jaxserve.loading import load_model
from jaxserve.models import fuse_params
from tests.conftest import decode_hlo, save_tiny_model, shard_shapes
from tests.test_model import full_forward_logits

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SMALL = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, warmup=False)
PROMPTS = [[5, 17, 200, 33, 9], list(range(40, 70))]


@pytest.fixture(scope="module")
def odd_dims_dir(tmp_path_factory) -> str:
    """A tiny Llama whose weight shapes match no activation's (so the HLO check cannot confuse them)."""
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("int8") / "llama"), hidden_size=96,
                           intermediate_size=160)


def numpy_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(w).max(axis=axis) / 127.0
    return np.clip(np.round(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8), scale


def dequantized_in_numpy(float_params: dict) -> dict:
    """The float serving tree with every kernel and the embedding replaced by numpy's int8 round trip."""
    def walk(tree):
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict) and "kernel" in value:
                q, scale = numpy_int8(np.asarray(value["kernel"]), axis=0)
                out[name] = {**value, "kernel": jnp.asarray(q.astype(np.float32) * scale[None, :])}
            elif isinstance(value, dict) and "embedding" in value:
                q, scale = numpy_int8(np.asarray(value["embedding"]), axis=1)
                out[name] = {**value, "embedding": jnp.asarray(q.astype(np.float32) * scale[:, None])}
            else:
                out[name] = walk(value) if isinstance(value, dict) else value
        return out
    return walk(float_params)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # an untied LM head and a tied one (the int8 embedding)
def test_int8_logits_match_a_reference_dequantized_in_numpy(tiny_model_dirs, family):
    loaded = load_model(tiny_model_dirs[family])
    params = fuse_params(loaded.params, loaded.config)
    quantized = quantize_params(params)
    qkv = quantized["layers_0"]["attn"]["qkv_proj"]
    assert qkv["kernel"].dtype == jnp.int8 and qkv["scale"].shape == (qkv["kernel"].shape[1],)
    assert quantized["embed"]["embedding"].dtype == jnp.int8
    np.testing.assert_array_equal(qkv["kernel"], numpy_int8(np.asarray(params["layers_0"]["attn"]["qkv_proj"]
                                                                       ["kernel"]), 0)[0])
    reference = dequantized_in_numpy(params)
    for prompt in PROMPTS:
        ours = full_forward_logits(quantized, loaded.config, prompt)
        theirs = full_forward_logits(reference, loaded.config, prompt)
        floats = full_forward_logits(params, loaded.config, prompt)
        scale = np.abs(theirs).max()
        assert np.abs(ours - theirs).max() / scale < 2e-5, family
        assert np.abs(floats - theirs).max() / scale > 1e-4  # the reference really is the quantized model


def float_weight_buffers(hlo: str, params: dict) -> list[str]:
    """Float arrays in `hlo` with the shape of a whole int8 weight (either orientation)."""
    found = []
    for leaf in jax.tree.leaves(params):
        if leaf.dtype == jnp.int8:
            for rows, cols in (leaf.shape, leaf.shape[::-1]):
                found += re.findall(rf"(?:f32|bf16|f16)\[{rows},{cols}\]", hlo)
    return found


def test_decode_step_never_materializes_a_float_weight(odd_dims_dir, monkeypatch):
    # blocks of a real model's size (1 MiB of float) would hold a tiny model's whole weights
    monkeypatch.setattr(matmul_blocks, "BLOCK_BYTES", (16 * 1024, 16 * 1024))
    llm = LLM(model=odd_dims_dir, quantization="int8", **SMALL)
    params = llm.llm_engine.runner.params
    assert is_quantized(params) and params["embed"]["embedding"].dtype == jnp.int8
    for rows in (1, 4):
        assert float_weight_buffers(decode_hlo(llm, rows), params) == []
    # the check sees the bug it is for: on XLA:CPU a plain convert-then-dot writes a float copy of the weight
    monkeypatch.setattr(matmul_blocks, "blocked_matmuls", lambda: False)
    unblocked = LLM(model=odd_dims_dir, quantization="int8", **SMALL)
    assert len(float_weight_buffers(decode_hlo(unblocked, 1), params)) >= 5


def test_int8_on_two_devices_matches_one_and_splits_the_scales(odd_dims_dir):
    one = LLM(model=odd_dims_dir, quantization="int8", **SMALL)
    two = LLM(model=odd_dims_dir, quantization="int8", tensor_parallel_size=2, **SMALL)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)] == tokens
    params = two.llm_engine.runner.params
    layer = params["layers_0"]
    qkv, o_proj = layer["attn"]["qkv_proj"], layer["attn"]["o_proj"]
    gate_up, down = layer["mlp"]["gate_up_proj"], layer["mlp"]["down_proj"]
    assert shard_shapes(qkv["kernel"]) == {(96, 96)} and shard_shapes(qkv["scale"]) == {(96,)}
    assert shard_shapes(gate_up["kernel"]) == {(96, 160)} and shard_shapes(gate_up["scale"]) == {(160,)}
    assert shard_shapes(o_proj["kernel"]) == {(48, 96)} and shard_shapes(o_proj["scale"]) == {(96,)}
    assert shard_shapes(down["kernel"]) == {(80, 96)} and shard_shapes(down["scale"]) == {(96,)}
    assert shard_shapes(params["embed"]["embedding"]) == {(256, 96)}
    assert shard_shapes(params["embed"]["scale"]) == {(256,)}
    assert shard_shapes(params["lm_head"]["scale"]) == {(256,)}


def test_int8_tied_lm_head_on_two_devices_matches_one(tiny_model_dirs):
    """Qwen2's LM head is its int8 embedding table: split on the vocabulary with its per-row scales."""
    one = LLM(model=tiny_model_dirs["qwen2"], quantization="int8", **SMALL)
    two = LLM(model=tiny_model_dirs["qwen2"], quantization="int8", tensor_parallel_size=2, **SMALL)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)] == tokens
    params = two.llm_engine.runner.params
    assert "lm_head" not in params and params["embed"]["embedding"].dtype == jnp.int8
    assert shard_shapes(params["embed"]["embedding"]) == {(256, 64)} and shard_shapes(params["embed"]["scale"]) == {
        (256,)}


def test_an_unknown_quantization_is_a_value_error():
    with pytest.raises(ValueError, match="quantization must be one of .*'int8'.*got 'int4'"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_blocked_matmuls_match_numpy_for_any_device_split(shards, monkeypatch):
    """The CPU loop's block and device-axis bookkeeping (a row-parallel kernel, a vocabulary-split tied LM head)."""
    monkeypatch.setattr(matmul_blocks, "BLOCK_BYTES", (4 * 1024, 4 * 1024))  # several blocks per device
    rng = np.random.default_rng(shards)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    kernel = rng.integers(-127, 128, (64, 48)).astype(np.int8)
    table = rng.integers(-127, 128, (96, 64)).astype(np.int8)
    scale_out, scale_vocab = rng.random(48).astype(np.float32), rng.random(96).astype(np.float32)
    ours = quant_dense.int8_matmul(jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(scale_out), in_shards=shards)
    np.testing.assert_allclose(ours, x @ (kernel * scale_out), rtol=1e-5, atol=1e-4)
    ours = quant_dense.int8_matmul_transposed(jnp.asarray(x), jnp.asarray(table), jnp.asarray(scale_vocab),
                                              out_shards=shards)
    np.testing.assert_allclose(ours, x @ (table * scale_vocab[:, None]).T, rtol=1e-5, atol=1e-4)

"""Block-scaled FP8 weights (`layers/fp8.py`): the matmul against a float64 reference, and `quantization="fp8"` on a
float checkpoint against transformers on the FP8-rounded weights (block-scaled FP8 checkpoints: test_deepseek.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.layers import fp8
from tests.conftest import random_prompts, save_tiny_model


@pytest.mark.parametrize("blocked", [True, False], ids=["cpu-block-loop", "fused-dequantize"])
@pytest.mark.parametrize("in_shards", [1, 2])
def test_fp8_matmul_matches_a_float64_reference(monkeypatch, blocked, in_shards):
    """Fresh random values and scales, a different scale per block: the CPU's loop over blocks of input rows (each
    device's rows apart) and the expression the accelerators fuse both give x @ (kernel * scale)."""
    monkeypatch.setattr(fp8.matmul_blocks, "blocked_matmuls", lambda: blocked)
    rng = np.random.default_rng()
    fan_in, fan_out, block = 256, 96, (32, 16)
    x = rng.standard_normal((5, fan_in)).astype(np.float32)
    kernel = jnp.asarray(rng.standard_normal((fan_in, fan_out)), fp8.FP8)
    scale = rng.uniform(0.1, 4.0, (fan_in // block[0], fan_out // block[1])).astype(np.float32)
    ours = jax.jit(fp8.fp8_matmul, static_argnums=3)(jnp.asarray(x), kernel, jnp.asarray(scale), in_shards)
    weight = np.asarray(kernel, np.float64) * np.repeat(np.repeat(scale.astype(np.float64), block[0], 0), block[1], 1)
    expected = x.astype(np.float64) @ weight
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_quantize_fp8_rounds_each_block_by_its_own_scale():
    """Each block's largest magnitude maps to 448 (e4m3's largest), an all-zero block gets scale 1, and the
    dequantized weight is within e4m3's rounding (3 mantissa bits: half of 2^-3 relative) of the original."""
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 128)).astype(np.float32) * np.array([1.0, 100.0], np.float32).repeat(64)
    w[:128, :64] = 0.0
    q, scale = fp8.quantize_fp8(jnp.asarray(w), (128, 64))
    assert q.dtype == fp8.FP8 and scale.shape == (2, 2) and float(scale[0, 0]) == 1.0
    np.testing.assert_allclose(np.asarray(scale[1]), np.abs(w[128:]).reshape(128, 2, 64).max((0, 2)) / 448,
                               rtol=1e-6)
    back = np.asarray(fp8.dequantize(q, scale, jnp.float32))
    np.testing.assert_allclose(back, w, rtol=2 ** -4, atol=2 ** -9 * float(scale.max()))


def fp8_rounded(path: str, reference: str) -> None:
    """The float checkpoint `path` with every decoder linear's weight replaced by its FP8 value in 128 x 128
    blocks (what `quantization="fp8"` serves, when the blocks stay inside each fused projection), into
    `reference`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                kernel = jnp.asarray(param.numpy().T)
                rounded = fp8.dequantize(*fp8.quantize_fp8(kernel), jnp.float32)
                param.copy_(torch.from_numpy(np.asarray(rounded).T.copy()))
    model.save_pretrained(reference, safe_serialization=True)


def test_quantization_fp8_serves_a_float_checkpoint_as_its_fp8_rounding(tmp_path):
    """Head size 128, so q, k and v each fill whole blocks of every device's fused columns: the greedy tokens on
    one and two devices (KV head replicated) equal transformers' on the FP8-rounded weights, and the decoder's
    linears are FP8 (the embedding and LM head float, as vLLM keeps them)."""
    path = save_tiny_model("llama", str(tmp_path / "model"), hidden_size=256, intermediate_size=512,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    reference = str(tmp_path / "reference")
    fp8_rounded(path, reference)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 500, 8, 30, seed=2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    expected, expected_logprobs = [], []
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expected.append(out.sequences[0, len(ids):].tolist())
        expected_logprobs.append([torch.log_softmax(step[0], -1)[token].item()
                                  for step, token in zip(out.logits, expected[-1])])
    for tp in (1, 2):
        llm = LLM(path, quantization="fp8", tensor_parallel_size=tp, max_model_len=128, warmup=False)
        outputs = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
        tokens = [out.token_ids for out in outputs]
        logprobs = [[step[token] for step, token in zip(out.logprobs, out.token_ids)] for out in outputs]
        served = llm.llm_engine.runner.params
        assert served["layers_0"]["attn"]["qkv_proj"]["kernel"].dtype == fp8.FP8
        assert served["layers_0"]["mlp"]["down_proj"]["block_scale"].shape == (4, 2)
        assert served["embed"]["embedding"].dtype == jnp.float32
        assert tokens == expected, tp
        # the unrounded weights give other tokens here, and logprobs up to 1.1 apart
        np.testing.assert_allclose(np.asarray(logprobs), np.asarray(expected_logprobs), atol=2e-4)

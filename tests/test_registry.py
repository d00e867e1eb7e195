"""The model registry: model types, per-layer specs read from Hugging Face configs, the checkpoint sources."""

from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest
import transformers

from jaxserve.config import LayerSpec, ModelConfig
from jaxserve.loading import hf, load_model
from jaxserve.models import SUPPORTED_MODEL_TYPES, TensorSource, config_from_hf, model_spec
from jaxserve.models.hf_config import layer_windows
from tests.conftest import TINY_DIMS, tiny_hf_config


def test_supported_model_types_are_the_llama_family_and_its_relatives():
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2", "qwen2_moe",
                                     "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3",
                                     "gpt_oss", "deepseek_v3", "deepseek_v2", "glm4_moe",
                                     "minimax_m2", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5",
                                     "qwen3_5_moe", "gemma4_text", "gemma4", "qwen2_5_vl", "qwen3_vl")
    assert len({id(model_spec(model_type)) for model_type in SUPPORTED_MODEL_TYPES}) == 16


def test_an_unsupported_model_type_is_a_value_error_listing_the_supported_ones_before_any_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 8}))
    listed = (r"model_type 'falcon' is not supported; jaxserve serves llama, mistral, qwen2, qwen3, smollm, "
              r"smollm2, qwen2_moe, qwen3_moe, mixtral, gemma, gemma2, gemma3_text, gemma3, phi3, gpt_oss, deepseek_v3, "
              r"deepseek_v2, glm4_moe, minimax_m2, qwen3_next, qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe, "
              r"gemma4_text, gemma4")
    with pytest.raises(ValueError, match=listed):
        load_model(str(tmp_path))  # no weights in the directory: the error comes first
    with pytest.raises(ValueError, match=listed):
        config_from_hf(types.SimpleNamespace(model_type="falcon"))


def test_sliding_windows_per_layer():
    qwen2 = dict(TINY_DIMS, sliding_window=16, max_window_layers=1)
    assert config_from_hf(tiny_hf_config("mistral")).layer_sliding_windows == (16, 16)  # applies directly
    assert config_from_hf(transformers.Qwen2Config(**qwen2, use_sliding_window=False)).layer_sliding_windows == (
        None, None)
    assert config_from_hf(transformers.Qwen2Config(**qwen2, use_sliding_window=True)).layer_sliding_windows == (
        None, 16)
    assert config_from_hf(tiny_hf_config("llama")).layer_sliding_windows == (None, None)
    # a config with layer types and no use_sliding_window flag (as Gemma's) is read by its layer types
    gemma_like = types.SimpleNamespace(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    assert layer_windows(gemma_like, 4) == [4, None, 4, None]
    # an HF config whose window is off but still spelled out (older transformers kept Qwen2's 4096)
    assert layer_windows(types.SimpleNamespace(sliding_window=4096, use_sliding_window=False,
                                               layer_types=["sliding_attention"]), 1) == [None]


def test_every_layer_carries_its_rope():
    config = config_from_hf(tiny_hf_config("llama"))
    assert all(layer == LayerSpec(None, config.rope_theta, config.rope_scaling) for layer in config.layers)
    assert dict(config.rope_scaling)["rope_type"] == "llama3"


def test_a_store_config_from_before_layer_specs_still_reads():
    config = config_from_hf(tiny_hf_config("mistral"))
    assert ModelConfig.from_json(config.to_json()) == config
    old = json.loads(config.to_json())
    old["layer_sliding_windows"] = [layer["sliding_window"] for layer in old.pop("layers")]
    del old["attn_logit_softcap"]
    assert ModelConfig.from_json(json.dumps(old)) == config


def test_a_parameter_stacked_from_several_tensors(tmp_path, monkeypatch):
    """A `TensorSource` of several names (one tensor per expert) loads stacked on a new leading axis, each device
    reading its own experts, from safetensors and from a state dict alike."""
    from safetensors.numpy import save_file

    from jaxserve.distributed.tensor_parallel import make_mesh

    rng = np.random.default_rng(0)
    state = {f"experts.{e}.weight": rng.standard_normal((3, 2)).astype(np.float32) for e in range(4)}
    save_file(state, str(tmp_path / "model.safetensors"))
    source = TensorSource(tuple(state), transposed=True)
    monkeypatch.setattr(hf, "checkpoint_sources", lambda config: {"w": source})
    monkeypatch.setattr(hf, "checkpoint_shapes", lambda config, dtype=np.float32: {
        "w": jax.ShapeDtypeStruct((4, 2, 3), dtype)})
    expected = np.stack([w.T for w in state.values()])
    np.testing.assert_array_equal(hf.convert_hf_state_dict(state, None)["w"], expected)
    mesh = make_mesh(2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    loaded = hf.load_hf_params(str(tmp_path), None, {"w": sharding}, np.float32)["w"]
    assert [shard.data.shape for shard in loaded.addressable_shards] == [(2, 2, 3)] * 2
    np.testing.assert_array_equal(np.asarray(loaded), expected)


def test_mixture_of_experts_configs_their_sparse_layers_and_a_store_round_trip():
    from jaxserve.config import MoEConfig

    qwen2 = tiny_hf_config("qwen2_moe", num_hidden_layers=4)
    qwen2.decoder_sparse_step, qwen2.mlp_only_layers = 2, [3]  # HF: sparse when (i + 1) % step == 0, unless listed
    config = config_from_hf(qwen2)
    assert [layer.feed_forward for layer in config.layers] == ["dense", "moe", "dense", "dense"]
    assert config.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, normalize_top_k=False,
                                   shared_expert_size=48)
    assert config.qkv_bias and not config.qk_norm
    assert ModelConfig.from_json(config.to_json()) == config
    mixtral = config_from_hf(tiny_hf_config("mixtral"))
    assert all(layer.feed_forward == "moe" and layer.sliding_window == 16 for layer in mixtral.layers)
    assert mixtral.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=32, normalize_top_k=True)
    qwen3 = config_from_hf(tiny_hf_config("qwen3_moe"))
    assert qwen3.qk_norm and qwen3.moe.normalize_top_k and qwen3.moe.shared_expert_size == 0
    gelu = tiny_hf_config("qwen3_moe")
    gelu.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        config_from_hf(gelu)
    too_many = tiny_hf_config("mixtral")
    too_many.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and the number of experts \\(4\\)"):
        config_from_hf(too_many)


def test_expert_tensors_are_read_stacked_by_their_family_names():
    mixtral = config_from_hf(tiny_hf_config("mixtral"))
    source = model_spec("mixtral").checkpoint_source("layers_1/mlp/experts/up_proj/kernel", mixtral)
    assert source.names == tuple(f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight" for e in range(4))
    assert source.transposed
    assert model_spec("mixtral").checkpoint_source("layers_0/mlp/router/kernel", mixtral).names == (
        "model.layers.0.block_sparse_moe.gate.weight",)
    qwen2 = config_from_hf(tiny_hf_config("qwen2_moe"))
    spec = model_spec("qwen2_moe")
    assert spec.checkpoint_source("layers_0/mlp/shared_expert_gate/kernel", qwen2).names == (
        "model.layers.0.mlp.shared_expert_gate.weight",)
    assert spec.checkpoint_source("layers_1/mlp/down_proj/kernel", qwen2).names == (
        "model.layers.1.mlp.down_proj.weight",)  # the dense layer (mlp_only_layers)


def test_phi3_projections_are_row_slices_of_its_fused_tensors_on_every_device(tiny_model_dirs):
    """q/k/v and gate/up read as rows of qkv_proj and gate_up_proj; split over 2 devices, each device reads its
    slice of those rows, and the loaded values are the one-device ones."""
    from jaxserve.distributed.tensor_parallel import make_mesh
    from tests.conftest import shard_shapes

    path = tiny_model_dirs["phi3"]
    config = config_from_hf(transformers.AutoConfig.from_pretrained(path))
    source = model_spec("phi3").checkpoint_source("layers_1/attn/k_proj/kernel", config)
    assert source == TensorSource(("model.layers.1.self_attn.qkv_proj.weight",), True,
                                  rows=(config.q_size, config.q_size + config.kv_size))
    assert model_spec("phi3").checkpoint_source("layers_0/mlp/up_proj/kernel", config).rows == (
        config.intermediate_size, 2 * config.intermediate_size)
    one, two = load_model(path).params, load_model(path, mesh=make_mesh(2)).params
    for name in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_array_equal(np.asarray(two["layers_0"]["attn"][name]["kernel"]),
                                      np.asarray(one["layers_0"]["attn"][name]["kernel"]))
    up = two["layers_1"]["mlp"]["up_proj"]["kernel"]
    assert shard_shapes(up) == {(config.hidden_size, config.intermediate_size // 2)}
    np.testing.assert_array_equal(np.asarray(up), np.asarray(one["layers_1"]["mlp"]["up_proj"]["kernel"]))
    with pytest.raises(ValueError, match="rope_type 'longrope' needs rope parameter 'long_factor'"):
        config_from_hf(types.SimpleNamespace(**{**transformers.AutoConfig.from_pretrained(path).to_dict(),
                                                "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                                    "original_max_position_embeddings": 64}}))

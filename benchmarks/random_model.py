"""Random-weight stand-ins of published models, for timing where their weights are absent.

`write_config(path, "llama-3.1-8b")` writes a directory holding only the config.json of a named shape (the
published config's numbers); the engine serves it with `load_format="dummy"` (`jaxserve/loading/dummy.py`), which
draws the weights in the serving dtype on the devices with the engine's own shardings, so an 8B model's 16 GB
never travel and no file but the config is needed. The directory has no tokenizer (the shapes' vocabularies are
not the default model's): prompts are token ids, and outputs are token ids with empty text. Only speed can be
measured on such a model, never output quality.

`build` (torch and transformers) instead writes a real HF checkpoint with HF's random initialization, for code
that must read weight files (the load path, the transformers baseline). `DEFAULT_MODEL_SHAPES` is what
SmolLM2-135M-Instruct's GGUF describes; a test checks the two agree.

    python benchmarks/random_model.py /tmp/llama-8b --shape llama-3.1-8b
    python -c "from jaxserve import LLM; LLM('/tmp/llama-8b', load_format='dummy')"
    python benchmarks/random_model.py /tmp/smollm2-random --checkpoint       # HF weights (torch)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

DEFAULT_MODEL_SHAPES: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True)
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
# the config.json fields of published models (their Hugging Face configs), as architectures jaxserve serves
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], **DEFAULT_MODEL_SHAPES),
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(factor=32.0, **LLAMA3_ROPE), tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001),
    "llama-3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(factor=8.0, **LLAMA3_ROPE), tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001),
    "qwen2.5-7b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        sliding_window=None, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(  # q/k norms
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        attention_bias=False, sliding_window=None, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151645),
    "qwen3-30b-a3b": dict(  # 128 experts of 768, 8 per token: 30.5B parameters, 3.3B active
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
        sliding_window=None, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-next-80b-a3b": dict(  # 3 Gated DeltaNet layers per gated full-attention one; 512 experts of 512, 10 per
        # token and a shared expert: 80B parameters, 3B active
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
        num_experts_per_tok=10, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, partial_rotary_factor=0.25, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_theta=10000000.0, tie_word_embeddings=False, attention_bias=False, bos_token_id=151643,
        eos_token_id=151645, num_nextn_predict_layers=1),  # its one MTP layer (`mtp.*`)
    "gemma-4-31b": dict(  # 50 sliding layers (16 KV heads of 256, window 1024), 10 global ones (4 KV heads of 512,
        # values from keys); the published config's numbers as third-party model cards give them (no hub here)
        model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=262144, hidden_size=5376,
        intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
        global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
        hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0, num_kv_shared_layers=0,
        final_logit_softcapping=30.0, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1),
    "mixtral-8x7b": dict(  # 8 experts of 14336, 2 per token: 46.7B parameters, 12.9B active
        model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2),
    "gpt-oss-20b": dict(  # 32 experts of 2880, 4 per token, attention sinks: 20.9B parameters, 3.6B active + embedding
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                             rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
    "gemma-3-27b": dict(  # the text decoder: 5 sliding (1024) layers per global one, a rope per layer type
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=5376,
        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, query_pre_attn_scalar=168, max_position_embeddings=131072, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
        rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                             full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)),
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=[1, 106]),
    "qwen2.5-vl-7b": dict(  # Qwen2's decoder with M-RoPE; a 32-block vision tower of 1280 (window attention but in
        # blocks 7, 15, 23, 31) merging 2x2 patches of 14 pixels into one token
        model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24]), sliding_window=32768, use_sliding_window=False,
        tie_word_embeddings=False, vision_start_token_id=151652, vision_end_token_id=151653,
        image_token_id=151655, video_token_id=151656, bos_token_id=151643, eos_token_id=151645,
        vision_config=dict(depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16,
                           in_channels=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                           window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                           temporal_patch_size=2)),
}


def shape_config(shape: str, **overrides: Any) -> dict[str, Any]:
    """The config.json content of the named shape with `overrides` (e.g. `num_hidden_layers=2`)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    unknown = set(overrides) - {*SHAPES[shape], "num_hidden_layers", "vocab_size", "max_position_embeddings"}
    if unknown:
        raise ValueError(f"cannot override {sorted(unknown)} of shape {shape!r}")
    return {"hidden_act": "silu", **SHAPES[shape], "torch_dtype": "bfloat16", **overrides}


def write_config(path: str | Path, shape: str, **overrides: Any) -> str:
    """Writes directory `path` holding only the named shape's config.json; serve it with `load_format="dummy"`."""
    config = shape_config(shape, **overrides)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(directory)


def build(path: str, seed: int = 0, **overrides: Any) -> str:
    """Writes a `LlamaForCausalLM` with HF's random initialization (and `overrides` of the default model's
    shapes) to `path`: weight files, for code that reads them."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**DEFAULT_MODEL_SHAPES, **overrides})
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="directory to write to")
    parser.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES), help="the published model's shape")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer (or more) decoder layers than published")
    parser.add_argument("--checkpoint", action="store_true",
                        help="write HF weights with torch (default model's shapes only) instead of a config alone")
    parser.add_argument("--seed", type=int, default=0, help="--checkpoint's seed")
    args = parser.parse_args(argv)
    layers = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    if args.checkpoint:
        if args.shape != "smollm2-135m":
            parser.error("--checkpoint writes the default model's shapes only")
        path = build(args.path, args.seed, **layers)
        print(f"random-weight checkpoint with the default model's shapes: {path}")
        return path
    path = write_config(args.path, args.shape, **layers)
    print(f"{args.shape} config (no weights, no tokenizer): {path}; serve it with load_format='dummy'")
    return path


if __name__ == "__main__":
    main()

"""One-time conversion of a llama.cpp GGUF file: dequantized weights in HF naming, an HF config, and a tokenizer.

No torch: weights are dequantized by the `gguf` package, the tokenizer is rebuilt from the GGUF
metadata with transformers' torch-free GGUF tokenizer builders.
"""

from __future__ import annotations

import numpy as np

GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves in q/k rows; HF keeps them as two halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(reader):
    """The transformers `LlamaConfig` that a Llama-architecture GGUF file's metadata describes (no tensors read)."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; jaxserve converts 'llama' GGUF files")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return LlamaConfig(
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def read_gguf(path: str):
    """`(hf_config, state_dict, tokenizer)` for a Llama-architecture GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    hf_config = gguf_hf_config(reader)
    num_heads, num_kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads

    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weight = weight.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # GGUF lists dims innermost first
        base, kind = tensor.name.rsplit(".", 1)
        parts = base.split(".")
        if parts[0] == "blk":
            layer, local = int(parts[1]), parts[2]
            if local not in GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
            if local == "attn_q" and kind == "weight":
                weight = undo_rope_permutation(weight, num_heads)
            elif local == "attn_k" and kind == "weight":
                weight = undo_rope_permutation(weight, num_kv_heads)
            state[f"model.layers.{layer}.{GGUF_LAYER_NAMES[local]}.{kind}"] = weight
        elif base in GGUF_GLOBAL_NAMES:
            state[f"{GGUF_GLOBAL_NAMES[base]}.{kind}"] = weight
        elif base != "rope_freqs":
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
    return hf_config, state, build_tokenizer(reader, "llama")


def build_tokenizer(reader, arch: str):
    """A `PreTrainedTokenizerFast` (with the chat template) from the GGUF's tokenizer metadata."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    tokenizer_dict, tokenizer_config = {}, {}
    for group, target in (("tokenizer", tokenizer_dict), ("tokenizer_config", tokenizer_config)):
        for key, name in GGUF_TOKENIZER_MAPPING[group].items():
            value = _field(reader, f"tokenizer.{key}")
            if value is not None:
                target[name] = value
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    tokens = tokenizer_dict["tokens"]

    def token(key: str):
        index = tokenizer_dict.get(key)
        return tokens[index] if index is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unk_token_id"),
        pad_token=token("pad_token_id"),
        chat_template=tokenizer_config.get("chat_template"),
        add_bos_token=bool(tokenizer_config.get("add_bos_token", False)),
        add_eos_token=bool(tokenizer_config.get("add_eos_token", False)),
    )

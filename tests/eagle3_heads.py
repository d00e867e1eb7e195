"""EAGLE-3 heads with random weights for the tests, in the published format, and a reference of what a head proposes
(torch, float64) from transformers' hidden states of the target."""

from __future__ import annotations

import functools

import numpy as np

from jaxserve.spec_decode.eagle3 import Eagle3Config, checkpoint_shapes, default_aux_layers, write_checkpoint


def head_hf_config(target_config, draft_vocab_size: int | None = None, aux_layers=None, **overrides) -> dict:
    """A head's config.json for the transformers `target_config` (its sizes; one layer)."""
    config = {"hidden_size": target_config.hidden_size, "intermediate_size": 96,
              "num_attention_heads": target_config.num_attention_heads,
              "num_key_value_heads": target_config.num_key_value_heads, "vocab_size": target_config.vocab_size,
              "rms_norm_eps": 1e-5, "max_position_embeddings": target_config.max_position_embeddings,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "draft_vocab_size": draft_vocab_size or target_config.vocab_size, **overrides}
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    return config


def save_eagle3_head(path: str, target_config, seed: int = 0, own_embedding: bool = False,
                     drop: tuple[str, ...] = (), **config_options) -> str:
    """A random head for `target_config` at `path`: weights of scale 0.1, norms around 1, and a draft vocabulary
    (`draft_vocab_size`) of every k-th target id when smaller than the target's."""
    from transformers import LlamaConfig

    hf_config = head_hf_config(target_config, **config_options)
    layers = hf_config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(
        target_config.num_hidden_layers)
    from jaxserve.models import llama

    layer = llama.parse_config(LlamaConfig(**{**hf_config, "num_hidden_layers": 1}))
    config = Eagle3Config(layer, hf_config["draft_vocab_size"], tuple(layers), target_config.hidden_size,
                          own_embedding=own_embedding)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        if name == "d2t":
            step = target_config.vocab_size // shape[0]
            tensors[name] = (np.arange(shape[0]) * step - np.arange(shape[0])).astype(np.int64)
        elif len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    for name in drop:
        del tensors[name]
    write_checkpoint(path, tensors, hf_config)
    return path


def reference_drafts(target_dir: str, head_dir: str, tokens: list[int], k: int) -> list[int]:
    """The head's K greedy drafts after `tokens` (the latest at position p = len - 1), in float64 from the
    checkpoints: the head's KV over positions 0 .. p-1 (each the target's layer inputs at j with the token at
    j + 1), its query at p - 1, then K - 1 positions chained on its own drafts and outputs."""
    import json
    import os

    import torch
    import transformers
    from safetensors.numpy import load_file

    hf = json.load(open(os.path.join(head_dir, "config.json")))
    weights = {name: torch.tensor(value, dtype=torch.float64) for name, value in
               load_file(os.path.join(head_dir, "model.safetensors")).items()}
    model = _float64_model(target_dir)
    layers = hf.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(
        model.config.num_hidden_layers)
    with torch.no_grad():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[layer][0] for layer in layers], dim=-1)[:-1]  # positions 0 .. p-1
        table = weights.get("embed_tokens.weight", model.get_input_embeddings().weight)
        target_ids = torch.arange(len(weights["d2t"])) + weights["d2t"].long()
        embeds = table[torch.tensor(tokens[1:])]
        hidden = aux @ weights["fc.weight"].T
        drafts = []
        for _ in range(k):
            out = _head_layer(hf, weights, embeds, hidden)
            logits = _rms(out[-1], weights["norm.weight"], hf["rms_norm_eps"]) @ weights["lm_head.weight"].T
            draft = int(target_ids[int(torch.argmax(logits))])
            drafts.append(draft)
            embeds = torch.cat([embeds, table[draft][None]])
            hidden = torch.cat([hidden, out[-1][None]])
    return drafts


@functools.lru_cache(maxsize=2)
def _float64_model(path: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def _rms(x, weight, eps):
    import torch

    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _head_layer(hf: dict, w: dict, embeds, hidden):
    """The head's decoder layer over positions 0 .. n-1 (causal), as vLLM's `LlamaForCausalLMEagle3` computes it."""
    import torch

    eps, heads, kv_heads = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    n, size = hidden.shape
    dim = size // heads
    normed = _rms(hidden, w["midlayer.hidden_norm.weight"], eps)
    residual = normed if hf.get("norm_before_residual") else hidden
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps), normed], dim=-1)
    q, k, v = (x @ w[f"midlayer.self_attn.{name}_proj.weight"].T for name in "qkv")
    q, k, v = (t.reshape(n, -1, dim).transpose(0, 1) for t in (q, k, v))
    inv_freq = 1.0 / hf["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (k, v))
    scores = q @ k.transpose(1, 2) * dim ** -0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
    residual = residual + attn @ w["midlayer.self_attn.o_proj.weight"].T
    x = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = x @ w["midlayer.mlp.gate_proj.weight"].T, x @ w["midlayer.mlp.up_proj.weight"].T
    return residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

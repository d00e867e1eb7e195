"""An EAGLE-3 head (Li et al., 2025), as vLLM reads the published heads (`LlamaForCausalLMEagle3`): its config
(`Eagle3Config`, checked against the target before anything is loaded, and the `head_steps.Head` the steps run),
its checkpoint (`read_checkpoint`, every tensor's shape checked), its serving-layout params and the pure functions
of its forward. The steps that run it are `head_steps.py`; the runner side `engine/speculative_head.py`.

The head is one Llama decoder layer whose attention reads `2 * hidden` features: the token's embedding (the
target's table, or the head's own) normed by `input_norm`, beside a hidden state normed by `hidden_norm`. That
hidden state is, for a position the target computed, `fc` over the inputs of three target layers concatenated
(`aux_layers`, `eagle_aux_hidden_state_layer_ids`; vLLM's default `(2, L // 2, L - 3)`), and for a drafted
position the head's own output at the position before (before its final norm). The residual stream starts at
that hidden state. The head's LM head covers a smaller draft vocabulary; draft id `d` is target id `d + d2t[d]`.
Position j of the head pairs the target's hidden state at j with the token at j + 1, so the head runs one position
behind the target and predicts the token two positions on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import path_name, spec_from_rules
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionMetadata, KVPages, PagedAttention
from jaxserve.layers.mlp import MLP
from jaxserve.layers.quant_dense import Linear
from jaxserve.layers.sampler import argmax
from jaxserve.models import llama, llama_weights
from jaxserve.models.registry import model_spec
from jaxserve.spec_decode.head_steps import target_embeddings

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the head's own tensors replicated; its layer split as the Llama family's layers are (its attention runs on the
# target's backend, whose pool is split over the heads)
SHARDING_RULES = ((r"^(fc|lm_head)/", "replicated"), (r"^target_ids$", "replicated"), (r"^embed/", "replicated"),
                  *llama_weights.SHARDING_RULES)
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")  # how heads name their decoder layer's tensors
LAYER_NORMS = {"input_norm": "input_layernorm", "hidden_norm": "hidden_norm",
               "post_attention_norm": "post_attention_layernorm"}  # ours -> the checkpoint's


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer as a one-layer Llama (its vocabulary: the target's embedding's)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose inputs it reads
    target_hidden_size: int
    norm_before_residual: bool = False  # the residual starts at the normed hidden state (some heads' configs)
    own_embedding: bool = False  # the checkpoint has `embed_tokens.weight` (else the target's table is read)

    def hidden_state(self, params, target_params, target, aux, dtype):
        return fused_hidden(params, aux, dtype)

    def run(self, params, target_params, target, tp, backend, dtype, tokens, hidden, kv, meta):
        embeds = embed(params, target_params, target, tp, tokens, dtype)
        return Eagle3Layer(self, tp, backend, dtype).apply({"params": params["layer"]}, embeds, hidden, kv, meta)

    def draft(self, params, target_params, target, tp, x, dtype):
        return draft_tokens(params, self, x, dtype)

    def load(self, model: str, allocator, mesh, tp: TensorParallel, dtype) -> dict:
        """The head's serving-layout params on `mesh` (`allocator.place`: nothing is read under `jaxserve
        compile`)."""
        def serving_layout(tensors: dict) -> dict:
            params = checkpoint_params(tensors, dtype)
            return {**params, "layer": llama_weights.fuse_layer(params["layer"], self.layer.for_layer(
                self.layer.layers[0]), tp)}

        def shardings(params: dict) -> dict:
            return jax.tree_util.tree_map_with_path(lambda path, _: NamedSharding(mesh, spec_from_rules(
                path_name(path), SHARDING_RULES, self.layer, tp)), params)

        return allocator.place(serving_layout, functools.partial(read_checkpoint, model, self),
                               tensor_shapes(self, dtype), shardings)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's layers for a head whose config names none."""
    return (2, num_layers // 2, num_layers - 3)


def eagle3_config(model: str, target: ModelConfig) -> Eagle3Config:
    """The config of the head in directory `model` for serving beside `target`; ValueError naming what does not
    fit (a wrong hidden size or vocabulary, layers the target lacks, a target whose decoder is not Llama-shaped)."""
    from jaxserve.loading.hf_files import read_hf_config, tensor_files

    where = f"speculative_config 'model' {model!r}"
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{where}: an EAGLE-3 head is a directory with config.json and safetensors")
    raw = json.loads((path / "config.json").read_text())
    architectures = raw.get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES) or raw.get("model_type") != "llama":
        raise ValueError(f"{where} is not an EAGLE-3 head (architectures {architectures}, model_type "
                         f"{raw.get('model_type')!r}; expected one of {ARCHITECTURES} with model_type 'llama')")
    if model_spec(target.model_type).module is not llama.LlamaModel:
        raise ValueError(f"EAGLE-3 reads the target's layer inputs, which model_type {target.model_type!r} does "
                         "not provide yet")
    layer = llama.parse_config(read_hf_config(path))
    if layer.num_layers != 1:
        raise ValueError(f"{where} has {layer.num_layers} decoder layers; jaxserve serves one-layer heads")
    target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(f"{where} reads hidden states of size {target_hidden}, the target's are "
                         f"{target.hidden_size}")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"{where} has a vocabulary of {layer.vocab_size} tokens, the target's has "
                         f"{target.vocab_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or layer.vocab_size)
    if not 0 < draft_vocab <= target.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab} must be in [1, {target.vocab_size}]")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux_layers = tuple(ids) if ids else default_aux_layers(target.num_layers)
    if not aux_layers or any(not isinstance(i, int) or not 0 <= i < target.num_layers for i in aux_layers):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(aux_layers)} must name layers in "
                         f"[0, {target.num_layers - 1}] of the target")
    try:
        own_embedding = "embed_tokens.weight" in tensor_files(str(path))
    except ValueError:  # no weights (`jaxserve compile` reads the config alone; serving stops at the first tensor)
        own_embedding = False
    if not own_embedding and layer.hidden_size != target.hidden_size:
        raise ValueError(f"{where} has hidden size {layer.hidden_size} and no embed_tokens.weight: it would read "
                         f"the target's embeddings, of size {target.hidden_size}")
    return Eagle3Config(layer, draft_vocab, aux_layers, target_hidden, bool(raw.get("norm_before_residual", False)),
                        own_embedding)


def tensor_shapes(config: Eagle3Config, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """What `read_checkpoint` returns, as shapes (`d2t` int32, the rest in `dtype`)."""
    return {name: jax.ShapeDtypeStruct(shape, jnp.int32 if name == "d2t" else dtype)
            for name, shape in checkpoint_shapes(config).items()}


def checkpoint_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Each tensor the head reads, by its checkpoint name (layer tensors as `midlayer.*`), with its HF shape."""
    cfg = config.layer
    h, q, kv, width = cfg.hidden_size, cfg.q_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"fc.weight": (h, len(config.aux_layers) * config.target_hidden_size),
              "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (width, h), "midlayer.mlp.up_proj.weight": (width, h),
              "midlayer.mlp.down_proj.weight": (h, width), "norm.weight": (h,),
              "lm_head.weight": (config.draft_vocab_size, h), "d2t": (config.draft_vocab_size,)}
    if config.own_embedding:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    return shapes


def read_checkpoint(model: str, config: Eagle3Config) -> dict[str, np.ndarray]:
    """The head's tensors by the names of `checkpoint_shapes`, as stored (`d2t` as int32); ValueError for a missing
    tensor, a wrong shape, or a `d2t` mapping a draft id outside the target's vocabulary. The head is read whole (it
    is small)."""
    from safetensors import safe_open

    from jaxserve.loading.hf_files import tensor_files

    files = tensor_files(model)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        stored = name if not name.startswith("midlayer.") else next(
            (prefix + name.removeprefix("midlayer.") for prefix in LAYER_PREFIXES
             if prefix + name.removeprefix("midlayer.") in files), name)
        if stored not in files:
            raise ValueError(f"EAGLE-3 head {model!r} is missing tensor {name!r}")
        with safe_open(files[stored], framework="np") as reader:
            tensor = reader.get_tensor(stored)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"EAGLE-3 head {model!r}: tensor {stored!r} has shape {tuple(tensor.shape)}, "
                             f"expected {shape}")
        tensors[name] = tensor
    target_ids = np.arange(config.draft_vocab_size) + tensors["d2t"].astype(np.int64)
    if target_ids.min() < 0 or target_ids.max() >= config.layer.vocab_size:
        bad = int(np.flatnonzero((target_ids < 0) | (target_ids >= config.layer.vocab_size))[0])
        raise ValueError(f"EAGLE-3 head {model!r}: d2t maps draft id {bad} to {int(target_ids[bad])}, outside the "
                         f"target's vocabulary of {config.layer.vocab_size}")
    return {**tensors, "d2t": tensors["d2t"].astype(np.int32)}


def write_checkpoint(directory: str | Path, tensors: dict[str, np.ndarray], hf_config: dict[str, Any]) -> None:
    """Writes a head in the published format (`config.json`, `model.safetensors` with the names of
    `checkpoint_shapes`): what `benchmarks/train_eagle3.py` and the tests make."""
    from safetensors.numpy import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1, **hf_config}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: np.ascontiguousarray(tensor) for name, tensor in tensors.items()},
              str(path / "model.safetensors"))


def checkpoint_params(tensors: dict[str, Any], dtype) -> dict:
    """The head's checkpoint-layout params (HF `[out, in]` kernels as `[in, out]`; `target_ids` int32), the layer
    as the Llama family's loader gives a layer (`llama_weights.fuse_layer` fuses it). Traceable: jit runs it on the
    devices, `jax.eval_shape` on shapes."""
    def kernel(name: str) -> dict:
        return {"kernel": tensors[name].T.astype(dtype)}

    def scale(name: str) -> dict:
        return {"scale": tensors[name].astype(dtype)}

    layer = {ours: scale(f"midlayer.{theirs}.weight") for ours, theirs in LAYER_NORMS.items()}
    layer["attn"] = {name: kernel(f"midlayer.self_attn.{name}.weight") for name in ("q_proj", "k_proj", "v_proj",
                                                                                    "o_proj")}
    layer["mlp"] = {name: kernel(f"midlayer.mlp.{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")}
    params = {"fc": kernel("fc.weight"), "layer": layer, "final_norm": scale("norm.weight"),
              "lm_head": kernel("lm_head.weight"),
              "target_ids": (jnp.arange(tensors["d2t"].shape[0]) + tensors["d2t"]).astype(jnp.int32)}
    if "embed_tokens.weight" in tensors:
        params["embed"] = {"embedding": tensors["embed_tokens.weight"].astype(dtype)}
    return params


class Eagle3Layer(nn.Module):
    """`(embeds [B, T, H], hidden [B, T, H], kv, meta) -> (output before the final norm [B, T, H], kv)`."""

    config: Eagle3Config
    tp: TensorParallel
    attention: PagedAttention
    dtype: Any

    @nn.compact
    def __call__(self, embeds, hidden, kv: KVPages, meta: AttentionMetadata):
        cfg = self.config.layer

        def norm(name: str):
            return llama.model_norm(cfg, self.dtype, name)

        normed = norm("hidden_norm")(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = jnp.concatenate([norm("input_norm")(embeds), normed], axis=-1)
        attn_out, kv = llama.Attention(cfg, self.tp, self.attention, cfg.layers[0], self.dtype, name="attn")(
            x, kv, meta)
        residual = residual + attn_out
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size, self.tp, self.dtype, cfg.activation, name="mlp")
        return residual + mlp(norm("post_attention_norm")(residual)), kv


def fused_hidden(params: dict, aux: jax.Array, dtype) -> jax.Array:
    """`fc` over the target's layer inputs `[..., n * target_hidden]`: the head's hidden state."""
    return Linear(params["fc"]["kernel"].shape[1], dtype=dtype).apply({"params": params["fc"]}, aux.astype(dtype))


def embed(params: dict, target_params: dict, target: ModelConfig, tp: TensorParallel, token_ids: jax.Array,
          dtype) -> jax.Array:
    """The tokens' embeddings from the head's own table (replicated), or the target's as the target holds it."""
    if "embed" in params:
        return jnp.take(params["embed"]["embedding"], token_ids, axis=0).astype(dtype)
    return target_embeddings(target_params, target, tp, token_ids, dtype)


def draft_tokens(params: dict, config: Eagle3Config, x: jax.Array, dtype) -> jax.Array:
    """The head's greedy draft after outputs `x [..., H]`, as target ids: the final norm, the LM head over the
    draft vocabulary, its argmax mapped by `d2t`."""
    x = llama.model_norm(config.layer, dtype).apply({"params": params["final_norm"]}, x)
    logits = Linear(config.draft_vocab_size, dtype=dtype).apply({"params": params["lm_head"]}, x)
    return params["target_ids"][argmax(logits.astype(jnp.float32))]

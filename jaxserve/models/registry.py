"""The model registry: `model_type -> ModelSpec`, and the functions the engine and the loaders call for any model.

A `ModelSpec` is everything jaxserve knows about one family (one module each under `models/`): how its
Hugging Face config becomes a `ModelConfig`, its Flax module, its checkpoint-layout parameters and the checkpoint
tensors each comes from, how a layer's parameters fuse into the serving layout, where each parameter lives on the
mesh, which linears a 4-bit checkpoint stores quantized, and the fan-ins of dummy weights. A new family adds one
module with its spec and one line to `FAMILIES`; the mixture-of-experts families (`qwen_moe`, `mixtral`,
`gpt_oss`), Gemma (`gemma`) and Phi-3 (`phi3`) are the Llama decoder's spec with their own config parsing (and
checkpoint names); Gemma 4 (`gemma4`) has a decoder of its own around the Llama family's attention.

Two parameter layouts, kernels stored `[in_features, out_features]` in both: the checkpoint layout (what loaders
produce, `checkpoint_shapes`) and the serving layout (what the model reads, `fuse_params`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from numpy.typing import DTypeLike

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import path_name, spec_from_rules
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionMetadata, PagedAttention
from jaxserve.layers.lora import lora_variables
from jaxserve.models import (deepseek, gemma, gemma4, glm4_moe, gpt_oss, llama, minimax_m2, mixtral, phi3,
                             qwen3_next, qwen_moe, qwen_vl)
from jaxserve.models.spec import ModelSpec

KVCache = list  # one cache per layer (an attention layer's: `KVPages`), layout chosen by the attention backend


FAMILIES: tuple[ModelSpec, ...] = (
    llama.SPEC, qwen_moe.SPEC, mixtral.SPEC, gemma.SPEC, gemma.MULTIMODAL_SPEC, phi3.SPEC, gpt_oss.SPEC, deepseek.SPEC,
    glm4_moe.SPEC, minimax_m2.SPEC, qwen3_next.SPEC, qwen3_next.MULTIMODAL_SPEC, gemma4.SPEC, gemma4.MULTIMODAL_SPEC,
    qwen_vl.SPEC, qwen_vl.QWEN3_SPEC)
MODELS: dict[str, ModelSpec] = {model_type: spec for spec in FAMILIES for model_type in spec.model_types}
SUPPORTED_MODEL_TYPES = tuple(MODELS)


def model_spec(model_type: str) -> ModelSpec:
    """The spec serving `model_type`; ValueError listing the supported ones otherwise."""
    if model_type not in MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; jaxserve serves "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return MODELS[model_type]


def config_from_hf(hf_config: Any) -> ModelConfig:
    """The `ModelConfig` of a transformers config (v4 or v5 spelling), by its family's parser."""
    return model_spec(hf_config.model_type).parse_config(hf_config)


def forward(params, config: ModelConfig, backend: PagedAttention, token_ids, kv_cache: KVCache,
            meta: AttentionMetadata, logits_indices=None, dtype=jnp.float32, tp: TensorParallel = TensorParallel(),
            with_hidden: bool = False, lora_slots=None, aux_layers: tuple[int, ...] = (), mm_embeds=None, mm_mask=None):
    """The pure forward function the engine jits: params (serving layout) and cache in, float32 logits and new
    cache out. With `logits_indices [B]`, one token per row gets logits ([B, vocab]); without, every token
    ([B, T, vocab]). `with_hidden`: the logits are the pair (logits, the last layer's output [B, T, hidden]).
    LoRA: `params["lora"]` is the adapters' device stack (`lora/weights.py`) and `lora_slots [B]` each row's slot
    in it (-1: the base model). `aux_layers`: the outputs are the pair (those outputs, the inputs of those decoder
    layers concatenated on the features `[B, T, len(aux_layers) * hidden]`), layer `num_layers` naming the last
    layer's output (a speculative head's inputs; the Llama-shaped decoders sow them). `mm_embeds [B, T, hidden]`:
    an image's embeddings for the tokens `mm_mask [B, T]` marks (the image families' prefill)."""
    spec = model_spec(config.model_type)
    variables = {"params": params}
    if "lora" in params:
        params = {name: group for name, group in params.items() if name != "lora"}
        variables = {"params": params, "lora": lora_variables(variables["params"]["lora"], lora_slots, dtype)}
    module = spec.module(config, backend, dtype, tp)
    inputs = (token_ids, kv_cache, meta) if mm_embeds is None else (token_ids, kv_cache, meta, mm_embeds, mm_mask)
    if aux_layers:
        (hidden, new_cache), sown = module.apply(variables, *inputs, mutable=["intermediates"])
        layer_inputs = (*sown["intermediates"]["layer_inputs"], hidden)
        aux = jnp.concatenate([layer_inputs[layer] for layer in aux_layers], axis=-1)
    else:
        hidden, new_cache = module.apply(variables, *inputs)
    x = hidden
    if logits_indices is not None:
        x = jnp.take_along_axis(x, logits_indices[:, None, None], axis=1)[:, 0]
    logits = spec.compute_logits(params, config, x, dtype, tp)
    outputs = (logits, hidden) if with_hidden else logits
    return ((outputs, aux) if aux_layers else outputs), new_cache


def head_logits(params, config: ModelConfig, hidden, dtype=jnp.float32, tp: TensorParallel = TensorParallel()):
    """The final norm and LM head over a forward's last-layer output `hidden [B, T, hidden]`: float32 logits of every
    position `[B, T, vocab]`, as the forward computes them for its own logits."""
    return model_spec(config.model_type).compute_logits(params, config, hidden, dtype, tp)


def checkpoint_shapes(config: ModelConfig, dtype: DTypeLike = jnp.float32) -> dict:
    """The checkpoint-layout parameter tree (as ShapeDtypeStructs) that loaders produce for `config`."""
    return model_spec(config.model_type).checkpoint_shapes(config, dtype)


def checkpoint_sources(config: ModelConfig) -> dict:
    """The checkpoint-layout tree of `config` with a `TensorSource` per parameter."""
    source = model_spec(config.model_type).checkpoint_source
    return jax.tree_util.tree_map_with_path(lambda path, _: source(path_name(path), config),
                                            checkpoint_shapes(config))


def group_kind(name: str, config: ModelConfig) -> str:
    """The kind of the top-level parameter group `name`: groups of one kind have one structure and shapes, so one
    compiled function (a conversion, a random draw) serves them all. Decoder layers are "layer" or "moe_layer",
    prefixed by their mixer when it is not attention ("gated_deltanet_moe_layer"), and followed by what makes
    their shapes their own (Gemma 4's global layers, layers reading another's KV)."""
    if not name.startswith("layers_"):
        return name
    layer = config.layers[int(name.removeprefix("layers_"))]
    kind = {"dense": "layer", "moe": "moe_layer", "dense_and_moe": "dense_and_moe_layer"}[layer.feed_forward]
    kind = kind if layer.mixer == "attention" else f"{layer.mixer}_{kind}"
    view = config.for_layer(layer)
    own = [f"{field}={getattr(view, field)}" for field in ("head_dim", "num_kv_heads", "intermediate_size")
           if getattr(view, field) != getattr(config, field)]
    own += ["shared_kv"] * (layer.kv_source is not None) + ["values_from_keys"] * layer.values_from_keys
    return f"{kind}({', '.join(own)})" if own else kind


def fuse_layer(layer: dict, config: ModelConfig, tp: TensorParallel, index: int = 0) -> dict:
    """Decoder layer `index`'s checkpoint-layout params -> serving layout (all their leaves: an AWQ layer's zeros
    and scales too). Jit it with the serving shardings as `out_shardings` and every device builds its own columns."""
    return model_spec(config.model_type).fuse_layer(layer, config.for_layer(config.layers[index]), tp)


def fuse_params(params: dict, config: ModelConfig, tp: TensorParallel = TensorParallel()) -> dict:
    """The whole checkpoint-layout tree -> serving layout (see `fuse_layer`), for tests and one-device use."""
    return {name: fuse_layer(group, config, tp, int(name.removeprefix("layers_"))) if name.startswith("layers_")
            else group for name, group in params.items()}


def param_specs(params, config: ModelConfig, tp: TensorParallel):
    """The tree of `PartitionSpec`s for a parameter tree (either layout; leaves may be arrays or shapes)."""
    rules = model_spec(config.model_type).sharding_rules
    return jax.tree_util.tree_map_with_path(lambda path, _: spec_from_rules(path_name(path), rules, config, tp),
                                            params)


def param_shardings(params, config: ModelConfig, tp: TensorParallel, mesh: Mesh):
    """The tree of `NamedSharding`s for a parameter tree on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, config, tp),
                        is_leaf=lambda x: isinstance(x, P))


def serving_shardings(params, config: ModelConfig, tp: TensorParallel, mesh: Mesh):
    """`param_shardings` of the serving layout, the embedding table pinned row-major on TPU (a `Format`): there
    its default layout is column-major when the hidden size is not a multiple of 128 (gpt-oss's 2880), and looking
    up 8 or more tokens then copied the whole table in every step (1.08 GiB for gpt-oss-20b on one v6e)."""
    shardings = param_shardings(params, config, tp, mesh)
    if mesh.devices.flat[0].platform != "tpu":
        return shardings

    def pinned(path, sharding: NamedSharding):
        if path_name(path) != "embed/embedding":
            return sharding
        return Format(Layout(major_to_minor=(0, 1)), sharding)
    return jax.tree_util.tree_map_with_path(pinned, shardings)


def dummy_fan_in(config: ModelConfig, path: str, shape: tuple[int, ...]) -> int:
    """The fan-in a random dummy weight at `path` of `shape` is scaled by."""
    return model_spec(config.model_type).dummy_fan_in(path, shape)

"""A model's own multi-token-prediction layer as a speculative head (`head_steps.Head`), as vLLM's `deepseek_mtp`
and `qwen3_next_mtp` run it: DeepSeek-V3's and GLM-4.5's `num_nextn_predict_layers`, stored after the decoder's
layers as `model.layers.{L}.*` (L = num_hidden_layers), and Qwen3-Next's and Qwen3.5's, stored as `mtp.*`.

The layer reads the target's last hidden state at position j (after the target's final norm, as vLLM hands it
over) and the embedding of the token at j + 1 (DeepSeek's: zero at position 0, as vLLM): two norms (DeepSeek's
`enorm` / `hnorm`, Qwen's `pre_fc_norm_embedding` / `pre_fc_norm_hidden`), a projection of the pair to the hidden
size (`eh_proj`, `fc`), one decoder layer of the target's family (DeepSeek-V3's: MLA and its experts; Qwen's: a
gated full-attention layer and its experts) with a KV pool of its own, and a final norm (`shared_head.norm`,
`mtp.norm`) before the LM head (`shared_head.head`, else the target's). Chained proposals read the layer's own
output: DeepSeek's before its final norm, Qwen's after it (as vLLM's models return them). A model with several MTP
layers is served with its first, applied again for every draft (vLLM applies the last again past their number).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import REPLICATED
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.layers.attention import AttentionMetadata, KVPages, PagedAttention
from jaxserve.layers.quant_dense import Linear
from jaxserve.layers.sampler import argmax
from jaxserve.models import TensorSource, checkpoint_shapes, checkpoint_sources, config_from_hf, model_spec
from jaxserve.models import llama
from jaxserve.spec_decode.head_steps import target_embeddings

# the internal names of the layer's own tensors, beside the family's decoder layer and its final norm
NORMS_AND_PROJECTION = ("enorm", "hnorm", "eh_proj")


@dataclasses.dataclass(frozen=True)
class MTPLayout:
    """Where a family's checkpoint keeps its MTP layer and how the layer chains."""

    layer_prefix: str  # its decoder layer's tensors, in place of the family's `model.layers.0.`
    tensors: tuple[tuple[str, str], ...]  # (internal name, tensor) of `enorm`, `hnorm`, `eh_proj`, `final_norm`,
    # and of `lm_head` where the checkpoint may have a head of its own
    zero_first_embedding: bool  # the embedding at position 0 is zero (DeepSeek's)
    normed_output: bool  # the layer's output is normed before it chains and before the LM head (Qwen's)


def deepseek_layout(index: int) -> MTPLayout:
    prefix = f"model.layers.{index}."
    names = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
             "final_norm": "shared_head.norm.weight", "lm_head": "shared_head.head.weight"}
    return MTPLayout(prefix, tuple((name, prefix + tensor) for name, tensor in names.items()), True, False)


QWEN_LAYOUT = MTPLayout("mtp.layers.0.", (
    ("enorm", "mtp.pre_fc_norm_embedding.weight"), ("hnorm", "mtp.pre_fc_norm_hidden.weight"),
    ("eh_proj", "mtp.fc.weight"), ("final_norm", "mtp.norm.weight")), False, True)

# model types -> (the config keys counting their MTP layers, their layout)
DEEPSEEK_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")
QWEN_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
FAMILIES = {
    **{model_type: (DEEPSEEK_KEYS, deepseek_layout) for model_type in ("deepseek_v3", "glm4_moe")},
    **{model_type: (QWEN_KEYS, lambda index: QWEN_LAYOUT)
       for model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")},
}


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    layer: ModelConfig  # the target's family with one layer: the MTP layer's
    layout: MTPLayout
    aux_layers: tuple[int, ...]  # (num_layers,): the target's last layer's output
    own_head: bool = True  # the checkpoint has a head of its own (else the target's LM head)

    def hidden_state(self, params, target_params, target, aux, dtype):
        return llama.model_norm(target, dtype).apply({"params": target_params["final_norm"]}, aux)

    def run(self, params, target_params, target, tp, backend, dtype, tokens, hidden, kv, meta):
        embeds = target_embeddings(target_params, target, tp, tokens, dtype)
        if self.layout.zero_first_embedding:
            embeds = jnp.where((meta.positions == 0)[..., None], 0, embeds)
        names = (*NORMS_AND_PROJECTION, "layers_0", *(("final_norm",) if self.layout.normed_output else ()))
        return MTPLayer(self, tp, backend, dtype).apply({"params": {name: params[name] for name in names}},
                                                        embeds, hidden, kv, meta)

    def draft(self, params, target_params, target, tp, x, dtype):
        if self.layout.normed_output:
            return argmax(llama.compute_logits(target_params, target, x, dtype, tp, norm=False))
        head = {"final_norm": params["final_norm"], "embed": target_params["embed"],
                "lm_head": params["lm_head"] if self.own_head else target_params.get("lm_head")}
        return argmax(model_spec(target.model_type).compute_logits(head, target, x, dtype, tp))

    def load(self, model: str, allocator, mesh, tp: TensorParallel, dtype) -> dict:
        """The layer's serving-layout params read from the target's checkpoint `model` (dequantized, unquantized:
        an FP8 checkpoint's MTP layer is served in `dtype`)."""
        from jaxserve.loading.hf import fp8_blocks, load_hf_params
        from jaxserve.loading.hf_files import checkpoint_quantization_config
        from jaxserve.loading.placement import serving_params
        from jaxserve.models import param_shardings

        shapes, sources = self._checkpoint(dtype)
        family = {name: group for name, group in shapes.items() if name not in NORMS_AND_PROJECTION}
        replicated = NamedSharding(mesh, REPLICATED)
        shardings = {**param_shardings(family, self.layer, tp, mesh),
                     **{name: jax.tree.map(lambda _: replicated, shapes[name]) for name in NORMS_AND_PROJECTION}}
        placed = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                                           sharding=sharding), shapes, shardings)
        quantization = checkpoint_quantization_config(model) or {}
        block = fp8_blocks(quantization) if str(quantization.get("quant_method", "")).lower() == "fp8" else None
        params = allocator.checkpoint(
            lambda: load_hf_params(model, self.layer, shardings, dtype, block, shapes, sources), placed)
        extras = {name: params.pop(name) for name in NORMS_AND_PROJECTION}
        return {**serving_params(params, self.layer, tp, mesh, dtype, None), **extras}

    def _checkpoint(self, dtype) -> tuple[dict, dict]:
        """The layer's checkpoint-layout shapes and their tensors: the family's one-layer tree at the layout's
        layer prefix, its final norm and LM head (when it has one) as the layout names them, no embedding; `enorm`,
        `hnorm`, `eh_proj`."""
        tensors = dict(self.layout.tensors)
        shapes = {name: group for name, group in checkpoint_shapes(self.layer, dtype).items()
                  if name != "embed" and (name != "lm_head" or self.own_head)}

        def source(path, leaf: TensorSource) -> TensorSource:
            group = str(path[0].key)
            if group in ("final_norm", "lm_head"):
                return dataclasses.replace(leaf, names=(tensors[group],))
            layer = re.compile(r"^(model\.language_model\.|model\.)layers\.0\.")
            return dataclasses.replace(leaf, names=tuple(layer.sub(self.layout.layer_prefix, name)
                                                         for name in leaf.names))

        sources = jax.tree_util.tree_map_with_path(source, {name: checkpoint_sources(self.layer)[name]
                                                            for name in shapes})
        h = self.layer.hidden_size
        for name in NORMS_AND_PROJECTION:
            shape = (2 * h, h) if name == "eh_proj" else (h,)
            leaf = "kernel" if name == "eh_proj" else "scale"
            shapes[name] = {leaf: jax.ShapeDtypeStruct(shape, dtype)}
            sources[name] = {leaf: TensorSource((tensors[name],), name == "eh_proj")}
        return shapes, sources


class MTPLayer(nn.Module):
    """`(embeds [B, T, H], hidden [B, T, H], kv, meta) -> (the layer's output [B, T, H], kv)`."""

    config: MTPConfig
    tp: TensorParallel
    attention: PagedAttention
    dtype: Any

    @nn.compact
    def __call__(self, embeds, hidden, kv: KVPages, meta: AttentionMetadata):
        cfg = self.config.layer
        x = jnp.concatenate([llama.model_norm(cfg, self.dtype, "enorm")(embeds),
                             llama.model_norm(cfg, self.dtype, "hnorm")(hidden)], axis=-1)
        x = Linear(cfg.hidden_size, dtype=self.dtype, name="eh_proj")(x)
        x, kv = llama.DecoderLayer(cfg, self.tp, self.attention, cfg.layers[0], self.dtype, name="layers_0")(
            x, kv, meta)
        if self.config.layout.normed_output:
            x = llama.model_norm(cfg, self.dtype, "final_norm")(x)
        return x, kv


def mtp_config(model: str | None, target: ModelConfig) -> MTPConfig:
    """The MTP layer of the checkpoint directory `model` (the target's); ValueError naming what is missing."""
    from jaxserve.loading import resolve_model
    from jaxserve.loading.hf_files import read_hf_config, tensor_files

    source = resolve_model(model)
    path = source.directory
    where = f"speculative_config method 'mtp' on {source.name!r}"
    raw = json.loads((Path(path) / "config.json").read_text()) if path and (Path(path) / "config.json").is_file() \
        else {}
    keys, layout_of = FAMILIES.get(target.model_type, (DEEPSEEK_KEYS[:1], None))
    counts = {key: raw.get(key) or (raw.get("text_config") or {}).get(key) for key in keys}
    key, count = next(((key, count) for key, count in counts.items() if count), (keys[0], 0))
    if layout_of is None or not count:
        raise ValueError(f"{where}: the model has no multi-token-prediction layers (model_type "
                         f"{target.model_type!r}, {' / '.join(keys)} {count}; MTP is read from "
                         f"{', '.join(dict.fromkeys(FAMILIES))} checkpoints that have them)")
    layout = layout_of(target.num_layers)
    if layout.normed_output:  # Qwen's: a full-attention layer, its experts as the decoder's first layer's
        spec = dataclasses.replace(target.layers[0], mixer="attention")
    else:  # DeepSeek's: the decoder's layer L as a model one layer deeper has it
        hf = read_hf_config(path)
        hf.num_hidden_layers = target.num_layers + 1
        spec = config_from_hf(hf).layers[target.num_layers]
    layer = dataclasses.replace(target, num_layers=1, layers=(spec,), linear_attention=None)
    try:
        files = tensor_files(str(path))
    except ValueError:  # no weights (`jaxserve compile` reads the config alone)
        return MTPConfig(layer, layout, (target.num_layers,), "lm_head" in dict(layout.tensors))
    tensors = dict(layout.tensors)
    head = tensors.pop("lm_head", None)
    missing = [tensor for tensor in tensors.values() if tensor not in files]
    if missing:
        raise ValueError(f"{where}: the checkpoint has {key} {count} but no tensor {missing[0]!r}")
    return MTPConfig(layer, layout, (target.num_layers,), head in files)

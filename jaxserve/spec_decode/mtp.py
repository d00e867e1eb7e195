"""A model's own multi-token-prediction layer as a speculative head (`head_steps.Head`), as vLLM's `deepseek_mtp`
runs it: DeepSeek-V3's and GLM-4.5's `num_nextn_predict_layers`, stored after the decoder's layers as
`model.layers.{L}.*` (L = num_hidden_layers).

The layer reads the target's last hidden state at position j (after the target's final norm, as vLLM hands it
over) and the embedding of the token at j + 1 (zero at position 0, as vLLM): `enorm` and `hnorm` norm them,
`eh_proj` maps the pair to the hidden size, one decoder layer of the target's family (DeepSeek-V3's: MLA and its
experts) runs over it with a KV pool of its own, and `shared_head.norm` / `shared_head.head` give the logits (the
target's LM head when the checkpoint has no head of its own). Chained proposals read the layer's own output; a
model with several MTP layers is served with its first, applied again for every draft (vLLM applies the last
again past their number).
"""

from __future__ import annotations

import dataclasses
import json
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

FAMILIES = ("deepseek_v3", "glm4_moe")  # checkpoints naming their MTP layers `model.layers.{L}.*`
EXTRA_TENSORS = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight"}


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    layer: ModelConfig  # the target's family with one layer: the MTP layer's
    index: int  # its layer index in the checkpoint (the target's num_hidden_layers)
    aux_layers: tuple[int, ...]  # (num_layers,): the target's last layer's output
    own_head: bool = True  # the checkpoint has `shared_head.head` (else the target's LM head)

    def hidden_state(self, params, target_params, target, aux, dtype):
        return llama.model_norm(target, dtype).apply({"params": target_params["final_norm"]}, aux)

    def run(self, params, target_params, target, tp, backend, dtype, tokens, hidden, kv, meta):
        embeds = target_embeddings(target_params, target, tp, tokens, dtype)
        embeds = jnp.where((meta.positions == 0)[..., None], 0, embeds)
        variables = {"params": {name: params[name] for name in ("enorm", "hnorm", "eh_proj", "layers_0")}}
        return MTPLayer(self, tp, backend, dtype).apply(variables, embeds, hidden, kv, meta)

    def draft(self, params, target_params, target, tp, x, dtype):
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
        family = {name: group for name, group in shapes.items() if name not in EXTRA_TENSORS}
        replicated = NamedSharding(mesh, REPLICATED)
        shardings = {**param_shardings(family, self.layer, tp, mesh),
                     **{name: jax.tree.map(lambda _: replicated, shapes[name]) for name in EXTRA_TENSORS}}
        placed = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                                           sharding=sharding), shapes, shardings)
        quantization = checkpoint_quantization_config(model) or {}
        block = fp8_blocks(quantization) if str(quantization.get("quant_method", "")).lower() == "fp8" else None
        params = allocator.checkpoint(
            lambda: load_hf_params(model, self.layer, shardings, dtype, block, shapes, sources), placed)
        extras = {name: params.pop(name) for name in EXTRA_TENSORS}
        return {**serving_params(params, self.layer, tp, mesh, dtype, None), **extras}

    def _checkpoint(self, dtype) -> tuple[dict, dict]:
        """The layer's checkpoint-layout shapes and their tensors: the family's one-layer tree under
        `model.layers.{index}`, its final norm and LM head as `shared_head`, no embedding; `enorm`, `hnorm`,
        `eh_proj`."""
        prefix = f"model.layers.{self.index}."
        shapes = {name: group for name, group in checkpoint_shapes(self.layer, dtype).items()
                  if name != "embed" and (name != "lm_head" or self.own_head)}
        renamed = {"final_norm": f"{prefix}shared_head.norm.weight", "lm_head": f"{prefix}shared_head.head.weight"}

        def source(path, leaf: TensorSource) -> TensorSource:
            group = str(path[0].key)
            if group in renamed:
                return dataclasses.replace(leaf, names=(renamed[group],))
            return dataclasses.replace(leaf, names=tuple(name.replace("model.layers.0.", prefix)
                                                         for name in leaf.names))

        sources = jax.tree_util.tree_map_with_path(source, {name: checkpoint_sources(self.layer)[name]
                                                            for name in shapes})
        h = self.layer.hidden_size
        for name, tensor in EXTRA_TENSORS.items():
            shape = (2 * h, h) if name == "eh_proj" else (h,)
            leaf = "kernel" if name == "eh_proj" else "scale"
            shapes[name] = {leaf: jax.ShapeDtypeStruct(shape, dtype)}
            sources[name] = {leaf: TensorSource((prefix + tensor,), name == "eh_proj")}
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
        return llama.DecoderLayer(cfg, self.tp, self.attention, cfg.layers[0], self.dtype, name="layers_0")(
            x, kv, meta)


def mtp_config(model: str | None, target: ModelConfig) -> MTPConfig:
    """The MTP layer of the checkpoint directory `model` (the target's); ValueError naming what is missing."""
    from transformers import AutoConfig

    from jaxserve.loading import resolve_model
    from jaxserve.loading.hf_files import tensor_files

    source = resolve_model(model)
    path = source.directory
    where = f"speculative_config method 'mtp' on {source.name!r}"
    raw = json.loads((Path(path) / "config.json").read_text()) if path and (Path(path) / "config.json").is_file() \
        else {}
    count = raw.get("num_nextn_predict_layers") or raw.get("num_mtp_layers") or 0
    if target.model_type not in FAMILIES or not count:
        raise ValueError(f"{where}: the model has no multi-token-prediction layers (model_type "
                         f"{target.model_type!r}, num_nextn_predict_layers {count}; MTP is read from "
                         f"{', '.join(FAMILIES)} checkpoints that have them)")
    hf = AutoConfig.from_pretrained(path)
    index = hf.num_hidden_layers
    hf.num_hidden_layers = index + 1
    spec = config_from_hf(hf).layers[index]
    layer = dataclasses.replace(target, num_layers=1, layers=(spec,))
    try:
        files = tensor_files(str(path))
    except ValueError:  # no weights (`jaxserve compile` reads the config alone)
        return MTPConfig(layer, index, (target.num_layers,))
    missing = [f"model.layers.{index}.{tensor}" for tensor in (*EXTRA_TENSORS.values(), "shared_head.norm.weight")
               if f"model.layers.{index}.{tensor}" not in files]
    if missing:
        raise ValueError(f"{where}: the checkpoint has num_nextn_predict_layers {count} but no tensor "
                         f"{missing[0]!r}")
    return MTPConfig(layer, index, (target.num_layers,), f"model.layers.{index}.shared_head.head.weight" in files)

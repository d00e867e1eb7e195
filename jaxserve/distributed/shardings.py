"""The sharding vocabulary: the `PartitionSpec`s a parameter may take, the rule that resolves a model's sharding table
into them, and the replicated spec of everything the host sends or reads.

Each model family's spec lists its table (`ModelSpec.sharding_rules`: a regex on the parameter path, a kind from
`SPEC_KINDS`), for both parameter layouts; `models.param_shardings` applies it. The kinds that depend on the model
are resolved here: the vocabulary splits only when the device count divides it, and k/v projections are replicated
when the KV heads are (tensor_parallel_size a multiple of num_kv_heads). The page pool's specs live with the pool
(`layers/paged_kv.py`). Token ids, page tables, logits, sampled tokens and penalty state are `REPLICATED`.
"""

from __future__ import annotations

import re

from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import MODEL_AXIS, REPLICATED, TensorParallel

SPLIT_OUTPUT = P(None, MODEL_AXIS)  # kernels are [in_features, out_features]
SPLIT_INPUT = P(MODEL_AXIS, None)
SPLIT_VECTOR = P(MODEL_AXIS)
SPEC_KINDS = ("replicated", "columns", "rows", "vector", "vocab_rows", "vocab_columns", "vocab_vector", "kv_columns",
              "kv_vector", "expert_columns", "expert_rows", "expert_vector", "expert_replicated", "lora_rows",
              "lora_columns")

__all__ = ["REPLICATED", "SPEC_KINDS", "path_name", "resolve_kind", "spec_from_rules"]


def resolve_kind(kind: str, config: ModelConfig, tp: TensorParallel) -> P:
    """The `PartitionSpec` of a sharding-rule kind for `config` split `tp` ways."""
    vocab_splits = config.vocab_size % tp.size == 0
    kv_splits = tp.splits_kv_weights(config)
    return {
        "replicated": REPLICATED,
        "columns": SPLIT_OUTPUT,
        "rows": SPLIT_INPUT,
        "vector": SPLIT_VECTOR,
        "vocab_rows": SPLIT_INPUT if vocab_splits else REPLICATED,
        "vocab_columns": SPLIT_OUTPUT if vocab_splits else REPLICATED,
        "vocab_vector": SPLIT_VECTOR if vocab_splits else REPLICATED,
        "kv_columns": SPLIT_OUTPUT if kv_splits else REPLICATED,
        "kv_vector": SPLIT_VECTOR if kv_splits else REPLICATED,
        # every expert's kernels `[E, in, out]` and int8 scales `[E, out]`: split inside each expert, or whole
        # experts per device under expert parallelism
        "expert_columns": P(MODEL_AXIS, None, None) if tp.expert_parallel else P(None, None, MODEL_AXIS),
        "expert_rows": P(MODEL_AXIS, None, None) if tp.expert_parallel else P(None, MODEL_AXIS, None),
        "expert_vector": P(MODEL_AXIS, None) if tp.expert_parallel else P(None, MODEL_AXIS),
        "expert_replicated": P(MODEL_AXIS, None) if tp.expert_parallel else REPLICATED,
        # the LoRA stack (`lora/weights.py`): `a [in, slots, W]` of a row-parallel linear on its input features,
        # `b [slots, W, out]` of a column-parallel one on its output features
        "lora_rows": P(MODEL_AXIS, None, None),
        "lora_columns": P(None, None, MODEL_AXIS),
    }[kind]


def spec_from_rules(path: str, rules: tuple[tuple[str, str], ...], config: ModelConfig, tp: TensorParallel) -> P:
    """The `PartitionSpec` of the parameter at `path` ("layers_0/attn/qkv_proj/kernel", ...): the first rule whose
    pattern matches; KeyError when none does. An FP8 kernel's block scales (`layers/fp8.py`) split as it does."""
    if path.endswith("/block_scale"):
        path = path.removesuffix("block_scale") + "kernel"
    layer = re.match(r"(?:lora/)?layers_(\d+)/", path)
    if layer and int(layer.group(1)) < len(config.layers):  # its own KV heads decide whether k/v split
        config = config.for_layer(config.layers[int(layer.group(1))])
    for pattern, kind in rules:
        if re.search(pattern, path):
            return resolve_kind(kind, config, tp)
    raise KeyError(f"no sharding rule for parameter {path!r}")


def path_name(path) -> str:
    """A pytree key path of nested dicts as "layers_0/attn/qkv_proj/kernel"."""
    return "/".join(str(getattr(key, "key", key)) for key in path)

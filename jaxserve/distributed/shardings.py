"""The sharding table: where every parameter, the KV page pool and the step inputs live on the device mesh.

One table, from parameter path to `PartitionSpec`, for both parameter layouts: the checkpoint layout the
loaders produce (q/k/v and gate/up apart) and the serving layout the model reads (fused, each device's
columns together; see `models.llama.fuse_params`). Megatron-style:

* q/k/v, gate and up projections split on their output features, o and down on their input features
  (XLA's SPMD partitioner inserts the all-reduce after them);
* the embedding and the LM head split on the vocabulary (replicated when it does not divide evenly);
* int8 weights' per-output-channel scales split like their kernel's output features;
* AWQ int4 layers' per-group `zeros` and `scales` ([in / group, out]) split exactly like their kernel: on the
  output features, or on the input features (whole groups per device, checked by `loading/awq.py`);
* norms replicated; the page pool (and a quantized pool's per-token scales) split on its heads axis;
  everything the host sends or reads (token ids, page tables, logits, sampled tokens, penalty state) replicated.
"""

from __future__ import annotations

import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import MODEL_AXIS, TensorParallel

REPLICATED = P()
KV_POOL = P(MODEL_AXIS)  # [pool_heads, pages, page_size, head_dim]
KV_SCALES = P(MODEL_AXIS)  # quantized pools' per-token scales [pool_heads, pages, page_size]: split like their pages
SPLIT_OUTPUT = P(None, MODEL_AXIS)  # kernels are [in_features, out_features]
SPLIT_INPUT = P(MODEL_AXIS, None)
SPLIT_VECTOR = P(MODEL_AXIS)

# (pattern on "group/module/leaf", spec); the first match wins. "kv" marks k/v projections, which are
# replicated instead when the KV heads are (tensor_parallel_size a multiple of num_kv_heads).
PARAM_TABLE: tuple[tuple[str, P | str], ...] = (
    (r"embed/embedding", "vocab_rows"),
    (r"embed/scale", "vocab_vector"),  # int8 weights (layers/quant_dense.py): one scale per output channel,
    (r"lm_head/kernel", "vocab_columns"),  # split with the kernel's output features, replicated where the
    (r"lm_head/scale", "vocab_vector"),  # kernel is split on its input features
    (r"attn/(qkv|q)_proj/(kernel|zeros|scales)$", SPLIT_OUTPUT),
    (r"attn/(qkv|q)_proj/(bias|scale)", SPLIT_VECTOR),
    (r"attn/[kv]_proj/(kernel|zeros|scales)$", "kv_kernel"),
    (r"attn/[kv]_proj/(bias|scale)", "kv_vector"),
    (r"attn/o_proj/(kernel|zeros|scales)$", SPLIT_INPUT),
    (r"attn/o_proj/scale", REPLICATED),
    (r"mlp/(gate_up|gate|up)_proj/(kernel|zeros|scales)$", SPLIT_OUTPUT),
    (r"mlp/(gate_up|gate|up)_proj/scale", SPLIT_VECTOR),
    (r"mlp/down_proj/(kernel|zeros|scales)$", SPLIT_INPUT),
    (r"mlp/down_proj/scale", REPLICATED),
    (r"(norm|_norm)/scale", REPLICATED),
)


def param_spec(path: str, config: ModelConfig, tp: TensorParallel) -> P:
    """The `PartitionSpec` of the parameter at `path` ("layers_0/attn/qkv_proj/kernel", ...)."""
    for pattern, spec in PARAM_TABLE:
        if re.search(pattern, path):
            break
    else:
        raise KeyError(f"no sharding rule for parameter {path!r}")
    if isinstance(spec, P):
        return spec
    vocab_splits = config.vocab_size % tp.size == 0
    kv_splits = tp.splits_kv_weights(config)
    return {
        "vocab_rows": SPLIT_INPUT if vocab_splits else REPLICATED,
        "vocab_columns": SPLIT_OUTPUT if vocab_splits else REPLICATED,
        "vocab_vector": SPLIT_VECTOR if vocab_splits else REPLICATED,
        "kv_kernel": SPLIT_OUTPUT if kv_splits else REPLICATED,
        "kv_vector": SPLIT_VECTOR if kv_splits else REPLICATED,
    }[spec]


def param_specs(params, config: ModelConfig, tp: TensorParallel):
    """The tree of `PartitionSpec`s for a parameter tree (either layout; leaves may be arrays or shapes)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_spec(path_name(path), config, tp), params)


def param_shardings(params, config: ModelConfig, tp: TensorParallel, mesh: Mesh):
    """The tree of `NamedSharding`s for a parameter tree on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, config, tp),
                        is_leaf=lambda x: isinstance(x, P))


def path_name(path) -> str:
    """A pytree key path of nested dicts as "layers_0/attn/qkv_proj/kernel"."""
    return "/".join(str(getattr(key, "key", key)) for key in path)

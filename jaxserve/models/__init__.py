"""Model families behind one registry (`registry.py`): each family's module, specs, and the forward function the
engine jits, a pure function of (params, token ids, KV pools, attention metadata) -> (logits, new KV pools)."""

from jaxserve.models.registry import (SUPPORTED_MODEL_TYPES, KVCache, checkpoint_shapes, checkpoint_sources,
                                      config_from_hf, dummy_fan_in, forward, fuse_layer, fuse_params, group_kind,
                                      head_logits, model_spec, param_shardings, param_specs,
                                      serving_shardings)
from jaxserve.models.spec import ModelSpec, TensorSource

__all__ = ["KVCache", "ModelSpec", "SUPPORTED_MODEL_TYPES", "TensorSource", "checkpoint_shapes", "checkpoint_sources",
           "config_from_hf", "dummy_fan_in", "forward", "fuse_layer", "fuse_params", "group_kind", "head_logits",
           "model_spec", "param_shardings", "param_specs",
           "serving_shardings"]

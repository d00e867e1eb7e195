"""Model definitions. Every model is a Flax module whose forward pass is a pure function of
(params, token ids, KV pools, attention metadata) -> (logits, new KV pools)."""

from jaxserve.models.llama import (KVCache, LlamaForCausalLM, checkpoint_shapes, forward, fuse_layer, fuse_params,
                                   head_logits, param_shapes)

__all__ = ["KVCache", "LlamaForCausalLM", "checkpoint_shapes", "forward", "fuse_layer", "fuse_params", "head_logits",
           "param_shapes"]

"""Gemma 3's vision side: the SigLIP tower (square images of `image_size` pixels in patches of `patch_size`, a
learned position per patch, pre-norm blocks of multi-head attention over the whole image and a GELU MLP, a final
LayerNorm) and Gemma 3's projector (the patch grid average-pooled to `mm_tokens_per_image` tokens, RMS-normed with
Gemma's 1 + w scale, projected to the language model's width). Every image has the same size, so one compiled
shape serves them all."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.norms import rms_normalize
from jaxserve.models.qwen2_5_vit import QUERY_BLOCK, linear
from jaxserve.models.qwen3_vit import layer_norm

SHARDING_RULES = ((r"^layers/.*/(q_proj|k_proj|v_proj|fc1)/", "columns"),
                  (r"^layers/.*/(out_proj|fc2)/kernel$", "rows"), (r".", "replicated"))  # as qwen2_5_vit's


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    out_hidden_size: int  # the language model's width
    tokens_per_image: int
    layer_norm_eps: float = 1e-6
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size ** 2

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


def parse_config(hf_config: Any) -> VisionConfig:
    """The tower's and projector's config from a `gemma3` config; ValueError naming what this code cannot compute."""
    vision = hf_config.vision_config
    if getattr(vision, "hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"vision hidden_act {vision.hidden_act!r} is not supported (jaxserve's SigLIP tower "
                         "computes gelu_pytorch_tanh)")
    config = VisionConfig(
        hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
        num_layers=vision.num_hidden_layers, num_heads=vision.num_attention_heads, image_size=vision.image_size,
        patch_size=vision.patch_size, out_hidden_size=hf_config.text_config.hidden_size,
        tokens_per_image=hf_config.mm_tokens_per_image, layer_norm_eps=vision.layer_norm_eps,
        in_channels=vision.num_channels)
    side = int(round(config.tokens_per_image ** 0.5))
    if side * side != config.tokens_per_image or config.patches_per_side % side:
        raise ValueError(f"mm_tokens_per_image {config.tokens_per_image} must be a square whose side divides the "
                         f"{config.patches_per_side} patches per side")
    return config


@flax.struct.dataclass
class EncoderInputs:
    patches: jax.Array  # float32 [num_patches, patch_dim]: the image's patches in raster order


def encoder_inputs(config: VisionConfig, images: list[tuple[np.ndarray, tuple[int, int, int]]],
                   bucket: int) -> tuple[EncoderInputs, list[np.ndarray]]:
    """One image's patches (`pixel_values [channels, image_size, image_size]`), channel-major within a patch as
    the patch embedding's weights are (a call takes one image: its shape is the only one); the tokens come out in
    order."""
    if len(images) != 1:
        raise ValueError(f"the SigLIP encoder takes one image per call, got {len(images)}")
    side, patch = config.patches_per_side, config.patch_size
    pixels = np.asarray(images[0][0], np.float32).reshape(config.in_channels, side, patch, side, patch)
    patches = pixels.transpose(1, 3, 0, 2, 4).reshape(config.num_patches, config.patch_dim)
    return EncoderInputs(patches=patches), [np.arange(config.tokens_per_image)]


def _attention(config: VisionConfig, layer: dict, x):
    count, heads, head_dim = x.shape[0], config.num_heads, config.head_dim
    q, k, v = (linear(x, layer[name]).reshape(count, heads, head_dim) for name in ("q_proj", "k_proj", "v_proj"))
    block = min(count, QUERY_BLOCK)

    def attend(queries):
        scores = jnp.einsum("qhd,khd->hqk", queries.astype(jnp.float32), k.astype(jnp.float32)) * head_dim ** -0.5
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)
    out = jax.lax.map(attend, q.reshape(-1, block, heads, head_dim))
    return linear(out.reshape(count, heads * head_dim), layer["out_proj"])


def encode(config: VisionConfig, dtype, params: dict, inputs: EncoderInputs):
    """The tower and projector over one image: `[tokens_per_image, out_hidden_size]`. A step with no state."""
    eps = config.layer_norm_eps
    x = linear(inputs.patches.astype(dtype), params["patch_embed"]) + params["position_embedding"].astype(dtype)
    for layer in params["layers"]:
        x = x + _attention(config, layer, layer_norm(x, layer["layer_norm1"], eps))
        h = layer_norm(x, layer["layer_norm2"], eps)
        x = x + linear(jax.nn.gelu(linear(h, layer["fc1"]), approximate=True), layer["fc2"])
    x = layer_norm(x, params["post_layernorm"], eps)
    side, pooled = config.patches_per_side, int(round(config.tokens_per_image ** 0.5))
    kernel = side // pooled
    grid = x.astype(jnp.float32).reshape(pooled, kernel, pooled, kernel, config.hidden_size)
    x = grid.mean(axis=(1, 3)).reshape(config.tokens_per_image, config.hidden_size).astype(x.dtype)
    x = (rms_normalize(x, eps) * (1.0 + params["soft_emb_norm"].astype(jnp.float32))).astype(x.dtype)
    return x @ params["input_projection"].astype(x.dtype), ()


def activation_bytes(config: VisionConfig, patches: int) -> int:
    """A bound on one `encode` call's temporaries (see `qwen2_5_vit.activation_bytes`)."""
    return 4 * patches * (3 * config.num_heads * min(patches, QUERY_BLOCK) + 6 * config.hidden_size
                          + 2 * config.intermediate_size)


def checkpoint_tensors(config: VisionConfig) -> dict:
    """The parameter tree with the checkpoint tensor each leaf is read from (under the tower's prefix; a name
    starting with "^" from the checkpoint's top level) and whether it is stored transposed."""
    def dense(name: str) -> dict:
        return {"kernel": (f"{name}.weight", True), "bias": (f"{name}.bias", False)}

    def norm(name: str) -> dict:
        return {"scale": (f"{name}.weight", False), "bias": (f"{name}.bias", False)}

    layers = [{"layer_norm1": norm(f"encoder.layers.{i}.layer_norm1"),
               "layer_norm2": norm(f"encoder.layers.{i}.layer_norm2"),
               **{name: dense(f"encoder.layers.{i}.self_attn.{name}")
                  for name in ("q_proj", "k_proj", "v_proj", "out_proj")},
               "fc1": dense(f"encoder.layers.{i}.mlp.fc1"), "fc2": dense(f"encoder.layers.{i}.mlp.fc2")}
              for i in range(config.num_layers)]
    return {"patch_embed": dense("embeddings.patch_embedding"),
            "position_embedding": ("embeddings.position_embedding.weight", False), "layers": layers,
            "post_layernorm": norm("post_layernorm"),
            "soft_emb_norm": ("^multi_modal_projector.mm_soft_emb_norm.weight", False),
            "input_projection": ("^multi_modal_projector.mm_input_projection_weight", False)}


def checkpoint_shapes(config: VisionConfig) -> dict:
    d, inner = config.hidden_size, config.intermediate_size

    def dense(fan_in: int, fan_out: int) -> dict:
        return {"kernel": (fan_in, fan_out), "bias": (fan_out,)}

    norm = {"scale": (d,), "bias": (d,)}
    layer = {"layer_norm1": norm, "layer_norm2": norm, "q_proj": dense(d, d), "k_proj": dense(d, d),
             "v_proj": dense(d, d), "out_proj": dense(d, d), "fc1": dense(d, inner), "fc2": dense(inner, d)}
    return {"patch_embed": dense(config.patch_dim, d), "position_embedding": (config.num_patches, d),
            "layers": [layer] * config.num_layers, "post_layernorm": norm, "soft_emb_norm": (d,),
            "input_projection": (d, config.out_hidden_size)}

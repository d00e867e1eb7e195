"""Qwen3-VL's vision tower: 16x16 patches with a learned position table resampled (bilinear) to each image's grid,
`depth` pre-norm blocks (LayerNorm, attention over the whole image with the 2-D rope of `qwen2_5_vit`, a GELU
MLP), and the merger of 2x2 patches into the language model's width; the outputs of the `deepstack_visual_indexes`
blocks are merged too (each by its own merger, normed after the merge) and go into the decoder's first layers
(`ModelConfig.deepstack_layers`). `encode` returns them beside the embeddings on the feature axis: `[tokens,
(1 + deepstack) * out_hidden_size]`. Patches stay in the processor's order (merge units in raster order)."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.qwen2_5_vit import (QUERY_BLOCK, VisionConfig, attention, check_fits, linear,
                                         merge_unit_positions, one_frame)

FEATURES_BLOCK = 4  # bilinear taps per patch of the position table
SHARDING_RULES = ((r"^blocks/.*/(qkv|linear_fc1)/", "columns"), (r"^blocks/.*/(proj|linear_fc2)/kernel$", "rows"),
                  (r".", "replicated"))  # as `qwen2_5_vit.SHARDING_RULES`


@flax.struct.dataclass
class EncoderInputs:
    """One call's patches in the processor's order, padded to a patch bucket (padding: image -1)."""

    patches: jax.Array  # float32 [N, patch_dim]
    positions: jax.Array  # int32 [2, N]: each patch's row and column in its image's patch grid
    images: jax.Array  # int32 [N]: the image each patch belongs to (-1: padding)
    table_rows: jax.Array  # int32 [N, 4]: the position table's rows each patch's embedding is resampled from
    table_weights: jax.Array  # float32 [N, 4]: their bilinear weights


def table_taps(side: int, count: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (align_corners) of grid index `index` of `count` along a table axis of `side` entries."""
    source = index * (side - 1) / max(count - 1, 1)
    floor = np.floor(source)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(source[:, None] - taps), 0, None)
    return np.clip(taps, 0, side - 1), weights


def encoder_inputs(config: VisionConfig, images: list[tuple[np.ndarray, tuple[int, int, int]]],
                   bucket: int) -> tuple[EncoderInputs, list[np.ndarray]]:
    """One call over `images` (pixels and patch grid each), their patches back to back padded to `bucket`; and each
    image's tokens (already in raster order) as rows of the call's output."""
    check_fits(config, images, bucket)
    side = int(config.num_position_embeddings ** 0.5)
    inputs = EncoderInputs(patches=np.zeros((bucket, config.patch_dim), np.float32),
                           positions=np.zeros((2, bucket), np.int32), images=np.full(bucket, -1, np.int32),
                           table_rows=np.zeros((bucket, FEATURES_BLOCK), np.int32),
                           table_weights=np.zeros((bucket, FEATURES_BLOCK), np.float32))
    first, orders = 0, []
    for index, (pixel_values, grid_thw) in enumerate(images):
        grid_h, grid_w = one_frame(grid_thw)
        count = grid_h * grid_w
        patches = slice(first, first + count)
        positions = merge_unit_positions(grid_h, grid_w, config.spatial_merge_size)
        rows, row_weights = table_taps(side, grid_h, positions[0].astype(np.float64))
        cols, col_weights = table_taps(side, grid_w, positions[1].astype(np.float64))
        inputs.patches[patches] = pixel_values
        inputs.positions[:, patches] = positions
        inputs.images[patches] = index
        inputs.table_rows[patches] = (rows[:, :, None] * side + cols[:, None, :]).reshape(count, -1)
        inputs.table_weights[patches] = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(count, -1)
        orders.append(np.arange(first, first + count, config.merge_unit) // config.merge_unit)
        first += count
    return inputs, orders


def layer_norm(x, layer: dict, eps: float):
    """LayerNorm over the last axis in float32, with its scale and bias."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(((x32 - mean) ** 2).mean(-1, keepdims=True) + eps)
    return (normed * layer["scale"] + layer["bias"]).astype(x.dtype)


def _merge(config: VisionConfig, merger: dict, x, after: bool):
    """2x2 patches into one token: normed before the merge (the final merger) or after (the deepstack ones)."""
    width = config.hidden_size * config.merge_unit
    x = layer_norm(x.reshape(-1, width), merger["norm"], config.norm_eps) if after else \
        layer_norm(x, merger["norm"], config.norm_eps).reshape(-1, width)
    return linear(jax.nn.gelu(linear(x, merger["linear_fc1"]), approximate=False), merger["linear_fc2"])


def encode(config: VisionConfig, dtype, params: dict, inputs: EncoderInputs):
    """The tower over one call's patches: `[N / merge_unit, (1 + deepstack) * out_hidden_size]` (the embeddings,
    then each deepstack block's merged output). A step: `(outputs, new_state)` with no state."""
    eps = config.norm_eps
    x = linear(inputs.patches.astype(dtype), params["patch_embed"])
    table = params["pos_embed"].astype(jnp.float32)
    x = x + (table[inputs.table_rows] * inputs.table_weights[..., None]).sum(1).astype(x.dtype)
    features = []
    for index, block in enumerate(params["blocks"]):
        x = x + attention(config, block, layer_norm(x, block["norm1"], eps), inputs.positions, inputs.images)
        h = layer_norm(x, block["norm2"], eps)
        x = x + linear(jax.nn.gelu(linear(h, block["linear_fc1"]), approximate=True), block["linear_fc2"])
        if index in config.deepstack_visual_indexes:
            merger = params["deepstack_mergers"][config.deepstack_visual_indexes.index(index)]
            features.append(_merge(config, merger, x, after=True))
    return jnp.concatenate([_merge(config, params["merger"], x, after=False), *features], axis=-1), ()


def activation_bytes(config: VisionConfig, patches: int) -> int:
    """A bound on one `encode` call's temporaries (see `qwen2_5_vit.activation_bytes`)."""
    return 4 * patches * (3 * config.num_heads * min(patches, QUERY_BLOCK) + 4 * config.hidden_size
                          + 3 * config.intermediate_size + 2 * len(config.deepstack_visual_indexes)
                          * config.out_hidden_size)


def checkpoint_tensors(config: VisionConfig) -> dict:
    """The tower's parameter tree with the checkpoint tensor (under the tower's prefix) each leaf is read from, and
    whether it is stored transposed."""
    def linear_tensors(name: str) -> dict:
        return {"kernel": (f"{name}.weight", True), "bias": (f"{name}.bias", False)}

    def norm(name: str) -> dict:
        return {"scale": (f"{name}.weight", False), "bias": (f"{name}.bias", False)}

    def merger(name: str) -> dict:
        return {"norm": norm(f"{name}.norm"), "linear_fc1": linear_tensors(f"{name}.linear_fc1"),
                "linear_fc2": linear_tensors(f"{name}.linear_fc2")}

    blocks = [{"norm1": norm(f"blocks.{i}.norm1"), "norm2": norm(f"blocks.{i}.norm2"),
               "qkv": linear_tensors(f"blocks.{i}.attn.qkv"), "proj": linear_tensors(f"blocks.{i}.attn.proj"),
               "linear_fc1": linear_tensors(f"blocks.{i}.mlp.linear_fc1"),
               "linear_fc2": linear_tensors(f"blocks.{i}.mlp.linear_fc2")} for i in range(config.depth)]
    return {"patch_embed": linear_tensors("patch_embed.proj"), "pos_embed": ("pos_embed.weight", False),
            "blocks": blocks, "merger": merger("merger"),
            "deepstack_mergers": [merger(f"deepstack_merger_list.{i}")
                                  for i in range(len(config.deepstack_visual_indexes))]}


def checkpoint_shapes(config: VisionConfig) -> dict:
    """The shape each leaf of `checkpoint_tensors` has once read (kernels `[in, out]`; the fused q/k/v's
    `[in, 3, width]`)."""
    d, inner, merged = config.hidden_size, config.intermediate_size, config.hidden_size * config.merge_unit

    def dense(fan_in: int, fan_out: int) -> dict:
        return {"kernel": (fan_in, fan_out), "bias": (fan_out,)}

    def merger(norm_width: int) -> dict:
        return {"norm": {"scale": (norm_width,), "bias": (norm_width,)}, "linear_fc1": dense(merged, merged),
                "linear_fc2": dense(merged, config.out_hidden_size)}

    block = {"norm1": {"scale": (d,), "bias": (d,)}, "norm2": {"scale": (d,), "bias": (d,)},
             "qkv": {"kernel": (d, 3, d), "bias": (3, d)}, "proj": dense(d, d), "linear_fc1": dense(d, inner),
             "linear_fc2": dense(inner, d)}
    return {"patch_embed": dense(config.patch_dim, d), "pos_embed": (config.num_position_embeddings, d),
            "blocks": [block] * config.depth, "merger": merger(d),
            "deepstack_mergers": [merger(merged)] * len(config.deepstack_visual_indexes)}

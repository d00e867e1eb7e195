"""Qwen2.5-VL's vision tower: its config, the host-side layout of a call's images (`encoder_inputs`), the pure
encoder (`encode`: patches in, the language model's image embeddings out) and its weights.

The tower embeds 14x14 patches (two frames of a still image) with a linear map, runs `depth` blocks of pre-norm
attention and MLP with a 2-D rope (height and width positions), most blocks attending within windows of
`window_size` pixels and the `fullatt_block_indexes` across the whole image, and merges each 2x2 group of patches
into one token of the language model's width (`merger`). The host lays the patches out in window order (the
windows' 2x2 groups together) and says which window and which image each patch belongs to; the device computes
attention masked by those ids (dense, in query blocks), so one compiled shape serves any image up to its patch
count. The output comes back in the window order and the host puts it back in raster order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.norms import rms_normalize
from jaxserve.layers.rotary import apply_rope, frequency_positions

QUERY_BLOCK = 1024  # queries whose attention weights are held at once, so memory grows with patches, not squared


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A Qwen-VL tower's shape: this one's window attention (`window_size` pixels, but in the
    `fullatt_block_indexes` blocks), or Qwen3-VL's position table and deepstack blocks (`qwen3_vit`)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    in_channels: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


# Under tensor parallelism each block splits as the decoder's (`multimodal.vision.tower_shardings`): the fused q/k/v
# and the MLP's first linears by output (heads, features), the attention's and the MLP's last by input; the rest is
# replicated. Paths as `path_name` writes them; the first match wins.
SHARDING_RULES = ((r"^blocks/.*/(qkv|gate_proj|up_proj)/", "columns"), (r"^blocks/.*/(proj|down_proj)/kernel$", "rows"),
                  (r".", "replicated"))

ACTIVATIONS = {"qwen2_5_vl": "silu", "qwen3_vl": "gelu_pytorch_tanh", "qwen3_5": "gelu_pytorch_tanh",
               "qwen3_5_moe": "gelu_pytorch_tanh"}  # each tower's MLP


def parse_vision_config(hf_config: Any) -> VisionConfig:
    """The tower's config from a `qwen2_5_vl`, `qwen3_vl` or `qwen3_5(_moe)` config's `vision_config`; ValueError
    naming what this code cannot compute."""
    hf_vision, activation = hf_config.vision_config, ACTIVATIONS[hf_config.model_type]
    if getattr(hf_vision, "hidden_act", activation) != activation:
        raise ValueError(f"vision hidden_act {hf_vision.hidden_act!r} is not supported (jaxserve's "
                         f"{hf_config.model_type} tower computes {activation})")
    rope = dict(getattr(hf_vision, "rope_parameters", None) or {})
    return VisionConfig(
        depth=hf_vision.depth, hidden_size=hf_vision.hidden_size, intermediate_size=hf_vision.intermediate_size,
        num_heads=hf_vision.num_heads, out_hidden_size=hf_vision.out_hidden_size, patch_size=hf_vision.patch_size,
        temporal_patch_size=hf_vision.temporal_patch_size, spatial_merge_size=hf_vision.spatial_merge_size,
        window_size=getattr(hf_vision, "window_size", 0),
        fullatt_block_indexes=tuple(getattr(hf_vision, "fullatt_block_indexes", None) or ()),
        num_position_embeddings=getattr(hf_vision, "num_position_embeddings", 0),
        deepstack_visual_indexes=tuple(getattr(hf_vision, "deepstack_visual_indexes", None) or ()),
        in_channels=hf_vision.in_channels, rope_theta=float(rope.get("rope_theta", 10000.0)))


@flax.struct.dataclass
class EncoderInputs:
    """One call's patches in window order, padded to a patch bucket (padding: image -1)."""

    patches: jax.Array  # float32 [N, patch_dim]
    positions: jax.Array  # int32 [2, N]: each patch's row and column in its image's patch grid
    images: jax.Array  # int32 [N]: the image each patch belongs to (-1: padding); full-attention blocks' groups
    windows: jax.Array  # int32 [N]: the window each patch belongs to (-1: padding); the other blocks' groups


def window_order(config: VisionConfig, grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
    """An image's merge units (2x2 patch groups, raster order) in window order, and each window's unit count
    (transformers' `get_vision_window_index` for one frame)."""
    merge = config.spatial_merge_size
    units_h, units_w = grid_h // merge, grid_w // merge
    per_window = config.window_size // merge // config.patch_size
    pad_h, pad_w = -units_h % per_window, -units_w % per_window
    index = np.pad(np.arange(units_h * units_w).reshape(units_h, units_w), ((0, pad_h), (0, pad_w)),
                   constant_values=-1)
    rows, cols = (units_h + pad_h) // per_window, (units_w + pad_w) // per_window
    index = index.reshape(rows, per_window, cols, per_window).transpose(0, 2, 1, 3).reshape(rows * cols, -1)
    counts = (index >= 0).sum(axis=1)
    return index[index >= 0], counts[counts > 0]


def merge_unit_positions(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Each patch's (row, column) `[2, grid_h * grid_w]` in the processor's order: merge units (merge x merge
    patches) in raster order, each unit's patches in raster order."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    blocks = (grid_h // merge, merge, grid_w // merge, merge)
    return np.stack([rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1),
                     cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)])


def one_frame(grid_thw: tuple[int, int, int]) -> tuple[int, int]:
    """An image's patch grid (height, width); ValueError for more than one temporal patch (video)."""
    grid_t, grid_h, grid_w = grid_thw
    if grid_t != 1:
        raise ValueError(f"an image has one temporal patch, got grid {grid_thw}")
    return grid_h, grid_w


def check_fits(config: VisionConfig, images: list, bucket: int) -> None:
    patches = sum(int(np.prod(grid)) for _, grid in images)
    if patches > bucket:
        raise ValueError(f"{len(images)} images of {patches} patches exceed the encoder call's {bucket}")


def encoder_inputs(config: VisionConfig, images: list[tuple[np.ndarray, tuple[int, int, int]]],
                   bucket: int) -> tuple[EncoderInputs, list[np.ndarray]]:
    """One call over `images` (pixels and patch grid each), their patches back to back in window order and padded
    to `bucket`; and each image's tokens in raster order as rows of the call's output."""
    check_fits(config, images, bucket)
    inputs = EncoderInputs(patches=np.zeros((bucket, config.patch_dim), np.float32),
                           positions=np.zeros((2, bucket), np.int32), images=np.full(bucket, -1, np.int32),
                           windows=np.full(bucket, -1, np.int32))
    unit, first, first_window, orders = config.merge_unit, 0, 0, []
    for index, (pixel_values, grid_thw) in enumerate(images):
        grid_h, grid_w = one_frame(grid_thw)
        patches = slice(first, first + grid_h * grid_w)
        units, counts = window_order(config, grid_h, grid_w)
        order = (units[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
        inputs.patches[patches] = pixel_values[order]
        inputs.positions[:, patches] = merge_unit_positions(grid_h, grid_w, config.spatial_merge_size)[:, order]
        inputs.images[patches] = index
        inputs.windows[patches] = first_window + np.repeat(np.arange(len(counts)), counts * unit)
        orders.append(first // unit + np.argsort(units))
        first, first_window = patches.stop, first_window + len(counts)
    return inputs, orders


def linear(x, layer: dict):
    """`x [N, in]` through a dense layer: its kernel `[in, out...]` (a fused q/k/v's `[in, 3, width]`) and bias."""
    y = jnp.tensordot(x, layer["kernel"].astype(x.dtype), axes=1)
    return y + layer["bias"].astype(x.dtype) if "bias" in layer else y


def _norm(x, scale, eps: float):
    return scale.astype(x.dtype) * rms_normalize(x, eps).astype(x.dtype)


def attention(config, block: dict, x, positions, groups):
    """Bidirectional attention among the patches of each group (`groups [N]`, -1: none), with the 2-D rope of
    `positions [2, N]` (rows' frequencies, then columns'); `config` has `num_heads`, `head_dim`, `rope_theta`."""
    count = x.shape[0]
    heads, head_dim = config.num_heads, config.head_dim
    q, k, v = jnp.split(linear(x, block["qkv"]).reshape(count, 3, heads, head_dim), 3, axis=1)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    quarter = head_dim // 4
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float64) / (head_dim // 2))
    angles = frequency_positions(positions, (quarter, quarter), False)  # rows' frequencies, then columns'
    q, k = (apply_rope(t, angles, np.concatenate([inv_freq, inv_freq])) for t in (q, k))
    block_size = min(count, QUERY_BLOCK)

    def attend(query_block):
        queries, query_groups = query_block  # [Bq, heads, D], [Bq]
        scores = jnp.einsum("qhd,khd->hqk", queries.astype(jnp.float32), k.astype(jnp.float32)) * head_dim ** -0.5
        allowed = (query_groups[:, None] == groups[None, :]) & (groups[None, :] >= 0)
        weights = jax.nn.softmax(jnp.where(allowed[None], scores, -jnp.inf), axis=-1)
        weights = jnp.where(allowed[None], weights, 0.0).astype(v.dtype)  # padding rows: all masked, no NaN
        return jnp.einsum("hqk,khd->qhd", weights, v)
    out = jax.lax.map(attend, (q.reshape(-1, block_size, heads, head_dim), groups.reshape(-1, block_size)))
    return linear(out.reshape(count, heads * head_dim), block["proj"])


def encode(config: VisionConfig, dtype, params: dict, inputs: EncoderInputs):
    """The tower over one call's patches: `[N / merge_unit, out_hidden_size]` image embeddings in window order
    (rows past the image's are padding). A step: `(outputs, new_state)` with no state."""
    eps = config.norm_eps
    x = linear(inputs.patches.astype(dtype), params["patch_embed"])
    for index, block in enumerate(params["blocks"]):
        groups = inputs.images if index in config.fullatt_block_indexes else inputs.windows
        x = x + attention(config, block, _norm(x, block["norm1"], eps), inputs.positions, groups)
        h = _norm(x, block["norm2"], eps)
        x = x + linear(jax.nn.silu(linear(h, block["gate_proj"])) * linear(h, block["up_proj"]), block["down_proj"])
    merger = params["merger"]
    x = _norm(x, merger["ln_q"], eps).reshape(-1, config.hidden_size * config.merge_unit)
    x = linear(jax.nn.gelu(linear(x, merger["mlp_0"]), approximate=False), merger["mlp_2"])
    return x, ()


def activation_bytes(config: VisionConfig, patches: int) -> int:
    """A bound on the temporaries of one `encode` call of `patches` patches: the float32 attention scores of a query
    block against every patch (three copies: scores, weights, their mask) and each patch's activations. `jaxserve
    compile` checks it against the compiled step (tests/test_compile_targets.py)."""
    return 4 * patches * (3 * config.num_heads * min(patches, QUERY_BLOCK) + 4 * config.hidden_size
                          + 3 * config.intermediate_size)


def checkpoint_tensors(config: VisionConfig) -> dict:
    """The tower's parameter tree with the checkpoint tensor (under the tower's prefix) each leaf is read from, and
    whether it is stored transposed (`[out, in]` linears)."""
    def dense(name: str, bias: bool = True) -> dict:
        layer = {"kernel": (f"{name}.weight", True)}
        return {**layer, "bias": (f"{name}.bias", False)} if bias else layer

    blocks = [{"norm1": (f"blocks.{i}.norm1.weight", False), "norm2": (f"blocks.{i}.norm2.weight", False),
               "qkv": dense(f"blocks.{i}.attn.qkv"), "proj": dense(f"blocks.{i}.attn.proj"),
               **{name: dense(f"blocks.{i}.mlp.{name}") for name in ("gate_proj", "up_proj", "down_proj")}}
              for i in range(config.depth)]
    return {"patch_embed": {"kernel": ("patch_embed.proj.weight", True)}, "blocks": blocks,
            "merger": {"ln_q": ("merger.ln_q.weight", False), "mlp_0": dense("merger.mlp.0"),
                       "mlp_2": dense("merger.mlp.2")}}


def checkpoint_shapes(config: VisionConfig) -> dict:
    """The shape each leaf of `checkpoint_tensors` has once read (kernels `[in, out]`; the fused q/k/v's
    `[in, 3, width]`, so its heads split over devices as q's, k's and v's)."""
    d, inner, merged = config.hidden_size, config.intermediate_size, config.hidden_size * config.merge_unit

    def dense(fan_in: int, fan_out: int, bias: bool = True) -> dict:
        return {"kernel": (fan_in, fan_out), **({"bias": (fan_out,)} if bias else {})}

    block = {"norm1": (d,), "norm2": (d,), "qkv": {"kernel": (d, 3, d), "bias": (3, d)}, "proj": dense(d, d),
             "gate_proj": dense(d, inner), "up_proj": dense(d, inner), "down_proj": dense(inner, d)}
    return {"patch_embed": dense(config.patch_dim, d, bias=False), "blocks": [block] * config.depth,
            "merger": {"ln_q": (d,), "mlp_0": dense(merged, merged), "mlp_2": dense(merged, config.out_hidden_size)}}

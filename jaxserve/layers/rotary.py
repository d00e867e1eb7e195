"""Rotary position embeddings (RoPE) with the linear, Llama-3, YaRN, LongRoPE and dynamic-NTK frequency scalings, in
Hugging Face's half-split layout. YaRN and LongRoPE also scale the rotated vectors (`rope_attention_factor`), as
transformers scales cos and sin.

LongRoPE and dynamic NTK change the frequencies with the sequence's length past a threshold, as transformers does
(`LENGTH_RULES`): dynamic NTK computes one forward's frequencies from its longest position, so in transformers'
greedy loop a prompt's tokens rotate by the prompt's length and each later token by its own position + 1 ("prompt");
Phi-3 (LongRoPE) rotates every token of a sequence by whether the whole sequence is longer than the threshold, and
recomputes the cache of one that outgrows it ("sequence"; the scheduler requeues such a sequence for recompute).
Each token carries its "rope length" (`AttentionMetadata.rope_lens`): `max(base, position + 1)` with base the
prompt's length (prompt) or the sequence's at its prefill (sequence), so chunked prefill, batching and recomputing
a preempted sequence rotate every token as transformers does (`token_inverse_frequencies`).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np


LENGTH_RULES = {"longrope": "sequence", "dynamic": "prompt"}  # what a token's rope length is taken from


def rope_length_threshold(scaling: dict[str, Any] | None) -> int | None:
    """The rope length past which a length-dependent rope's frequencies change (None for the other ropes)."""
    if not scaling or scaling["rope_type"] not in LENGTH_RULES:
        return None
    key = "original_max_position_embeddings" if scaling["rope_type"] == "longrope" else "max_position_embeddings"
    return int(scaling[key])


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Per-pair rotation frequencies `[head_dim // 2]`, computed once on the host in float64 (a length-dependent
    rope's at lengths up to its threshold)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "dynamic":
        return inv_freq
    if rope_type == "longrope":
        return inv_freq / np.asarray(scaling["short_factor"], np.float64)
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling, factor)
    if rope_type == "proportional":  # Gemma 4's global layers: the first pairs turn at the whole head's frequencies,
        turned = int(float(scaling["partial_rotary_factor"]) * head_dim // 2)  # the rest not at all
        return np.concatenate([inv_freq[:turned], np.zeros(head_dim // 2 - turned)]) / factor
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def token_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any], rope_lens: jnp.ndarray
                              ) -> jnp.ndarray:
    """A length-dependent rope's frequencies `[..., tokens, head_dim // 2]` for tokens of `rope_lens [..., tokens]`:
    LongRoPE's long factors past the original length, else its short ones; dynamic NTK's base grown with the length
    past the model's, `theta * (factor * L / M - factor + 1) ** (d / (d - 2))`, in float32 as transformers
    computes it."""
    threshold = rope_length_threshold(scaling)
    short = jnp.asarray(rope_inverse_frequencies(head_dim, theta, scaling), jnp.float32)
    beyond = (rope_lens > threshold)[..., None]
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    if scaling["rope_type"] == "longrope":
        long = 1.0 / (jnp.asarray(scaling["long_factor"], jnp.float32) * jnp.float32(theta) ** exponents)
        return jnp.where(beyond, long, short)
    factor = jnp.float32(scaling["factor"])
    length = jnp.maximum(rope_lens, threshold).astype(jnp.float32)[..., None]
    base = jnp.float32(theta) * ((factor * length / threshold) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return jnp.where(beyond, 1.0 / base ** exponents, short)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are scaled by: YaRN's and LongRoPE's `attention_factor` (given, or from `factor`: YaRN
    with the optional `mscale` / `mscale_all_dim`, LongRoPE `sqrt(1 + ln factor / ln original length)`), 1 for the
    other rope types."""
    if not scaling or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor, 1.0)


def yarn_softmax_scale(scaling: tuple[tuple[str, Any], ...] | dict[str, Any] | None) -> float:
    """What MLA (DeepSeek) multiplies its softmax scale by: mscale(factor, `mscale_all_dim`) squared under a rope
    scaling that sets `mscale_all_dim`, else 1 (transformers' `yarn_apply_mscale`)."""
    scaling = dict(scaling) if scaling else {}
    if scaling.get("rope_type", "default") == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any], factor: float) -> np.ndarray:
    """YaRN (arXiv:2309.00071): frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times kept, a linear ramp between."""
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(num_rotations: float) -> float:  # the pair index that turns `num_rotations` times
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    original_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    return original_freq * (ramp / factor + (1.0 - ramp))  # ramp 0: kept, 1: interpolated


def frequency_axes(section: tuple[int, ...], interleaved: bool) -> np.ndarray:
    """M-RoPE: the position axis (0 temporal, 1 height, 2 width) each rope frequency turns by: `section[i]`
    frequencies of axis i in order (Qwen2-VL, Qwen2.5-VL), or interleaved T, H, W, T, ... with each axis's count
    (Qwen3-VL)."""
    if not interleaved:
        return np.repeat(np.arange(len(section)), section)
    axes = np.zeros(sum(section), np.int32)
    for axis in (1, 2):
        axes[axis:section[axis] * 3:3] = axis
    return axes


def frequency_positions(positions3: jnp.ndarray, section: tuple[int, ...], interleaved: bool) -> jnp.ndarray:
    """M-RoPE: `positions3 [3, ..., tokens]` (each token's temporal, height and width positions) as each frequency's
    position `[..., tokens, sum(section)]` (`apply_rope`'s per-frequency positions)."""
    return jnp.moveaxis(positions3[frequency_axes(section, interleaved)], 0, -1)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> jnp.ndarray:
    """Rotates `x: [..., tokens, heads, head_dim]` by `positions: [..., tokens]` (first half / second half pairs) at
    frequencies `inv_freq` (`[rotary_dim // 2]`, or per token `[..., tokens, rotary_dim // 2]`), scaled by `scale`
    (`rope_attention_factor`). Positions per frequency `[..., tokens, rotary_dim // 2]` (M-RoPE's,
    `frequency_positions`) turn each frequency by its own. With a `rotary_dim` below head_dim (partial rotary) only
    the first `rotary_dim` dims turn; the rest pass as they are."""
    rotary_dim = 2 * np.shape(inv_freq)[-1]
    if rotary_dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary_dim], positions, inv_freq, scale), x[..., rotary_dim:]],
                               axis=-1)
    per_frequency = positions if positions.ndim == x.ndim - 1 else positions[..., None]
    angles = per_frequency.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)

"""Speculative decoding: proposals from n-gram prompt lookup (`ngram`), a draft model (`draft`), an EAGLE-3 head
(`eagle3`) or the model's own MTP layer (`mtp`), the heads run by `head_steps`, checked by one forward of the
target over K+1 tokens per sequence and accepted on the device (`verify`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig
    from jaxserve.spec_decode.head_steps import Head

__all__ = ["SpeculativeConfig", "proposer_config"]


def proposer_config(spec: SpeculativeConfig | None, target: "ModelConfig", max_model_len: int,
                    model: str | None = None) -> "ModelConfig | Head | None":
    """What the runner builds the proposer from, read and checked against the target (`model`: its checkpoint)
    before either is loaded: a draft model's `ModelConfig`, a head's (`Eagle3Config`, `MTPConfig`), or None
    (n-gram, no speculation)."""
    from jaxserve.spec_decode.draft import draft_model_config
    from jaxserve.spec_decode.eagle3 import eagle3_config
    from jaxserve.spec_decode.mtp import mtp_config

    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "draft_model":
        return draft_model_config(spec, target, max_model_len)
    if spec.uses_mtp:
        return mtp_config(spec.model or model, target)
    return eagle3_config(spec.model, target)

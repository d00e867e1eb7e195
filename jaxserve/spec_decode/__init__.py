"""Speculative decoding: proposals from n-gram prompt lookup (`ngram`) or a draft model (`draft`), checked by one
forward of the target over K+1 tokens per sequence and accepted on the device (`verify`)."""

from jaxserve.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]

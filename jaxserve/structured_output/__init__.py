"""Constrained decoding: a request's `GuidedDecodingParams` compiled by llguidance into a grammar, one matcher per
sequence advanced on the host, and the token bitmask the sampler applies on the device."""

from jaxserve.structured_output.grammar import GrammarCompiler

__all__ = ["GrammarCompiler"]

"""`GrammarCompiler`: a request's `GuidedDecodingParams` -> an llguidance grammar, validated against the model's
tokenizer once per grammar text (so a bad schema or grammar is a ValueError before the request reaches the engine
loop), a matcher per sequence, and the packed token bitmasks `[rows, ceil(vocab / 32)]` of a step's rows.

JSON whitespace: none is allowed but one space after ',' and ':' (as `json.dumps` writes), so a small model cannot
loop on spaces or newlines inside a constrained object. JSON schemas are made strict first (`json_schema.py`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from jaxserve.sampling_params import GuidedDecodingParams
from jaxserve.structured_output.json_schema import strict_json_schema

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (any thread); hands out a fresh matcher per sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # grammar text -> a matcher in its initial state
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._ll_tokenizer is None:  # about a second: built on the first constrained request
            import llguidance.hf

            if self._hf_tokenizer is None:
                raise ValueError("guided decoding needs the model's tokenizer, and this model has none")
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self._eos)
        return self._ll_tokenizer

    @staticmethod
    def grammar_text(params: GuidedDecodingParams) -> str:
        """The llguidance grammar of `params` (not yet checked)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if params.json is not None or params.json_object:
            schema = strict_json_schema(params.json) if params.json is not None else {"type": "object"}
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as err:
                raise ValueError(f"guided json is not a valid JSON schema: {err}") from err
        if params.regex is not None:
            return LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        try:  # Lark as it is; GBNF (llama.cpp's) converted to Lark
            grammar = any_to_lark(params.grammar)
        except Exception as err:  # the converter raises plain Exceptions for malformed GBNF
            raise ValueError(f"guided grammar is neither Lark nor valid GBNF: {err}") from err
        return LLMatcher.grammar_from_lark(grammar)

    def compile(self, params: GuidedDecodingParams) -> str:
        """The grammar text of `params`, compiled and cached; ValueError with llguidance's message if it fails."""
        from llguidance import LLMatcher

        text = self.grammar_text(params)
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return text
        matcher = LLMatcher(self._tokenizer(), text, log_level=0)  # compiles without the GIL
        if matcher.is_error():
            raise ValueError(f"guided decoding: the grammar does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[text] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return text

    def matcher(self, params: GuidedDecodingParams):
        """A matcher in the initial state of `params`' grammar (compiled on first use), for one sequence."""
        text = self.compile(params)
        with self._lock:
            pristine = self._cache.get(text)
        if pristine is None:  # evicted between the two steps
            return self.matcher(params)
        return pristine.deep_copy()



_executor = None


def fill_bitmask(bitmask: np.ndarray, rows: list[tuple[Any, int]]) -> None:
    """Writes the next-token mask of each (matcher, row) into `bitmask [rows, words]` (int32, C order), the rows'
    matchers in parallel without the GIL; rows not listed keep what they hold."""
    global _executor
    import llguidance
    import llguidance.numpy

    if _executor is None:
        _executor = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(_executor, rows, bitmask)


def token_bitmask(num_rows: int, vocab_size: int, rows: list[tuple[Any, int]], eos_token_ids) -> np.ndarray:
    """A sampler call's token mask, int32 [num_rows, words]: each (matcher, row) listed gets its matcher's next-token
    mask, without the EOS ids while its grammar is unfinished (an EOS id that is also a text token ends nothing);
    other rows allow every token."""
    bitmask = np.full((num_rows, bitmask_words(vocab_size)), -1, np.int32)
    if rows:
        fill_bitmask(bitmask, rows)
    words = bitmask.view(np.uint32)
    for matcher, row in rows:
        if not matcher.is_accepting():
            for eos in eos_token_ids:
                words[row, eos // 32] &= ~np.uint32(1 << (eos % 32))
    return bitmask

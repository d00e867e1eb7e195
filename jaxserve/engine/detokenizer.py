"""`IncrementalDetokenizer`: output token ids -> text, one token at a time, with stop-string detection.

Decoding goes through `tokenizers`' `DecodeStream`, which holds back bytes until they form whole
UTF-8 characters. While a request has stop strings, the last (longest stop string - 1) characters
are held back from streamed text, so a stop string split across tokens never leaks to the client.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool, include_stop_str: bool = False):
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.text = ""
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int) -> str | None:
        """Appends one token's text; returns the stop string if the text now contains one (text cut before it)."""
        if self._backend is None:
            return None
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, search_from)) != -1]
        if not found:
            return None
        at, stop = min(found)
        self.text = self.text[:at + len(stop)] if self.include_stop_str else self.text[:at]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: all of it once finished, else without a possible stop-string start."""
        if finished or not self._holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self._holdback)]

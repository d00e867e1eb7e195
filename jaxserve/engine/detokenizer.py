"""`IncrementalDetokenizer`: output token ids -> text, one token at a time, with stop-string detection.

Decoding goes through `tokenizers`' `DecodeStream`, primed with the prompt's token ids, so the text
is exactly `decode(prompt + output)[len(decode(prompt)):]`: SentencePiece (Metaspace) tokenizers keep
the space of the first generated word, and bytes are held back until they form whole UTF-8
characters. While a request has stop strings, the last (longest stop string - 1) characters are held
back from streamed text, so a stop string split across tokens never leaks to the client.

Stop strings are searched only in text that arrived once the caller asks for it (`check_stop`, false
before `min_tokens` outputs, as in vLLM): the text is always a prefix of the decoded output tokens.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop_str: bool = False):
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        self._stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.text = ""
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Appends one token's text. With `check_stop`, returns the first stop string that the new text
        completes (the text is then cut before it, or after it with `include_stop_str`)."""
        if self._backend is None:
            return None
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        old_length = len(self.text)
        self.text += piece
        if not check_stop:
            return None
        found = [(at, stop) for stop in self.stop
                 if (at := self.text.find(stop, max(0, old_length - len(stop) + 1))) != -1]
        if not found:
            return None
        at, stop = min(found)
        self.text = self.text[:at + len(stop)] if self.include_stop_str else self.text[:at]
        return stop

    def visible_length(self, finished: bool) -> int:
        """How much of the text is safe to show now: all of it once finished, else all but a possible
        stop-string start."""
        if finished or not self._holdback:
            return len(self.text)
        return max(0, len(self.text) - self._holdback)

    def visible_text(self, finished: bool, start: int = 0) -> str:
        """The text safe to show now, from character `start` on (a delta copies only what it returns)."""
        return self.text[start:self.visible_length(finished)]

"""`IncrementalDetokenizer`: output token ids -> text, one token at a time, with stop-string detection; and
`DetokenizedText`, the text it builds (what the engine keeps of a text made in the detokenizer process).

Decoding goes through `tokenizers`' `DecodeStream`, primed with the prompt's token ids, so the text
is exactly `decode(prompt + output)[len(decode(prompt)):]`: SentencePiece (Metaspace) tokenizers keep
the space of the first generated word, and bytes are held back until they form whole UTF-8
characters. While a request has stop strings, the last (longest stop string - 1) characters are held
back from streamed text, so a stop string split across tokens never leaks to the client.

Stop strings are searched only in text that arrived once the caller asks for it (`check_stop`, false
before `min_tokens` outputs, as in vLLM): the text is always a prefix of the decoded output tokens.
"""

from __future__ import annotations

import bisect

from tokenizers.decoders import DecodeStream


class DetokenizedText:
    """A completion's text, kept as the list of pieces that made it (with their end offsets), so a piece costs
    O(its length), never O(the text so far); the last (longest stop string - 1) characters are held back from
    view until the completion finishes."""

    def __init__(self, stop: list[str]):
        self._pieces: list[str] = []
        self._ends: list[int] = []  # the text's length after each piece
        self._length = 0
        self._holdback = max(max((len(s) for s in stop), default=0), 1) - 1

    @property
    def text(self) -> str:
        """The whole text so far (O(its length): for outputs, not per token)."""
        return "".join(self._pieces)

    def __len__(self) -> int:
        return self._length

    def append(self, piece: str) -> None:
        self._length += len(piece)
        self._pieces.append(piece)
        self._ends.append(self._length)

    def cut(self, length: int) -> None:
        """Keeps the first `length` characters (once, when a stop string ends the completion)."""
        text = self.text[:length]
        self._pieces, self._ends, self._length = [text], [len(text)], len(text)

    def text_from(self, start: int, end: int | None = None) -> str:
        """Characters [start, end) of the text, joined from the pieces that hold them."""
        end = len(self) if end is None else end
        if start >= end:
            return ""
        first = bisect.bisect_right(self._ends, start)
        piece_start = self._ends[first - 1] if first else 0
        joined = "".join(self._pieces[first:bisect.bisect_left(self._ends, end) + 1])
        return joined[start - piece_start:end - piece_start]

    def visible_length(self, finished: bool) -> int:
        """How much of the text is safe to show now: all of it once finished, else all but a possible
        stop-string start."""
        if finished or not self._holdback:
            return len(self)
        return max(0, len(self) - self._holdback)

    def visible_text(self, finished: bool, start: int = 0) -> str:
        """The text safe to show now, from character `start` on (a delta copies only what it returns)."""
        return self.text_from(start, self.visible_length(finished))


class IncrementalDetokenizer(DetokenizedText):
    """Token ids in, text out; a token costs O(its piece + the longest stop string). `tokenizer`: a transformers
    tokenizer or a `tokenizers.Tokenizer` (None: no text)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop_str: bool = False):
        super().__init__(stop)
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self._tail = ""  # the text's last `_holdback` characters: where a stop string the next piece completes starts

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Appends one token's text. With `check_stop`, returns the first stop string that the new text
        completes (the text is then cut before it, or after it with `include_stop_str`)."""
        if self._backend is None:
            return None
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        self.append(piece)
        if not self.stop:
            return None
        window = self._tail + piece  # text from window_start on
        window_start = self._length - len(window)
        self._tail = window[max(0, len(window) - self._holdback):] if self._holdback else ""
        if not check_stop:
            return None
        found = [(at, stop) for stop in self.stop
                 if (at := window.find(stop, max(0, len(window) - len(piece) - len(stop) + 1))) != -1]
        if not found:
            return None
        at, stop = min(found)
        self.cut(window_start + at + (len(stop) if self.include_stop_str else 0))
        self._tail = ""
        return stop

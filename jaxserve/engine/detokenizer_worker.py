"""The detokenizer process's end of `DetokenizerProcess` (`python -m jaxserve.engine.detokenizer_worker IN OUT`): an
`IncrementalDetokenizer` per sequence, fed the token ids of each message, answering with new text and stop strings."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from jaxserve.engine.detokenizer import IncrementalDetokenizer


class _Stream:
    """The worker's state of one sequence."""

    def __init__(self, backend, prompt_token_ids, stop, skip_special_tokens, include_stop_str, min_tokens):
        self.detokenizer = IncrementalDetokenizer(backend, prompt_token_ids, stop, skip_special_tokens,
                                                  include_stop_str)
        self.min_tokens = min_tokens
        self.num_fed = 0
        self.sent = 0  # characters of text already answered
        self.stop: str | None = None

    def feed(self, tokens: list[int]) -> tuple[str, int, str | None, int] | None:
        if self.stop is not None:  # stopped: the engine trims what it computed meanwhile
            return None
        detokenizer = self.detokenizer
        for token in tokens:
            self.num_fed += 1
            self.stop = detokenizer.add_token(token, self.num_fed >= self.min_tokens)
            if self.stop is not None:
                break
        length = len(detokenizer)
        new_text = detokenizer.text_from(self.sent) if length > self.sent else ""
        self.sent = length
        return new_text, length, self.stop, self.num_fed


def serve(recv_conn: Connection, send_conn: Connection, tokenizer_file: str) -> None:
    """The worker's loop: until the engine's end of the pipe closes."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(tokenizer_file)
    os.unlink(tokenizer_file)
    streams: dict[int, _Stream] = {}
    while True:
        try:
            ops = recv_conn.recv()
        except EOFError:
            return
        answers, fed = [], False
        for op in ops:
            kind, key = op[0], op[1]
            if kind == "open":
                streams[key] = _Stream(backend, *op[2:])
            elif kind == "feed":
                fed = True
                answer = streams[key].feed(op[2])
                if answer is not None:
                    answers.append((key, *answer))
            else:
                streams.pop(key, None)
        if fed:
            send_conn.send(answers)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False), sys.argv[3])

"""`DetokenizerProcess`: output token ids -> text and stop strings, in a second process (off the stepping thread's GIL).

The stepping thread queues each sequence's new token ids (`feed`) and sends one message per step (`flush`); the
process runs an `IncrementalDetokenizer` per sequence and answers with each sequence's new text, its length, and
the stop string the text completed, if any, with the number of output tokens fed when it did. The engine keeps
a mirror of each text (`DetokenizedText`) and applies a stop string one or two steps after its token (trimming
the tokens computed meanwhile), so outputs are those of inline detokenization, only later.

Messages are lists of tuples over a pipe pair (`multiprocessing.connection`); the worker is started with
`python -m jaxserve.engine.detokenizer_worker` (no re-import of the user's main module, unlike
multiprocessing's spawn).

    ("open", key, prompt_token_ids, stop, skip_special_tokens, include_stop_str, min_tokens)
    ("feed", key, token_ids)
    ("close", key)
    -> [(key, new_text, length, stop_string | None, num_fed), ...]   # one answer per message with feeds
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection

Answer = tuple[int, str, int, "str | None", int]


class DetokenizerProcess:
    """The engine's end: queues operations, sends them once per step, and reads the answers."""

    def __init__(self, tokenizer):
        # the tokenizer goes as a file the worker reads (and removes): a pipe would block start-up until the worker
        # has imported its modules
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="jaxserve-tokenizer-", delete=False) as file:
            file.write(tokenizer.backend_tokenizer.to_str())
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.engine.detokenizer_worker", str(to_worker_r), str(from_worker_w),
             file.name], pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL)
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._send_conn = Connection(to_worker_w, readable=False)
        self._recv_conn = Connection(from_worker_r, writable=False)
        self._ops: list[tuple] = []
        self._feeds: dict[int, list[int]] = {}
        self.num_unanswered = 0  # messages with feeds sent and not yet answered

    def open(self, key: int, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool,
             include_stop_str: bool, min_tokens: int) -> None:
        self._ops.append(("open", key, prompt_token_ids, stop, skip_special_tokens, include_stop_str, min_tokens))

    def feed(self, key: int, token: int) -> None:
        tokens = self._feeds.get(key)
        if tokens is None:
            self._feeds[key] = tokens = []
            self._ops.append(("feed", key, tokens))
        tokens.append(token)

    def close(self, key: int) -> None:
        self._ops.append(("close", key))

    def flush(self) -> None:
        """Sends the step's operations (nothing if there are none)."""
        if not self._ops:
            return
        try:
            self._send_conn.send(self._ops)
        except OSError as error:  # BrokenPipeError among them
            raise self._died() from error
        self.num_unanswered += bool(self._feeds)
        self._ops, self._feeds = [], {}

    def answers(self, timeout: float = 0.0) -> list[Answer]:
        """The answers that have arrived (waiting up to `timeout` seconds for the first)."""
        answers: list[Answer] = []
        try:
            while self.num_unanswered and self._recv_conn.poll(timeout):
                answers += self._recv_conn.recv()
                self.num_unanswered -= 1
                timeout = 0.0
        except (EOFError, OSError) as error:
            raise self._died() from error
        return answers

    def _died(self) -> RuntimeError:
        return RuntimeError(f"the detokenizer process died (exit code {self._process.poll()})")

    def __del__(self) -> None:  # the worker exits when its pipe closes
        conn = getattr(self, "_send_conn", None)
        if conn is not None:
            conn.close()

"""`Request`: one user request — its prompt, its `n` sequences and its timing — as the stepping thread holds it.

Its outputs are built by the output processor (`engine/output_processor.py`). A request ends on both
sides: the engine retires it once its sequences are finished, and the processor once its final output
is out; its id may be used again only after both.
"""

from __future__ import annotations

import threading

from jaxserve.engine.sequence import Sequence
from jaxserve.sampling_params import SamplingParams


class Request:
    """One user request: a prompt and its `n` sequences, and timing."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None  # when the final output was built
        self.output_done = False  # the output processor sent the final output
        self._sides_left = 2
        self._lock = threading.Lock()

    @property
    def finished(self) -> bool:
        """All sequences are finished, as the stepping thread sees them."""
        return all(seq.is_finished for seq in self.seqs)

    def end_side(self) -> bool:
        """Called once by the engine and once by the output processor when each is done; True for the later."""
        with self._lock:
            self._sides_left -= 1
            return self._sides_left == 0

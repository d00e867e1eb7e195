"""`Request`: one user request — its prompt, its `n` sequences and their detokenizers — and its `RequestOutput`s.

Outputs are snapshots in the request's `RequestOutputKind`: cumulative, deltas (what is new since the
previous output, so a streaming client costs O(new tokens) per step), or only the final one. A request asking for
prompt logprobs reports nothing until its whole prompt is scored (unless it ends first), so its first output has
them (a DELTA request's later ones do not); the list is never changed again, so the snapshots share it.
"""

from __future__ import annotations

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.sequence import Sequence
from jaxserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class Request:
    """One user request: a prompt and its `n` sequences, the per-sequence detokenizers, and timing."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], detokenizers: list[IncrementalDetokenizer], arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.detokenizers = detokenizers
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self._sent_tokens = [0] * len(seqs)  # per sequence: tokens (and logprobs) already in a DELTA output
        self._sent_chars = [0] * len(seqs)  # per sequence: characters of text already in a DELTA output
        self._sent_finished = [False] * len(seqs)
        # prompt_logprobs: per prompt token so far (None for the first), complete once it has len(prompt) entries
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self._sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(genexpr): asked for every request each step
            if not seq.is_finished:
                return False
        return True

    @property
    def finish_reason(self) -> str:
        """The request's reason for metrics: "abort" if any completion was aborted, else the first completion's."""
        reasons = [seq.finish_reason for seq in self.seqs]
        return "abort" if "abort" in reasons else reasons[0]

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, Logprob]]) -> None:
        """The entries of prompt tokens `first, first + 1, ...`; those the request has already are dropped."""
        self.prompt_logprobs.extend(entries[len(self.prompt_logprobs) - first:])

    def _prompt_logprobs(self, delta: bool) -> PromptLogprobs | None:
        """The prompt logprobs once complete (None before: an aborted request; and in DELTA outputs after the first)."""
        logprobs = self.prompt_logprobs
        if logprobs is None or len(logprobs) < len(self.prompt_token_ids) or (delta and self._sent_prompt_logprobs):
            return None
        self._sent_prompt_logprobs = delta
        return logprobs

    def output(self) -> RequestOutput | None:
        """A snapshot of the request now, in its output kind; None if there is nothing to report."""
        kind = self.params.output_kind
        finished = self.finished
        if not finished and kind is RequestOutputKind.FINAL_ONLY:
            return None
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) and not finished:
            return None  # another completion may have tokens before the first has scored the prompt
        delta = kind == RequestOutputKind.DELTA
        completions = [self._completion(i, delta) for i in range(len(self.seqs))]
        if delta:
            completions = [c for c in completions if c is not None]
            if not completions:
                return None
        metrics = RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                                 self.last_token_time, self.finished_time)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished, metrics,
                             num_cached_tokens=max(seq.num_cached_tokens for seq in self.seqs),
                             prompt_logprobs=self._prompt_logprobs(delta))

    def _completion(self, index: int, delta: bool) -> CompletionOutput | None:
        seq, detok = self.seqs[index], self.detokenizers[index]
        visible = detok.visible_length(seq.is_finished)
        first_token = first_char = 0
        if delta:  # only what is new is copied, so a streamed request costs O(new tokens) per step
            first_token, first_char = self._sent_tokens[index], self._sent_chars[index]
            changed = seq.num_output_tokens > first_token or visible > first_char
            if not changed and (not seq.is_finished or self._sent_finished[index]):
                return None
            self._sent_tokens[index] = seq.num_output_tokens
            self._sent_chars[index] = visible
            self._sent_finished[index] = seq.is_finished
        token_ids = seq.token_ids[seq.num_prompt_tokens + first_token:]
        logprobs = seq.logprobs[first_token:] if seq.logprobs is not None else None
        text = detok.visible_text(seq.is_finished, first_char)
        return CompletionOutput(index=seq.index, text=text, token_ids=token_ids,
                                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

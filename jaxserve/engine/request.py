"""`Request`: one user request — its prompt, its `n` sequences and their detokenizers — and its `RequestOutput`s.

Outputs are snapshots in the request's `RequestOutputKind`: cumulative, deltas (what is new since the
previous output, so a streaming client costs O(new tokens) per step), or only the final one. A request asking for
prompt logprobs reports nothing until its whole prompt is scored (unless it ends first), so its first output has
them (a DELTA request's later ones do not); the list is never changed again, so the snapshots share it.
"""

from __future__ import annotations

from jaxserve.engine.detokenizer import DetokenizedText
from jaxserve.engine.sequence import Sequence
from jaxserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class Request:
    """One user request: a prompt and its `n` sequences, the per-sequence detokenizers, and timing."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], detokenizers: list[DetokenizedText], arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.detokenizers = detokenizers  # IncrementalDetokenizers, or the DetokenizedTexts of a detokenizer process
        # with a detokenizer process: per sequence, its key there, the output tokens sent to it and those whose
        # text has come back (a completion shows only those; inline, both counts stay 0)
        self.text_keys: list[int] = []
        self.num_fed = [0] * len(seqs)
        self.num_detokenized = [0] * len(seqs)
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
        self.kv_transfer: str | None = None  # "send" or "pull": its part in a KV transfer (`kv_connector.py`)
        self.kv_transfer_params: dict | None = None  # a prefill worker's: where the decode worker pulls from
        self.remote_prefill = None  # a decode worker's `RemotePrefill`: what it pulls before scheduling the request

    @property
    def finished(self) -> bool:
        for index in range(len(self.seqs)):  # a loop, not all(genexpr): asked for every request each step
            if not self.completion_done(index):
                return False
        return True

    def completion_done(self, index: int) -> bool:
        """The completion is finished and has all its text (an aborted one does not wait for it)."""
        seq = self.seqs[index]
        return seq.is_finished and (self.num_detokenized[index] == self.num_fed[index] or seq.finish_reason == "abort")

    def visible_output_tokens(self, index: int) -> int:
        """Output tokens a completion shows: all of them once their text is in, else those whose text is."""
        if self.num_detokenized[index] == self.num_fed[index]:
            return self.seqs[index].num_output_tokens
        return self.num_detokenized[index]

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
                             num_cached_tokens=max(0, *(seq.num_prompt_cached_tokens for seq in self.seqs)),
                             prompt_logprobs=self._prompt_logprobs(delta),
                             kv_transfer_params=self.kv_transfer_params if finished and all(
                                 seq.finish_reason == "length" for seq in self.seqs) else None)

    def _completion(self, index: int, delta: bool) -> CompletionOutput | None:
        seq, detok = self.seqs[index], self.detokenizers[index]
        done = self.completion_done(index)
        visible = detok.visible_length(done)
        num_tokens = self.visible_output_tokens(index)
        first_token = first_char = 0
        if delta:  # only what is new is copied, so a streamed request costs O(new tokens) per step
            first_token, first_char = self._sent_tokens[index], self._sent_chars[index]
            changed = num_tokens > first_token or visible > first_char
            if not changed and (not done or self._sent_finished[index]):
                return None
            self._sent_tokens[index] = num_tokens
            self._sent_chars[index] = visible
            self._sent_finished[index] = done
        start, end = seq.num_prompt_tokens + first_token, seq.num_prompt_tokens + num_tokens
        token_ids = seq.token_ids[start:end]
        logprobs = seq.logprobs[first_token:num_tokens] if seq.logprobs is not None else None
        text = detok.visible_text(done, first_char)
        return CompletionOutput(index=seq.index, text=text, token_ids=token_ids,
                                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                                logprobs=logprobs, finish_reason=seq.finish_reason if done else None,
                                stop_reason=seq.stop_reason if done else None)

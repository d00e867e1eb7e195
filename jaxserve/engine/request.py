"""`Request`: one user request — its prompt, its `n` sequences and their detokenizers — and its `RequestOutput`."""

from __future__ import annotations

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.sequence import Sequence
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams


class Request:
    """One user request: a prompt and its `n` sequences, plus the per-sequence detokenizers."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], detokenizers: list[IncrementalDetokenizer], arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.detokenizers = detokenizers
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def output(self) -> RequestOutput:
        finished = self.finished
        completions = [
            CompletionOutput(index=seq.index, text=detok.visible_text(seq.is_finished),
                             token_ids=seq.output_token_ids,
                             cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                             logprobs=seq.logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
            for seq, detok in zip(self.seqs, self.detokenizers)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                             self.metrics, num_cached_tokens=max(seq.num_cached_tokens for seq in self.seqs))

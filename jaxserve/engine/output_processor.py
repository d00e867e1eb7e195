"""`OutputProcessor`: a request's way out, on the stepping thread — the live requests, their prompt scores, the
text of every appended token (detokenized inline, or by a detokenizer process), stop strings, token latencies,
and snapshot `RequestOutput`s, after which finished requests are forgotten.

The scheduler appends tokens and their logprobs and applies the token stop rules (`Scheduler.update_from_output`);
this module only reads sequences. A stop string is found here and reported to the scheduler (`Scheduler.stop`),
which ends the completion at the token that completed it: tokens the same step appended after it are dropped, and
a stop string wins over a length limit reached by the same token.
With a detokenizer process (`detokenizer_process=True`) the token ids go to a worker process whose texts, and stop
strings, come back a step or two later (`detokenizer_process.py`): a completion then shows only the tokens whose
text is in, and a late stop string drops the tokens computed after it. It is off by default: on a CPU the loop
shares its cores with XLA's threads and the worker gained nothing (benchmarks/RESULTS.md); kept as an option for
accelerators, where the stepping thread's time is the bottleneck, until it is measured there.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Mapping

from jaxserve.engine.detokenizer_process import DetokenizerProcess
from jaxserve.engine.prompt_logprobs import ScoredPrompt, TokenTexts, prompt_logprob_entries
from jaxserve.engine.request import Request
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.step_output import AppendedToken
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind

SLO_KINDS = ("ttft", "tpot", "both")
TEXT_WAIT_SECONDS = 1.0  # an idle step's wait for the detokenizer process's answers
Stop = Callable[[Sequence, str, int], int]


class OutputProcessor:
    """Reads sequences, never writes them: `stop(seq, stop_string, num_output_tokens)` reports a stop string to
    the scheduler, which cuts and finishes the sequence and returns how many tokens it dropped; `release(request_id)`
    frees a retired request's id (the input processor's)."""

    def __init__(self, tokenizer, stop: Stop, release: Callable[[str], None], detokenizer_process: bool = False):
        self.tokenizer = tokenizer
        self._report_stop = stop
        self._release = release
        self.token_texts = TokenTexts(tokenizer)  # prompt_logprobs' decoded_token
        self.requests: dict[str, Request] = {}
        self.detokenizer_process = (DetokenizerProcess(tokenizer)
                                    if detokenizer_process and tokenizer is not None else None)
        self._texts: dict[int, tuple[Request, int]] = {}  # detokenizer process: key -> (request, completion index)
        self._text_keys = itertools.count()
        self.num_generation_tokens = 0
        self.finished_reasons: dict[str, int] = {}
        # goodput: per kind ("ttft", "tpot", "both"), finished requests that had such targets, and those that met them
        self.slo_checked = dict.fromkeys(SLO_KINDS, 0)
        self.slo_met = dict.fromkeys(SLO_KINDS, 0)
        self.first_token_latencies: list[float] = []  # of the latest step
        self.inter_token_latencies: list[float] = []

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.detokenizer_process is None:
            return
        params = request.params
        request.text_keys = [next(self._text_keys) for _ in request.seqs]
        for index, key in enumerate(request.text_keys):
            self._texts[key] = (request, index)
            self.detokenizer_process.open(key, request.prompt_token_ids, params.stop, params.skip_special_tokens,
                                          params.include_stop_str_in_output, params.min_tokens)

    def start_step(self) -> None:
        self.first_token_latencies, self.inter_token_latencies = [], []

    def add_prompt_scores(self, scored: list[ScoredPrompt], seqs: Mapping[int, Sequence]) -> None:
        """The prompt tokens a step's prefills scored (prompt_logprobs), joined to their requests (`seqs`: the
        unfinished sequences by id)."""
        for scores in scored:
            seq = seqs.get(scores.seq_id)
            request = self.requests.get(seq.request_id) if seq is not None else None
            if request is not None:
                request.add_prompt_logprobs(scores.first, prompt_logprob_entries(scores, request.prompt_token_ids,
                                                                                 self.token_texts))

    def process(self, appended: list[AppendedToken]) -> None:
        """Logprobs, latencies and text of the tokens a step appended; a stop string ends its completion there."""
        now = time.monotonic()
        stopped: dict[Sequence, list] = {}  # completions a stop string ended: [the string, tokens of this step to drop]
        for seq, sample, num_output_tokens, stop_token in appended:
            if seq in stopped:
                stopped[seq][1] += 1
                continue
            request = self.requests[seq.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
                self.first_token_latencies.append(now - request.arrival_time)
            elif request.last_token_time < now:  # once per request and step, though its n completions share it
                self.inter_token_latencies.append(now - request.last_token_time)
            request.last_token_time = now
            self.num_generation_tokens += 1
            if stop_token:
                continue
            if self.detokenizer_process is not None:  # its stop strings come back a step or two later
                self.detokenizer_process.feed(request.text_keys[seq.index], sample.token)
                request.num_fed[seq.index] += 1
            elif self.tokenizer is not None:
                check_stop = num_output_tokens >= seq.params.min_tokens
                stop = request.detokenizers[seq.index].add_token(sample.token, check_stop)
                if stop is not None:
                    stopped[seq] = [stop, 0]
        for seq, (stop, extra) in stopped.items():  # the step's tokens after the stop: dropped, never counted
            self._report_stop(seq, stop, seq.num_output_tokens - extra)

    def read_texts(self, timeout: float = 0.0) -> set[str]:
        """Applies the detokenizer process's answers: new text, and stop strings, which end their completion at
        the token that completed it (tokens computed after it are dropped). Returns the requests that changed."""
        if self.detokenizer_process is None:
            return set()
        touched = set()
        for key, new_text, length, stop, num_fed in self.detokenizer_process.answers(timeout):
            located = self._texts.get(key)
            if located is None:  # retired meanwhile (aborted)
                continue
            request, index = located
            text = request.detokenizers[index]
            if new_text:
                text.append(new_text)
            if length < len(text):
                text.cut(length)
            request.num_detokenized[index] = num_fed
            if stop is not None:
                self._stop_late(request, index, stop, num_fed)
            touched.add(request.request_id)
        return touched

    def end_step(self, idle: bool) -> set[str]:
        """Sends the step's tokens to the detokenizer process; an `idle` engine waits there for their texts."""
        if self.detokenizer_process is None:
            return set()
        self.detokenizer_process.flush()
        if idle and self.detokenizer_process.num_unanswered:
            return self.read_texts(TEXT_WAIT_SECONDS)  # nothing else to do: wait for the texts
        return set()

    def _stop_late(self, request: Request, index: int, stop: str, num_output_tokens: int) -> None:
        """Ends completion `index` with stop string `stop`, completed by its output token `num_output_tokens`."""
        seq = request.seqs[index]
        if seq.finish_reason == "abort":
            return
        self.num_generation_tokens -= self._report_stop(seq, stop, num_output_tokens)
        request.num_fed[index] = num_output_tokens

    def outputs(self, touched: set[str]) -> list[RequestOutput]:
        """A snapshot of every request in `touched` that has something to report; finished ones are forgotten."""
        outputs = []
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.finished:
                self._retire(request)
            elif request.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            output = request.output()
            if output is not None:
                outputs.append(output)
        return outputs

    def _retire(self, request: Request) -> None:
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        for key in request.text_keys:
            del self._texts[key]
            self.detokenizer_process.close(key)
        self._release(request.request_id)
        reason = request.finish_reason
        self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1
        if reason != "abort":
            self._count_slo(request)

    def _count_slo(self, request: Request) -> None:
        """Goodput of a finished request against its targets: TTFT from arrival to its first token, TPOT as the mean
        gap after it over its longest completion; "both" counts requests with both targets that met both."""
        seq = request.seqs[0]
        met = {}
        if seq.ttft_slo is not None and request.first_token_time is not None:
            met["ttft"] = request.first_token_time - request.arrival_time <= seq.ttft_slo
        if seq.tpot_slo is not None and request.first_token_time is not None:
            num_tokens = max(s.num_output_tokens for s in request.seqs)
            met["tpot"] = num_tokens < 2 or ((request.last_token_time - request.first_token_time) / (num_tokens - 1)
                                             <= seq.tpot_slo)
        if len(met) == 2:
            met["both"] = met["ttft"] and met["tpot"]
        for kind, ok in met.items():
            self.slo_checked[kind] += 1
            self.slo_met[kind] += ok

"""`OutputProcessor`: the stepping thread's token updates -> `RequestOutput`s, on a thread of its own.

The stepping thread appends token ids to its sequences and applies the stop conditions a token id decides
(EOS, stop_token_ids, max_tokens, max_model_len); after each step it hands the processor one `TokenUpdate`
per request that changed. The processor thread detokenizes the new tokens, searches their text for stop
strings and builds each request's output snapshot (cumulative, delta or final). A completion whose text
reaches a stop string ends here at once: its output is cut there and `on_stop` asks the engine to finish
the sequence at its next step (tokens computed meanwhile are never returned), as vLLM's output processor
aborts a request in its engine core.

Outputs go to `sink` when one is set (the server's), else they wait for `take`, one per request: a newer
output is folded into the waiting one (DELTA outputs merge, others replace it). The processor shares the GIL
with the stepping thread, so it yields after every request it processed: the stepping thread, which needs
the GIL whenever it is not waiting for the device, never waits long for it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import Request
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, merge_delta
from jaxserve.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenUpdate:
    """A request as the stepping thread left it after a step: per sequence, its output tokens so far and the
    finish reason and stop reason the engine gave it (None while it runs)."""

    request: Request
    num_output_tokens: tuple[int, ...]
    finish_reasons: tuple[str | None, ...]
    stop_reasons: tuple[int | str | None, ...]

    @classmethod
    def of(cls, request: Request) -> TokenUpdate:
        seqs = request.seqs
        return cls(request, tuple(seq.num_output_tokens for seq in seqs), tuple(seq.finish_reason for seq in seqs),
                   tuple(seq.stop_reason for seq in seqs))


class Completion:
    """The processor's view of one sequence: the tokens it has turned into text, and what it sent so far."""

    def __init__(self, request: Request, index: int, tokenizer):
        seq = request.seqs[index]
        params = request.params
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids[:seq.num_prompt_tokens], params.stop,
                                                  params.skip_special_tokens, params.include_stop_str_in_output)
        self.num_tokens = 0  # output tokens processed (and shown)
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent_tokens = self.sent_chars = 0  # already in a DELTA output
        self.sent_finished = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """A request's completions, as the processor sees them."""

    def __init__(self, request: Request, tokenizer):
        self.request = request
        self.completions = [Completion(request, index, tokenizer) for index in range(len(request.seqs))]

    @property
    def finished(self) -> bool:
        return all(completion.finished for completion in self.completions)

    @property
    def finish_reason(self) -> str:
        """The request's reason for metrics: "abort" if any completion was aborted, else the first completion's."""
        reasons = [completion.finish_reason for completion in self.completions]
        return "abort" if "abort" in reasons else reasons[0]

    def advance(self, update: TokenUpdate) -> list[tuple[int, str]]:
        """Takes in the update's new tokens; the (sequence index, stop string) of each completion a stop string
        ended."""
        stopped = []
        for index, completion in enumerate(self.completions):
            if completion.finished:
                continue
            count, reason, stop_reason = (update.num_output_tokens[index], update.finish_reasons[index],
                                          update.stop_reasons[index])
            # a stop token (EOS or stop_token_ids) is an output token, but its text is not shown
            text_end = count - 1 if reason == "stop" and not isinstance(stop_reason, str) else count
            stop = self._take_tokens(index, completion, count, text_end)
            if stop is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop
                stopped.append((index, stop))
            elif reason is not None:
                completion.finish_reason, completion.stop_reason = reason, stop_reason
        return stopped

    def _take_tokens(self, index: int, completion: Completion, count: int, text_end: int) -> str | None:
        """Detokenizes output tokens [completion.num_tokens, count); the stop string one completes, if any."""
        seq = self.request.seqs[index]
        min_tokens = self.request.params.min_tokens
        for position in range(completion.num_tokens, count):
            token = seq.token_ids[seq.num_prompt_tokens + position]
            completion.num_tokens = position + 1
            if seq.logprobs is not None:
                completion.cumulative_logprob += seq.logprobs[position][token]
            if position < text_end:
                stop = completion.detokenizer.add_token(token, position + 1 >= min_tokens)
                if stop is not None:
                    return stop
        return None

    def output(self) -> RequestOutput | None:
        """A snapshot of the request now, in its output kind; None if there is nothing to report."""
        request = self.request
        kind = request.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [self._completion(index, delta) for index in range(len(self.completions))]
        if delta:
            completions = [c for c in completions if c is not None]
            if not completions:
                return None
        metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                 request.last_token_time, request.finished_time)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             metrics, num_cached_tokens=max(seq.num_cached_tokens for seq in request.seqs))

    def _completion(self, index: int, delta: bool) -> CompletionOutput | None:
        completion, seq = self.completions[index], self.request.seqs[index]
        detokenizer = completion.detokenizer
        visible = detokenizer.visible_length(completion.finished)
        first_token = first_char = 0
        if delta:  # only what is new is copied, so a streamed request costs O(new tokens) per step
            first_token, first_char = completion.sent_tokens, completion.sent_chars
            changed = completion.num_tokens > first_token or visible > first_char
            if not changed and (not completion.finished or completion.sent_finished):
                return None
            completion.sent_tokens, completion.sent_chars = completion.num_tokens, visible
            completion.sent_finished = completion.finished
        start = seq.num_prompt_tokens
        token_ids = seq.token_ids[start + first_token:start + completion.num_tokens]
        logprobs = seq.logprobs[first_token:completion.num_tokens] if seq.logprobs is not None else None
        return CompletionOutput(index=seq.index, text=detokenizer.visible_text(completion.finished, first_char),
                                token_ids=token_ids,
                                cumulative_logprob=completion.cumulative_logprob if seq.logprobs is not None else None,
                                logprobs=logprobs, finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason)


class OutputProcessor:
    """`on_stop(request_id, index, stop)`: a stop string ended that sequence. `on_final(request)`: the request's
    final output is out (called before it is delivered)."""

    def __init__(self, tokenizer, on_stop: Callable[[str, int, str], None], on_final: Callable[[Request], None]):
        self.tokenizer = tokenizer
        self.on_stop = on_stop
        self.on_final = on_final
        self.sink: Callable[[list[RequestOutput]], None] | None = None
        self.error: BaseException | None = None  # what stopped the thread, re-raised by the engine
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Condition()
        self._inbox: list[list[TokenUpdate] | None] = []
        self._ready: dict[Request, RequestOutput] = {}  # keyed by the request object: its id may be reused
        self._busy = False  # a batch is being processed
        self._finished: dict[str, int] = {}  # finish reason -> finished requests
        self._thread = threading.Thread(target=self._run, name="jaxserve-outputs", daemon=True)
        self._thread.start()

    def put(self, updates: list[TokenUpdate]) -> None:
        """From the stepping thread: one step's updates."""
        with self._lock:
            self._inbox.append(updates)
            self._lock.notify_all()

    def take(self, wait: bool = False) -> list[RequestOutput]:
        """The outputs ready now (with no sink); with `wait`, once every update put so far is processed."""
        with self._lock:
            if wait:
                self._lock.wait_for(lambda: not (self._inbox or self._busy) or self.error is not None)
            outputs, self._ready = list(self._ready.values()), {}
        if self.error is not None:
            raise RuntimeError("the output processor failed") from self.error
        return outputs

    @property
    def busy(self) -> bool:
        """True while updates wait or outputs wait for `take`."""
        with self._lock:
            return bool(self._inbox or self._busy or self._ready)

    def finished_counts(self) -> tuple[tuple[str, int], ...]:
        with self._lock:
            return tuple(sorted(self._finished.items()))

    def close(self) -> None:
        with self._lock:
            self._inbox.append(None)
            self._lock.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: self._inbox)
                    batch = self._inbox.pop(0)
                    self._busy = batch is not None
                if batch is None:
                    return
                outputs = []
                for update in batch:
                    output = self._process(update)
                    if output is not None:
                        outputs.append((update.request, output))
                    time.sleep(0)  # yields the GIL to the stepping thread if it waits for it
                self._deliver(outputs)
        except BaseException as error:  # noqa: BLE001 - the engine re-raises it, failing its requests
            logger.exception("the output processor failed")
            with self._lock:
                self.error = error
                self._busy = False
                self._lock.notify_all()

    def _process(self, update: TokenUpdate) -> RequestOutput | None:
        request = update.request
        if request.output_done:  # a stop string ended it; these are tokens the engine computed meanwhile
            return None
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = RequestState(request, self.tokenizer)
        for index, stop in state.advance(update):
            self.on_stop(request.request_id, index, stop)
        if not state.finished:
            return state.output()
        request.finished_time = time.monotonic()
        output = state.output()
        request.output_done = True
        del self._states[request.request_id]
        with self._lock:
            self._finished[state.finish_reason] = self._finished.get(state.finish_reason, 0) + 1
        self.on_final(request)
        return output

    def _deliver(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        if outputs and self.sink is not None:
            self.sink([output for _, output in outputs])
        with self._lock:
            for request, output in outputs if self.sink is None else ():
                older = self._ready.get(request)
                delta = request.params.output_kind == RequestOutputKind.DELTA
                self._ready[request] = merge_delta(older, output) if older is not None and delta else output
            self._busy = False
            self._lock.notify_all()

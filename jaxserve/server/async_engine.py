"""`AsyncEngine`: the bridge between the asyncio server and the `LLMEngine`, which steps in its own thread.

The engine is built in that thread too (load + warm-up take a while), so the HTTP server answers
`/health` with 503 meanwhile. Requests go in with `submit()` (validated at once, from the event loop);
every step's outputs come back through `loop.call_soon_threadsafe` into the `Submission` of the HTTP
request that asked for them, whose `OutputCollector` holds at most one pending output per engine
request (streams ask for DELTA outputs, merged while the handler lags; whole answers for FINAL_ONLY).
Leaving a `Submission` early (client gone, handler cancelled) aborts its unfinished engine requests,
which frees their slots and pages at the engine's next step.

Admission control: at most `max_num_seqs + max_waiting` sequences are in flight; beyond that
`submit()` raises `ServerOverloaded` (answered 503 with Retry-After). If the engine loop dies, every
in-flight request fails with `EngineDeadError` (a 500), the cause is logged, and `on_fatal_error`
tells the server to exit non-zero (as a failed load does), so a supervisor can restart it.
On shutdown, `drain(timeout)` stops taking requests and, after `timeout`, fails what is still in
flight with `ServerShuttingDown`, so every client gets a complete answer rather than a cut connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
from typing import TYPE_CHECKING, AsyncIterator, Callable

from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.server.output_collector import OutputCollector

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.stats import IterationStats, SchedulerStats
    from jaxserve.outputs import RequestOutput
    from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.2


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # shutting down: in-flight requests finish, new ones are refused
    LOAD_FAILED = "load_failed"
    DEAD = "dead"  # the stepping thread crashed
    STOPPED = "stopped"


class EngineUnavailable(Exception):
    """The engine cannot take requests now (loading, stopped or dead): a 503 for the client."""


class ServerOverloaded(Exception):
    """The waiting queue is full: a 503 with Retry-After."""


class RequestFailed(Exception):
    """An in-flight request ended by the server, not by the engine's output; `status` is the HTTP status."""

    status = 500
    code = "request_failed"


class EngineDeadError(RequestFailed):
    """The engine loop died while this request was in flight: the server's fault, a 500."""

    code = "engine_dead"


class PeerLost(RequestFailed):
    """A host serving the model with this one (multi-host) is gone, so no step can run: a 503."""

    status = 503
    code = "engine_unavailable"


class ServerShuttingDown(RequestFailed):
    """The server stopped before this request finished (graceful-shutdown timeout): a 503."""

    status = 503
    code = "server_shutting_down"


class Submission:
    """The engine requests made for one HTTP request. Iterate `results()` for `(prompt_index, output)` pairs."""

    def __init__(self, async_engine: AsyncEngine, request_ids: list[str], output_kind: RequestOutputKind):
        self._async_engine = async_engine
        self.request_ids = request_ids
        self.output_kind = output_kind
        self._index = {request_id: index for index, request_id in enumerate(request_ids)}
        self._pending = set(request_ids)
        self.collector = OutputCollector(delta=output_kind == RequestOutputKind.DELTA)

    async def results(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs (of the submission's output kind) until every request finished; aborts the rest on exit."""
        try:
            while self._pending:
                for request_id, output in await self.collector.get():
                    if output.finished:
                        self._pending.discard(request_id)
                    yield self._index[request_id], output
        finally:
            self.abort()

    async def final_outputs(self) -> list[RequestOutput]:
        """Waits for every request to finish; the final outputs in prompt order (FINAL_ONLY: the whole answer)."""
        final: dict[int, RequestOutput] = {}
        async for index, output in self.results():
            if output.finished:
                final[index] = output
        return [final[index] for index in range(len(self.request_ids))]

    def abort(self) -> None:
        """Aborts the requests that have not finished (idempotent)."""
        for request_id in list(self._pending):
            self._async_engine.abort(request_id)
        self._pending.clear()


@dataclasses.dataclass
class InFlight:
    """What the server tracks of one engine request until it finishes."""

    submission: Submission
    num_seqs: int
    num_tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # per completion: output tokens so far

    def count_tokens(self, output: RequestOutput) -> None:
        delta = self.submission.output_kind == RequestOutputKind.DELTA
        for completion in output.outputs:
            before = self.num_tokens.get(completion.index, 0) if delta else 0
            self.num_tokens[completion.index] = before + len(completion.token_ids)


def prompt_token_ids(prompt: list[int] | dict) -> list[int]:
    """A submitted prompt's token ids (a prepared prompt's with its images' placeholders expanded)."""
    return prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], LLMEngine], max_waiting: int = 256, replica: int = 0):
        self._engine_factory = engine_factory
        self.max_waiting = max_waiting
        self.replica = replica  # its index among a data-parallel server's replicas (`server/data_parallel.py`)
        self.llm_engine: LLMEngine | None = None
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.metrics: ServerMetrics | None = None
        self.on_fatal_error: Callable[[BaseException], None] | None = None  # the model failed to load or the loop died
        self.num_inflight_seqs = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._requests: dict[str, InFlight] = {}

    # -- lifecycle (event loop) -------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine thread, which builds the engine and then steps it."""
        self._loop = loop
        self._thread = threading.Thread(target=self._thread_main, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float) -> None:
        """Refuses new requests from now on; fails those still in flight after `timeout` seconds."""
        if self.state != EngineState.READY:
            return
        self.state = EngineState.DRAINING
        logger.info("draining: %d requests in flight get up to %.0fs to finish", len(self._requests), timeout)
        self._loop.call_later(timeout, self._fail_all, ServerShuttingDown(
            f"the server shut down before this request finished (after {timeout:g}s of grace)"))

    async def shutdown(self, timeout: float = 10.0) -> bool:
        """Aborts what is still in flight and stops the engine thread; True if it stopped within `timeout`."""
        was_loading = self.state == EngineState.LOADING
        if self.state in (EngineState.LOADING, EngineState.READY, EngineState.DRAINING):
            self.state = EngineState.STOPPED
        if was_loading:
            timeout = 0.0  # loading and compiling cannot be interrupted; the caller exits without the thread
        for request_id in list(self._requests):
            self.abort(request_id)
        self._stop.set()
        if self._thread is None:
            return True
        await asyncio.to_thread(self._thread.join, timeout)
        return not self._thread.is_alive()

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_ready(self) -> bool:
        return self.state == EngineState.READY

    def ready_engine(self) -> LLMEngine:
        """The engine if it takes requests, else raises EngineUnavailable saying why."""
        if self.state == EngineState.READY and self.llm_engine is not None:
            return self.llm_engine
        raise EngineUnavailable(self.unavailable_reason())

    def unavailable_reason(self) -> str:
        """Why the engine takes no requests now (for 503 answers and /health)."""
        return {
            EngineState.READY: "the engine is ready",
            EngineState.LOADING: "the model is still loading; retry shortly",
            EngineState.LOAD_FAILED: f"the model failed to load: {self.error}",
            EngineState.DEAD: f"the engine crashed: {self.error}",
            EngineState.DRAINING: "the server is shutting down",
            EngineState.STOPPED: "the server is shutting down",
        }[self.state]

    def stats(self) -> SchedulerStats | None:
        """The engine's latest stats snapshot; None until it is loaded."""
        return self.llm_engine.stats() if self.llm_engine is not None else None

    @property
    def replicas(self) -> list[AsyncEngine]:
        """The engines behind this front (one; a `DataParallelEngine` has several)."""
        return [self]

    # -- requests (event loop) --------------------------------------------------------------------------------

    def submit(self, request_id: str, prompts: list[list[int] | dict], params: SamplingParams,
               priority: int = 0, lora_request: LoRARequest | None = None) -> Submission:
        """Validates and queues one engine request per prompt (token ids, or a prompt `LLMEngine.prepare` made; ids
        `{request_id}-{prompt index}`); raises ValueError (also for an id still in flight), EngineUnavailable or
        ServerOverloaded."""
        llm_engine = self.ready_engine()
        llm_engine.validate_priority(priority)
        for prompt in prompts:
            llm_engine.validate_prompt(prompt_token_ids(prompt), params)
        num_seqs = len(prompts) * params.n
        capacity = llm_engine.engine_config.max_num_seqs + self.max_waiting
        if num_seqs > capacity:
            raise ValueError(f"this request needs {num_seqs} sequences (prompts x n), more than the server holds "
                             f"at once ({capacity})")
        if self.num_inflight_seqs + num_seqs > capacity:
            raise ServerOverloaded(f"the server is at capacity ({self.num_inflight_seqs} sequences in flight, "
                                   f"{llm_engine.engine_config.max_num_seqs} running + {self.max_waiting} waiting); "
                                   "retry later")
        request_ids = [f"{request_id}-{index}" for index in range(len(prompts))]
        if any(engine_request_id in self._requests for engine_request_id in request_ids):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        submission = Submission(self, request_ids, params.output_kind)
        accepted = []
        try:
            for engine_request_id, prompt in zip(request_ids, prompts):
                llm_engine.add_request(engine_request_id, prompt, params, priority=priority,
                                       lora_request=lora_request)
                accepted.append(engine_request_id)
                self._requests[engine_request_id] = InFlight(submission, params.n)
                self.num_inflight_seqs += params.n
        except BaseException:
            for engine_request_id in accepted:  # only ours: a refused id may belong to another request
                self.abort(engine_request_id)
            raise
        return submission

    def abort(self, request_id: str) -> None:
        """Forgets `request_id` here and tells the engine to drop it (its slot and pages free at the next step)."""
        if self._forget(request_id) is not None and self._engine_alive:
            self.llm_engine.abort_request(request_id)

    @property
    def _engine_alive(self) -> bool:
        return self.llm_engine is not None and self.state in (EngineState.READY, EngineState.DRAINING,
                                                              EngineState.STOPPED)

    @property
    def num_inflight_requests(self) -> int:
        return len(self._requests)

    def _forget(self, request_id: str) -> InFlight | None:
        record = self._requests.pop(request_id, None)
        if record is not None:
            self.num_inflight_seqs -= record.num_seqs
        return record

    def _dispatch(self, outputs: list[RequestOutput], iteration: IterationStats) -> None:
        """Runs on the event loop: records one step's token latencies and routes its outputs to their submissions."""
        if self.metrics is not None:
            self.metrics.observe_iteration(iteration, self.replica)
        for output in outputs:
            request_id = output.request_id
            record = self._requests.get(request_id)
            if record is None:
                continue  # aborted by us already
            record.count_tokens(output)
            if output.finished:
                self._forget(request_id)
                if self.metrics is not None and not any(c.finish_reason == "abort" for c in output.outputs):
                    self.metrics.observe_finished(output, max(record.num_tokens.values(), default=0), self.replica)
            record.submission.collector.put(request_id, output)

    def _fail_all(self, error: RequestFailed) -> None:
        """Runs on the event loop: every in-flight request ends with `error` (and is aborted if the engine lives)."""
        for request_id, record in list(self._requests.items()):
            self.abort(request_id)
            record.submission.collector.fail(error)

    # -- the engine thread ------------------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            llm_engine = self._engine_factory()
        except BaseException as error:  # noqa: BLE001 - reported to the server, which exits
            logger.exception("loading the engine failed")
            self.error = error
            self.state = EngineState.LOAD_FAILED
            self._call_in_loop(self._report_fatal, error)
            return
        self.llm_engine = llm_engine
        if self._stop.is_set() or self.state != EngineState.LOADING:
            return  # shut down while loading
        self.state = EngineState.READY
        logger.info("engine ready: %s, max_model_len=%d, max_num_seqs=%d", getattr(llm_engine.model, "name", "?"),
                    llm_engine.engine_config.max_model_len, llm_engine.engine_config.max_num_seqs)
        try:
            while not self._stop.is_set():
                if not llm_engine.wait_for_requests(IDLE_POLL_SECONDS):
                    continue
                outputs = llm_engine.step()
                iteration = llm_engine.iteration_stats()
                if outputs or not iteration.is_empty:
                    self._call_in_loop(self._dispatch, outputs, iteration)
            llm_engine.shutdown()
        except BaseException as error:  # noqa: BLE001 - fail in-flight requests instead of hanging them
            logger.exception("the engine loop died; failing in-flight requests, the server exits")
            self.error = error
            self.state = EngineState.DEAD
            self._call_in_loop(self._engine_died, error)

    def peer_lost(self, reason: str) -> None:
        """Any thread: another host of a multi-host engine is gone. Every in-flight request fails with 503 and
        the server exits non-zero (the engine thread may be stuck in a collective; nobody waits for it)."""
        self._call_in_loop(self._peer_lost, reason)

    def _peer_lost(self, reason: str) -> None:
        if self.state in (EngineState.LOAD_FAILED, EngineState.DEAD, EngineState.STOPPED):
            return
        logger.error("%s; failing in-flight requests, the server exits", reason)
        self.error = RuntimeError(reason)
        self.state = EngineState.LOAD_FAILED if self.state == EngineState.LOADING else EngineState.DEAD
        self._fail_all(PeerLost(f"the engine lost a host: {reason}"))
        self._report_fatal(self.error)

    def _engine_died(self, error: BaseException) -> None:
        self._fail_all(EngineDeadError(f"the engine crashed: {error!r}"))
        self._report_fatal(error)

    def _report_fatal(self, error: BaseException) -> None:
        if self.on_fatal_error is not None:
            self.on_fatal_error(error)

    def _call_in_loop(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

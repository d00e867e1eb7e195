"""`DataParallelEngine`: N engine replicas behind one server (`jaxserve serve --data-parallel-size N`).

Each replica is an `AsyncEngine` stepping its own `LLMEngine` in its own thread, over its own group of
`tensor_parallel_size` devices (`EngineConfig.data_parallel_rank`), with its own KV pool and prefix cache. The
server holds them in one process: one HTTP front, one tokenizer, one `/metrics` (a `replica` label) and no
inter-process hops; jax releases the GIL while a replica's step runs on its devices, so the replicas' steps
overlap, and only their host work (scheduling, sampling bookkeeping) takes turns.

`submit` picks the replica a request lives on for its whole life (all its prompts and `n` completions together),
by `--load-balance-method` (sglang's names):
- `cache_aware` (default): the replica whose prefix cache holds the longest prefix of the first prompt, read
  exactly from each replica's `PageManager` (the prompt's page-key chain is hashed once); ties, misses, and a
  best replica already `max_num_seqs` sequences busier than the idlest one go by load;
- `round_robin`: in turn;
- `shortest_queue`: the least load.
Load is a replica's sequences in flight (counted here as they are submitted, so a burst spreads at once), then
its KV-cache usage. A replica at its capacity (`max_num_seqs + max_waiting` sequences) is skipped; when every
replica is, the request gets the 503 a single engine gives.

The server's state is the replicas' together: ready when all are, dead (and the server exits) when any dies.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Callable

from jaxserve.engine.page_manager import key_chain
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.async_engine import AsyncEngine, EngineState, EngineUnavailable, ServerOverloaded, Submission

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine

LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")
# the replicas' states, worst first: the server is in the first state any replica is in
_STATE_ORDER = (EngineState.DEAD, EngineState.LOAD_FAILED, EngineState.STOPPED, EngineState.DRAINING,
                EngineState.LOADING, EngineState.READY)


class DataParallelEngine:
    """The `AsyncEngine` surface the server uses, over several replicas."""

    def __init__(self, replicas: list[AsyncEngine], load_balance_method: str = "cache_aware"):
        if load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, got "
                             f"{load_balance_method!r}")
        if len(replicas) < 2:
            raise ValueError(f"a data-parallel engine needs >= 2 replicas, got {len(replicas)}")
        self.replicas = replicas
        self.load_balance_method = load_balance_method
        self._turn = itertools.count()

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for replica in self.replicas:
            replica.start(loop)

    def drain(self, timeout: float) -> None:
        for replica in self.replicas:
            replica.drain(timeout)

    async def shutdown(self, timeout: float = 10.0) -> bool:
        stopped = await asyncio.gather(*(replica.shutdown(timeout) for replica in self.replicas))
        return all(stopped)

    @property
    def state(self) -> EngineState:
        states = {replica.state for replica in self.replicas}
        return next(state for state in _STATE_ORDER if state in states)

    @property
    def error(self) -> BaseException | None:
        return next((replica.error for replica in self.replicas if replica.error is not None), None)

    @property
    def on_fatal_error(self) -> Callable[[BaseException], None] | None:
        return self.replicas[0].on_fatal_error

    @on_fatal_error.setter
    def on_fatal_error(self, callback: Callable[[BaseException], None] | None) -> None:
        for replica in self.replicas:
            replica.on_fatal_error = callback

    @property
    def thread_alive(self) -> bool:
        return any(replica.thread_alive for replica in self.replicas)

    @property
    def is_ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def num_inflight_requests(self) -> int:
        return sum(replica.num_inflight_requests for replica in self.replicas)

    def unavailable_reason(self) -> str:
        state = self.state
        if state == EngineState.READY:
            return self.replicas[0].unavailable_reason()
        replica = next(replica for replica in self.replicas if replica.state == state)
        return f"replica {replica.replica}: {replica.unavailable_reason()}"

    def ready_engine(self) -> LLMEngine:
        """Replica 0's engine (the replicas are alike: same model, tokenizer and config) if all are ready."""
        if self.state != EngineState.READY:
            raise EngineUnavailable(self.unavailable_reason())
        return self.replicas[0].ready_engine()

    # -- requests ---------------------------------------------------------------------------------------------

    def submit(self, request_id: str, prompts: list[list[int] | dict], params: SamplingParams,
               priority: int = 0, lora_request: LoRARequest | None = None) -> Submission:
        """Queues the request on the replica the load-balance method picks (the next one if that one is full)."""
        self.ready_engine()
        overloaded = None
        for replica in self.ranking(prompts[0], lora_request):
            try:
                return replica.submit(request_id, prompts, params, priority, lora_request)
            except ServerOverloaded as err:
                overloaded = err
        raise ServerOverloaded(f"every replica is at capacity ({overloaded}); retry later")

    def ranking(self, prompt: list[int] | dict, lora_request: LoRARequest | None = None) -> list[AsyncEngine]:
        """The replicas in the order a request with first prompt `prompt` (and adapter `lora_request`) tries them;
        ValueError for an adapter that cannot be read."""
        by_load = sorted(self.replicas, key=_load)
        if self.load_balance_method == "shortest_queue":
            return by_load
        if self.load_balance_method == "round_robin":
            start = next(self._turn) % len(self.replicas)
            return self.replicas[start:] + self.replicas[:start]
        engines = [replica.llm_engine for replica in self.replicas]
        page_size = engines[0].page_manager.page_size
        adapter = engines[0].inputs.adapter(lora_request)  # read already (ServingContext.read_adapter): a lookup
        prompt = prompt_keys(prompt)
        chain = list(key_chain(prompt, page_size, engines[0].page_manager.hash_fn, (len(prompt) - 1) // page_size,
                               b"" if adapter is None else adapter.prefix_root))
        cached = {replica.replica: engine.page_manager.num_cached_tokens(chain)
                  for replica, engine in zip(self.replicas, engines)}
        idlest = by_load[0].num_inflight_seqs
        busy_limit = engines[0].engine_config.max_num_seqs  # a hit is not worth a full batch of queueing ahead of it

        def preference(replica: AsyncEngine) -> tuple:
            useful = cached[replica.replica] if replica.num_inflight_seqs - idlest < busy_limit else 0
            return (-useful, *_load(replica))

        return sorted(self.replicas, key=preference)


def prompt_keys(prompt: list[int] | dict) -> list[int]:
    """The token ids a prompt's prefix-cache pages are keyed by (a prepared prompt's images by the images)."""
    if not isinstance(prompt, dict):
        return prompt
    mm = prompt.get("mm_inputs")
    return prompt["prompt_token_ids"] if mm is None else mm.key_token_ids(prompt["prompt_token_ids"])


def _load(replica: AsyncEngine) -> tuple[int, float, int]:
    stats = replica.stats()
    return replica.num_inflight_seqs, stats.kv_cache_usage if stats is not None else 0.0, replica.replica


__all__ = ["LOAD_BALANCE_METHODS", "DataParallelEngine"]

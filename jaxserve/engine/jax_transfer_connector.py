"""`JaxTransferConnector`: prefill/decode disaggregation over jax's transfer server (`jax.experimental.transfer`),
the device side of `kv_connector.py`.

* A prefill worker, right after dispatching the step that computes a `do_remote_decode` request's last prompt
  token, gathers the pages holding its first `len(prompt) - 1` tokens into one array per kind of the pool's leaves
  (`kv_send`: the KV tiers' gather, `kv_tier_copies.store_step`, kept in device memory; padded to a power-of-two
  bucket of pages) and offers them on its transfer server under a random transfer id (`await_pull`, dropped by jax
  after `abort_timeout_s`). The gather is a copy, so the request's pages go back to the pool when it finishes; the
  copy holds device memory outside the pool until it is pulled or dropped.
* A decode worker pulls them into device memory with its pool's sharding while the request waits outside the
  scheduler (a thread connects, one connection per pull; jax moves the bytes); once they have arrived the request is admitted with them
  (`Sequence.received`) and the step that admits it writes them into its newly allocated pages (`kv_receive`, the
  tiers' scatter) before its forwards. A pull that fails (the prefill worker died) or outlasts `pull_timeout_s`
  (the pages expired, or never came) is logged and counted, and the request computes its prompt here instead; a
  pull still arriving when it times out or its request is aborted is failed on its connection, which releases the
  device memory its arrays hold.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import hashlib
import logging
import secrets
import time
import uuid
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jax.sharding import NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.engine.buckets import bucket_for
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_connector import (KVTransferConfig, ReceivedKV, Receive, RemotePrefill, adapter_key,
                                          producer_params, prompt_digest, remote_prefill)
from jaxserve.engine.kv_plan import kv_cache_shardings
from jaxserve.engine.kv_tiers import numpy_dtype
from jaxserve.engine.kv_tier_copies import RestoreInputs, StoreInputs, page_specs, restore_step, store_step, \
    transfer_buckets
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.step_registry import RunnerState, Step, assign
from jaxserve.layers.paged_kv import KV_PAGES

logger = logging.getLogger(__name__)


class _Pull(NamedTuple):
    request: Any  # the engine's `Request`, waiting outside the scheduler
    remote: RemotePrefill
    started: float
    pulled: concurrent.futures.Future  # of (its connection, the pulled arrays, whose bytes may still be arriving)


def kv_layout(runner: RunnerState, model: str) -> dict[str, Any]:
    """What a prefill and a decode worker must share for pages to move between them as they are."""
    model_config = hashlib.sha256(repr(runner.model_config).encode()).hexdigest()[:16]
    return {"model": model, "model_config": model_config, "page_size": runner.engine_config.page_size,
            "pages": [[dtype, list(shape)] for dtype, shape in page_specs(runner.kv_cache)],
            "tensor_parallel_size": runner.tp.size}


def _fail(pull: _Pull) -> None:
    """Fails a pull still arriving (on its own connection), so jax releases the device memory its arrays hold."""
    try:
        connection, arrays = pull.pulled.result(timeout=60)  # the connect thread has started it by then
    except Exception:  # noqa: BLE001 - it never started: nothing is held
        return
    if not all(array.is_ready() for array in arrays):
        connection._poison_connection()  # the only way jax offers (a private method of jax 0.10's connection)


def page_sharding(runner: RunnerState) -> NamedSharding:
    """Pages stacked `[pages, leaves, heads, ...]` in device memory, split like the pool: by head, or whole (a
    latent pool)."""
    return NamedSharding(runner.mesh, KV_PAGES if runner.model_config.mla is None else REPLICATED)


def transfer_steps(runner: RunnerState) -> list[Step]:
    """`kv_send` (pages gathered out of the pool) and `kv_receive` (written into it, the pool donated), one shape
    per bucket of page counts (`kv_tier_copies.transfer_buckets`)."""
    replicated = NamedSharding(runner.mesh, REPLICATED)
    kv_in = kv_cache_shardings(runner.backend, runner.model_config)
    specs, sharding = page_specs(runner.kv_cache), page_sharding(runner)
    buckets = transfer_buckets(runner.engine_config)
    kinds = (sharding,) * len(specs)
    send = jax.jit(store_step, in_shardings=(kv_in, replicated), out_shardings=(kinds, ()))
    receive = jax.jit(functools.partial(restore_step, None), in_shardings=(kv_in, RestoreInputs(replicated, kinds)),
                      out_shardings=(None, (kv_in,)), donate_argnums=(0,))

    def receive_examples():
        for bucket in buckets:
            arrays = [np.zeros((bucket, *shape), numpy_dtype(dtype)) for dtype, shape in specs]
            yield RestoreInputs(np.zeros(bucket, np.int32), tuple(runner.allocator.put(arrays, sharding)))

    state = lambda: (runner.kv_cache,)  # noqa: E731
    return [Step("kv_send", send, state, assign(runner), lambda: (StoreInputs(np.zeros(b, np.int32)) for b in buckets)),
            Step("kv_receive", receive, state, assign(runner, "kv_cache"), receive_examples)]


class JaxTransferConnector:
    """One worker's transfer server, its sends (prefill) and its pulls in flight (decode), with their counters."""

    def __init__(self, config: KVTransferConfig, runner: RunnerState, model: str):
        self.config = config
        self.runner = runner
        self.layout = kv_layout(runner, model)
        self.buckets = transfer_buckets(runner.engine_config)
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.sharding = page_sharding(runner)
        self.page_specs = page_specs(runner.kv_cache)
        client = runner.mesh.devices.flat[0].client
        port = config.kv_port + runner.engine_config.data_parallel_rank if config.kv_port else 0  # a replica's own
        self.server = transfer.start_transfer_server(client, f"{config.kv_ip}:{port}", [f"{config.kv_ip}:0"])
        self.address = self.server.address()
        # connections and pulls start off the stepping thread (jax 0.10's CPU transfer server returns at once;
        # nothing promises that of every platform's)
        self._connect = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self._pulls: dict[str, _Pull] = {}
        self.num_sends = self.pages_sent = self.bytes_sent = 0
        self.num_pulls = self.pages_received = self.bytes_received = self.tokens_received = 0
        self.pull_failures: dict[str, int] = {"error": 0, "timeout": 0}
        self.pull_seconds: list[float] = []  # of the pulls that arrived since the engine last took them
        logger.info("KV transfer: %s (%s) at %s", config.kv_connector, config.kv_role, self.address)

    def steps(self) -> list[Step]:
        return transfer_steps(self.runner)

    # -- the prefill worker ------------------------------------------------------------------------------------

    def send(self, pages: list[int], prompt_token_ids: list[int], adapter: str | None) -> dict[str, Any] | None:
        """Offers the KV of the prompt's first `len(prompt) - 1` tokens (in `pages`, whose step is dispatched) for
        one pull; the `kv_transfer_params` saying where (None for a one-token prompt: nothing to send)."""
        num_tokens = len(prompt_token_ids) - 1
        pages = pages[:-(-num_tokens // self.runner.engine_config.page_size)]
        if not pages:
            return None
        bucket = bucket_for(len(pages), self.buckets)
        indices = np.zeros(bucket, np.int32)  # padding rows: the scratch page
        indices[:len(pages)] = pages
        arrays = self.runner.steps.run("kv_send", StoreInputs(indices))
        transfer_id = secrets.randbits(63)
        expiry = datetime.datetime.now() + datetime.timedelta(seconds=self.config.seconds("abort_timeout_s"))
        self.server.await_pull(transfer_id, list(arrays), timeout=expiry)
        self.num_sends += 1
        self.pages_sent += len(pages)
        self.bytes_sent += sum(array.nbytes for array in arrays) * len(pages) // bucket
        return producer_params(self.address, self.engine_id, transfer_id, pages, num_tokens, bucket,
                               prompt_digest(prompt_token_ids, adapter), self.layout)

    def after_dispatch(self, scheduler_output: SchedulerOutput, seqs: dict[int, Any], requests: dict[str, Any],
                       tables: Callable[[int], list[int]]) -> None:
        """Sends the prompts of the `do_remote_decode` requests whose last prompt token this dispatched step
        computes (their first completion's; `tables(seq_id)`: its pages)."""
        for chunk in scheduler_output.prefills:
            seq = seqs.get(chunk.seq_id)
            request = requests.get(seq.request_id) if seq is not None else None
            if (request is None or request.kv_transfer != "send" or seq.index
                    or not chunk.start < seq.num_prompt_tokens <= chunk.start + chunk.num_tokens):
                continue
            request.kv_transfer_params = self.send(list(tables(seq.seq_id)), request.prompt_token_ids,
                                                   adapter_key(seq))

    # -- the decode worker -------------------------------------------------------------------------------------

    def check(self, request: Any, params: dict[str, Any]) -> RemotePrefill:
        """The pull a decode request's `kv_transfer_params` describe (ValueError naming what does not match)."""
        if request.seqs[0].mm is not None:
            raise ValueError("kv_transfer_params: prefill/decode disaggregation does not take images yet")
        return remote_prefill(params, self.layout, self.buckets, request.prompt_token_ids, adapter_key(request.seqs[0]),
                              self.runner.engine_config.page_size)

    def pull(self, request: Any, remote: RemotePrefill) -> None:
        """Starts pulling `request`'s pages; the request waits until `take_pulled` hands it back."""
        shapes = [jax.ShapeDtypeStruct((remote.bucket, *shape), jnp.dtype(dtype), sharding=self.sharding)
                  for dtype, shape in self.page_specs]
        future = self._connect.submit(self._start_pull, f"{remote.host}:{remote.port}", remote.transfer_id, shapes)
        self._pulls[request.request_id] = _Pull(request, remote, time.monotonic(), future)
        self.num_pulls += 1

    def _start_pull(self, address: str, transfer_id: int, shapes: list) -> tuple[Any, list[jax.Array]]:
        """A connection of its own (so a pull that never arrives can be failed alone) and the pull started on it."""
        connection = self.server.connect(address)
        return connection, connection.pull(transfer_id, shapes)

    def cancel(self, request_id: str) -> bool:
        """Forgets a waiting request's pull (an abort); False if it has none."""
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            _fail(pull)
        return pull is not None

    @property
    def num_pulling(self) -> int:
        return len(self._pulls)

    def take_pulled(self) -> list[tuple[Any, ReceivedKV | None]]:
        """The waiting requests whose pulls ended since the last call: with what arrived, or None (failed or timed
        out: the request computes its prompt)."""
        ended = []
        now = time.monotonic()
        for request_id, pull in list(self._pulls.items()):
            received = self._outcome(pull, now)
            if received is not False:
                del self._pulls[request_id]
                ended.append((pull.request, received))
        return ended

    def _outcome(self, pull: _Pull, now: float) -> ReceivedKV | None | bool:
        """What arrived (None: the pull failed or timed out; False: still arriving)."""
        remote, future = pull.remote, pull.pulled
        error, arrays = None, None
        if future.done():
            error = future.exception()
            if error is None and all(array.is_ready() for array in future.result()[1]):
                try:
                    arrays = jax.block_until_ready(future.result()[1])  # raises a failed pull's error
                except Exception as failed:  # noqa: BLE001 - any failure of the remote side
                    error = failed
        if error is not None:
            logger.warning("KV transfer: pulling %d pages from %s:%d failed, computing the prompt here (%s)",
                           remote.num_pages, remote.host, remote.port, error)
            self.pull_failures["error"] += 1
            return None
        if arrays is not None:
            self.pull_seconds.append(now - pull.started)
            self.pages_received += remote.num_pages
            self.tokens_received += remote.num_tokens
            self.bytes_received += sum(array.nbytes for array in arrays) * remote.num_pages // remote.bucket
            return ReceivedKV(remote.num_tokens, remote.num_pages, tuple(arrays))
        if now - pull.started < self.config.seconds("pull_timeout_s"):
            return False
        logger.warning("KV transfer: no pages from %s:%d after %.0fs, computing the prompt here", remote.host,
                       remote.port, now - pull.started)
        self.pull_failures["timeout"] += 1
        _fail(pull)
        return None

    def receive(self, receives: tuple[Receive, ...]) -> None:
        """Writes received pages into the pool pages the step allocated them (before its forwards)."""
        for receive in receives:
            self.runner.steps.run("kv_receive", RestoreInputs(np.asarray(receive.pages, np.int32),
                                                              receive.received.arrays))

    def take_pull_seconds(self) -> tuple[float, ...]:
        seconds, self.pull_seconds = tuple(self.pull_seconds), []
        return seconds

    def stats(self) -> dict[str, Any]:
        return dict(kv_transfer_sends=self.num_sends, kv_transfer_pages_sent=self.pages_sent,
                    kv_transfer_bytes_sent=self.bytes_sent, kv_transfer_pulls=self.num_pulls,
                    kv_transfer_pages_received=self.pages_received, kv_transfer_bytes_received=self.bytes_received,
                    kv_transfer_tokens_received=self.tokens_received,
                    kv_transfer_pull_failures=tuple(sorted(self.pull_failures.items())))

    def close(self) -> None:
        self._connect.shutdown(wait=False, cancel_futures=True)


def attach_connector(config: EngineConfig, runner: RunnerState, model: str) -> JaxTransferConnector | None:
    """The connector `config.kv_transfer_config` asks for, attached to the runner (None: none); ValueError for
    what it does not move yet."""
    transfer_config = config.kv_transfer
    if transfer_config is None:
        return None
    plan = runner.kv_plan
    spec = config.speculative_config
    refused = ("several hosts" if jax.process_count() > 1
               else "sliding-window KV cache groups" if len(plan.groups) > 1
               else "a hybrid model's state layers" if plan.state is not None
               else f"speculative method {spec.method!r} (its own KV)" if spec is not None and spec.method != "ngram"
               else None)
    if refused is not None:
        raise ValueError(f"kv_transfer_config: prefill/decode disaggregation does not support {refused} yet")
    connector = JaxTransferConnector(transfer_config, runner, model)
    runner.attach_connector(connector)
    return connector

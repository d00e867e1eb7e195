"""Serving over several hosts with jax.distributed: every host runs the same jitted calls in the same order
(JAX's multi-controller model), and rank 0, the leader, decides them.

The leader runs the HTTP server, the scheduler and the page manager. Before each device call it sends the
call's kind and its host-side inputs (token ids, positions, page tables, sampling parameters: kilobytes) to
every follower over a plain TCP connection (`PlanLeader`); each follower runs the same compiled executable
on them with its own shards (`follow`). Start-up (loading, warm-up) is the same code on every host, so it
runs in the same order without messages.

Why a socket and not `jax.experimental.multihost_utils.broadcast_one_to_all`: a step's calls change in
number, shape and structure every step, while a device broadcast needs the same pytree on every host and
runs a collective through the accelerators for a few kilobytes; and a closed connection tells a follower
at once that the leader is gone (and the leader that a follower is), where a collective would hang.

Lifetimes: a follower exits as soon as the leader's connection closes (the leader stopped or crashed); the
leader reports a follower whose connection closes (`on_lost`), and the server then fails in-flight
requests with 503 and exits non-zero. Both leave with `os._exit`: jax.distributed's shutdown barrier
would wait for a peer that is gone. The messages are plain data, never pickles (`wire.py`): a follower runs a
call only if it is one of its steps with inputs of a structure and shape its warm-up compiled, and exits on
anything else.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import Callable

import jax
from jax.experimental import multihost_utils

from jaxserve.distributed.wire import Call, CallSignatures, encode_call, encode_stop

logger = logging.getLogger(__name__)
HEADER = struct.Struct("!Q")  # frame length
CONNECT_TIMEOUT = 600.0  # seconds a follower retries reaching the leader, and the leader waits for followers


@dataclasses.dataclass(frozen=True)
class MultiHost:
    """sglang-jax's flags: `--nnodes H --node-rank R --dist-init-addr HOST:PORT`. The jax.distributed coordinator
    listens on HOST:PORT (rank 0's host) and the leader's plan channel on HOST:PORT+1."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise ValueError(f"dist_init_addr (HOST:PORT of rank 0) is needed with nnodes={self.nnodes}")
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")

    @property
    def enabled(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def plan_address(self) -> tuple[str, int]:
        host, _, port = self.dist_init_addr.rpartition(":")
        return host, int(port) + 1

    def initialize(self) -> None:
        """`jax.distributed.initialize` for this host (CPU collectives over gloo, so CPU-only hosts work too)."""
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(self.dist_init_addr, num_processes=self.nnodes, process_id=self.node_rank)
        logger.info("jax.distributed: process %d of %d, %d local and %d global devices", jax.process_index(),
                    jax.process_count(), jax.local_device_count(), jax.device_count())
        # gloo connects the hosts at their first collective and gives up on a host 30 s late (fixed in XLA): the
        # first happens here, where the hosts are in step, not in the engine, after a leader's server start-up
        multihost_utils.sync_global_devices("jaxserve: hosts joined")


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(HEADER.pack(len(payload)) + payload)


def _receive(sock: socket.socket) -> bytes | None:
    """One frame, or None once the peer closed the connection."""
    header = _receive_exactly(sock, HEADER.size)
    return None if header is None else _receive_exactly(sock, HEADER.unpack(header)[0])


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        try:
            chunk = sock.recv(min(remaining, 1 << 20))
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class PlanLeader:
    """Rank 0's side: accepts the followers' connections, sends them every call, and watches them."""

    def __init__(self, multihost: MultiHost, on_lost: Callable[[str], None]):
        self.num_followers = multihost.nnodes - 1
        self.on_lost = on_lost
        self._server = socket.create_server(("", multihost.plan_address[1]))
        self._followers: dict[int, socket.socket] = {}
        self._all_connected = threading.Event()
        self._closing = False
        threading.Thread(target=self._accept, name="jaxserve-plan-accept", daemon=True).start()

    def _accept(self) -> None:
        while len(self._followers) < self.num_followers:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            hello = _receive(sock)
            if hello is None:
                sock.close()
                continue
            try:
                rank = int(hello)
            except ValueError:
                logger.warning("a connection to the plan channel sent %r instead of a follower rank", hello[:32])
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._followers[rank] = sock
            threading.Thread(target=self._watch, args=(rank, sock), name=f"jaxserve-follower-{rank}",
                             daemon=True).start()
        self._all_connected.set()

    def _watch(self, rank: int, sock: socket.socket) -> None:
        """Followers never send after their hello: a read returning means the connection closed."""
        _receive_exactly(sock, 1)
        if not self._closing:
            self.on_lost(f"follower rank {rank} disconnected")

    def wait_for_followers(self, timeout: float = CONNECT_TIMEOUT) -> None:
        if not self._all_connected.wait(timeout):
            raise RuntimeError(f"only {len(self._followers)} of {self.num_followers} followers connected to the "
                               f"plan channel within {timeout:.0f}s")
        logger.info("all %d followers connected", self.num_followers)

    def send(self, call: Call) -> None:
        """Tells every follower to run `call` (before the leader runs it)."""
        payload = encode_call(call)
        for rank, sock in self._followers.items():
            try:
                _send(sock, payload)
            except OSError as err:
                self.on_lost(f"follower rank {rank} cannot be reached: {err}")
                raise RuntimeError(f"follower rank {rank} cannot be reached: {err}") from err

    def close(self, status: int) -> None:
        """Tells the followers to exit with the leader's `status`, then closes the connections."""
        self._closing = True
        for sock in self._followers.values():
            try:
                _send(sock, encode_stop(status))  # followers exit with the leader's status
                sock.close()
            except OSError:
                pass
        self._server.close()


def follow(runner, multihost: MultiHost) -> None:
    """A follower's life after its engine is built: connect to the leader, then run every call it sends, in
    order, until it says stop (exit with the leader's status) or its connection closes (exit 1). Never returns."""
    signatures = CallSignatures(runner.steps.sent_examples())
    sock = _connect(multihost.plan_address)
    _send(sock, str(multihost.node_rank).encode())
    calls: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:  # a thread of its own: the main thread may be stuck in a collective with a dead leader
        while True:
            frame = _receive(sock)
            if frame is None:
                _exit(1, f"the leader's connection closed; follower rank {multihost.node_rank} exits")
            try:
                call = signatures.decode(frame)
            except ValueError as error:
                _exit(1, f"follower rank {multihost.node_rank} got a call it cannot run ({error}); it exits")
            if call.step == "stop":
                _exit(call.inputs, f"the leader stopped (status {call.inputs}); follower rank {multihost.node_rank} "
                                   "exits")
            calls.put(call)

    threading.Thread(target=read, name="jaxserve-plan-reader", daemon=True).start()
    logger.info("follower rank %d runs the leader's calls", multihost.node_rank)
    while True:
        try:
            runner.steps.replay(calls.get())
        except ValueError as error:  # a call that takes an output this host does not hold
            _exit(1, f"follower rank {multihost.node_rank} cannot run the leader's call ({error}); it exits")
        jax.block_until_ready(runner.kv_cache)  # surfaces a failed call here, not several calls later


def _exit(status: int, message: str) -> None:
    (logger.error if status else logger.info)(message)
    logging.shutdown()
    os._exit(status)


def _connect(address: tuple[str, int]) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            sock = socket.create_connection(address, timeout=10)
            sock.settimeout(None)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

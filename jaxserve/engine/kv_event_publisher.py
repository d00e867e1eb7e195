"""`ZmqEventPublisher`: KV cache events (`kv_events.py`) sent as vLLM sends them, for the consumers built for vLLM
(vllm-router's `kv_aware` policy, Dynamo, llm-d): one msgpack `KVEventBatch` per engine step on a ZMQ PUB socket, as
the frames (topic, sequence number as 8 bytes big-endian, payload); a ROUTER socket, if configured, answers a
subscriber that missed batches (a request frame holding the first sequence number it wants) with each buffered
batch from there on, then a sequence number of -1 and an empty payload.

The wire types are vLLM's (`vllm/distributed/kv_events.py`), msgspec structs: the batch an array `[ts, events,
data_parallel_rank]`, each event a map tagged by its class name under "type" (vllm-router refuses any other form). A page's hash is its 32-byte prefix-cache key (vLLM's `ExternalBlockHash` may be bytes); `medium` is "GPU"
for the device's pages, as vLLM names them on any accelerator. Sending runs on the publisher's thread: the engine
only queues a step's batch.
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import threading
import time

import msgspec
import zmq

from jaxserve.engine.kv_events import ClearedPages, KVEvent, KVEventsConfig, RemovedPages, StoredPage

logger = logging.getLogger(__name__)
DEVICE_MEDIUM = "GPU"
END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the KV cache events: maps tagged by class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # always sent: vllm-router requires it


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_events(events: list[KVEvent], page_size: int) -> list[KVCacheEvent]:
    """The log's records as vLLM's event types."""
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, StoredPage):
            out.append(BlockStored([event.key], event.parent_key, list(event.token_ids), page_size, event.lora_id,
                                   DEVICE_MEDIUM, event.lora_name))
        elif isinstance(event, RemovedPages):
            out.append(BlockRemoved(list(event.keys), DEVICE_MEDIUM))
        elif isinstance(event, ClearedPages):
            out.append(AllBlocksCleared())
    return out


def replica_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel replica's endpoint: the port plus its rank (vLLM's rule for tcp endpoints)."""
    match = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if match is None or rank == 0:
        return endpoint
    return f"{match.group(1)}{int(match.group(2)) + rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, page_size: int, data_parallel_rank: int = 0):
        self.page_size = page_size
        self.rank = data_parallel_rank
        self.topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = replica_endpoint(config.endpoint, data_parallel_rank)
        self._pub.bind(self.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replica_endpoint(config.replay_endpoint, data_parallel_rank))
        self.num_dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queues one step's events as a batch (none: nothing is sent); a full queue drops it, counted."""
        if not events:
            return
        batch = KVEventBatch(time.time(), wire_events(events, self.page_size), self.rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("kv events: the queue of %d batches is full, a batch was dropped (%d so far); "
                           "subscribers' replay cannot recover it", self._queue.maxsize, self.num_dropped)

    def flush(self) -> None:
        """Waits until every queued batch is sent."""
        self._queue.join()

    def shutdown(self, timeout: float = 1.0) -> None:
        """Sends what is queued (for up to `timeout` seconds), then closes the sockets."""
        self._running = False
        self._thread.join(timeout)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        sequence = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running or not self._queue.empty():
            if self._replay is not None and poller.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            payload = self._encoder.encode(batch)
            self._pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
            self._buffer.append((sequence, payload))
            sequence += 1
            self._queue.task_done()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: a replay request of %d frames ignored (want identity, empty, 8 bytes)",
                           len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for sequence, payload in list(self._buffer):
            if sequence >= start:
                self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQUENCE, b""))

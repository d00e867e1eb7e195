"""KV cache events (vLLM's `--kv-events-config`): what the prefix cache stores and drops, published so a router
(vllm-router's `kv_aware` policy, Dynamo, llm-d) can send each request where its prefix is cached.

`KVEventsConfig` is vLLM's configuration; `KVEventLog` is the page manager's record of the step's changes as plain
data (a page registered in the prefix cache: its key, its parent's, its token ids and adapter; a cached page
reused for other tokens; the cache reset). The engine hands each step's records to the publisher
(`kv_event_publisher.py`), which sends them in vLLM's wire format.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig`: ZMQ PUB on `endpoint` (a data-parallel replica's port is `endpoint`'s plus its
    rank, as vLLM's), an optional ROUTER socket on `replay_endpoint` answering for the last `buffer_steps`
    batches, `topic` before each message."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null": events computed but not sent
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config {name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise ValueError(f"kv_events_config {name} must be a ZMQ endpoint like 'tcp://*:5557', got {value!r}")

    @classmethod
    def parse(cls, text: str | dict) -> KVEventsConfig:
        """From the flag's JSON (or a dict); ValueError naming an unknown field or a bad value."""
        return config_from_json(cls, text, "--kv-events-config")


def config_from_json(cls: type, text: str | dict, flag: str) -> Any:
    """A frozen config dataclass from a flag's JSON object (or a dict); ValueError naming bad JSON or an unknown
    field (the class checks its values)."""
    try:
        fields = json.loads(text) if isinstance(text, str) else dict(text)
    except ValueError as error:
        raise ValueError(f"{flag} is not valid JSON ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(fields) - {field.name for field in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{flag} has unknown fields {unknown}")
    return cls(**fields)


class StoredPage(NamedTuple):
    """A page registered in the prefix cache (vLLM's `BlockStored` of one block)."""

    key: bytes
    parent_key: bytes | None  # None: the first page of its chain
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


class RemovedPages(NamedTuple):
    keys: tuple[bytes, ...]


class ClearedPages(NamedTuple):
    pass


KVEvent = StoredPage | RemovedPages | ClearedPages


class KVEventLog:
    """The prefix cache's changes since the last `take`, in order."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def stored(self, key: bytes, parent_key: bytes | None, token_ids: tuple[int, ...], lora: Any = None) -> None:
        request = None if lora is None else lora.request  # a `LoadedAdapter`'s
        self._events.append(StoredPage(key, parent_key, tuple(token_ids),
                                       None if request is None else request.lora_int_id,
                                       None if request is None else request.lora_name))

    def removed(self, key: bytes) -> None:
        if self._events and isinstance(self._events[-1], RemovedPages):
            self._events[-1] = RemovedPages(self._events[-1].keys + (key,))
        else:
            self._events.append(RemovedPages((key,)))

    def cleared(self) -> None:
        self._events.append(ClearedPages())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


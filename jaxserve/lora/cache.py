"""Where adapters live between disk and the device: `AdapterCache`, the host cache of read and checked adapters
(`max_cpu_loras`, least recently used first out), and `AdapterSlots`, the scheduler's record of the `max_loras`
device slots (which adapter each holds, how many running sequences pin it, least recently used unpinned slot
reused first).

A request takes its `LoadedAdapter` from the host cache when it is accepted (read from disk on a miss, on the
caller's thread) and holds it until it ends, so an adapter evicted from the host cache meanwhile is only re-read by
later requests. A waiting sequence is admitted only when its adapter holds a slot or a slot is free of pins; the
step that admits it first writes the adapter into its slot if the slot holds another (`SchedulerOutput.lora_loads`).
Adapters are known by the sha256 of their files, so a changed adapter under the same id never reads a slot, or a
prefix-cache page, of the old one.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import Counter, OrderedDict

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.lora.peft_format import AdapterWeights, read_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.weights import fused_columns, serving_adapter


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """A read adapter: its request, its weights as read and in the serving layout (numpy, ready for a slot)."""

    request: LoRARequest
    weights: AdapterWeights
    serving: dict

    @property
    def key(self) -> bytes:
        return self.weights.key

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def prefix_root(self) -> bytes:
        """The parent key of its sequences' first prefix-cache page (the base model's is b"")."""
        return b"lora:" + self.weights.key


class AdapterCache:
    """Read adapters by `lora_int_id`, at most `capacity` of them; safe to call from any thread."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, max_rank: int, capacity: int):
        self.model_config, self.max_rank, self.capacity = config, max_rank, capacity
        self.columns = fused_columns(config, tp)
        self._lock = threading.Lock()
        self._adapters: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.num_reads = 0  # adapters read from disk (a miss)

    def get(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter of `request`, read and checked on a miss (ValueError naming the problem)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            cached = self._adapters.get(request.lora_int_id)
            if cached is not None:
                if (cached.request.lora_path, cached.request.lora_name) != (request.lora_path, request.lora_name):
                    raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                                     f"{cached.request.lora_name!r} ({cached.request.lora_path!r}); unload it or "
                                     f"use another id for {request.lora_name!r} ({request.lora_path!r})")
                self._adapters.move_to_end(request.lora_int_id)
                return cached
        weights = read_adapter(request.lora_name, request.lora_path, self.model_config, self.max_rank)
        loaded = LoadedAdapter(request, weights, serving_adapter(weights, self.model_config, self.max_rank, self.columns))
        with self._lock:
            self.num_reads += 1
            self._adapters[request.lora_int_id] = loaded
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        return loaded

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an adapter (running requests keep theirs); False if it was not cached."""
        with self._lock:
            return self._adapters.pop(lora_int_id, None) is not None

    def cached_ids(self) -> list[int]:
        with self._lock:
            return list(self._adapters)


class AdapterSlots:
    """The device stack's `num_slots` slots, as the scheduler assigns them, and how many unfinished sequences (waiting
    or running) each adapter has, for the metrics' running and waiting adapters."""

    def __init__(self, num_slots: int):
        self.keys: list[bytes | None] = [None] * num_slots  # the adapter each slot holds
        self.names: list[str | None] = [None] * num_slots  # and its name
        self._unfinished: Counter[str] = Counter()  # adapter name -> unfinished sequences
        self.pins = [0] * num_slots  # running sequences using it
        self._last_used = [-1] * num_slots
        self._clock = itertools.count()
        self.num_loads = 0

    def slot_of(self, key: bytes) -> int | None:
        return self.keys.index(key) if key in self.keys else None

    def can_acquire(self, key: bytes) -> bool:
        """Whether a sequence of adapter `key` can run now: the adapter holds a slot, or a slot has no pins."""
        return key in self.keys or 0 in self.pins

    def acquire(self, adapter: LoadedAdapter) -> tuple[int, bool]:
        """Pins a slot for one sequence of `adapter`: (slot, whether the adapter must be written into it first).
        Call only when `can_acquire`."""
        slot = self.slot_of(adapter.key)
        load = slot is None
        if load:
            slot = min((s for s, pins in enumerate(self.pins) if pins == 0), key=self._last_used.__getitem__)
            self.keys[slot], self.names[slot] = adapter.key, adapter.name
            self.num_loads += 1
        self.pins[slot] += 1
        return slot, load

    def release(self, slot: int) -> None:
        """A sequence using `slot` left it (finished or preempted)."""
        self.pins[slot] -= 1
        self._last_used[slot] = next(self._clock)

    def count(self, adapter: LoadedAdapter, change: int) -> None:
        """A sequence of `adapter` arrived (+1) or finished (-1)."""
        self._unfinished[adapter.name] += change
        if not self._unfinished[adapter.name]:
            del self._unfinished[adapter.name]

    def running_adapters(self) -> tuple[str, ...]:
        """The names of the adapters running sequences use."""
        return tuple(sorted({name for name, pins in zip(self.names, self.pins) if pins}))

    def waiting_adapters(self) -> tuple[str, ...]:
        """The names of the adapters that have waiting sequences (unfinished ones beyond those running)."""
        running = Counter()
        for name, pins in zip(self.names, self.pins):
            running[name] += pins
        return tuple(sorted(name for name, num in self._unfinished.items() if num > running[name]))

"""The scheduler's side of adapters (host only, no jax): `LoadedAdapter`, a read adapter a request holds until it
ends, and `AdapterSlots`, the record of the `max_loras` device slots (which adapter each holds, how many running
sequences pin it, least recently used unpinned slot reused first)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.lora.peft_format import AdapterWeights
    from jaxserve.lora.request import LoRARequest


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

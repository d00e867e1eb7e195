"""Where adapters live between disk and the device: `AdapterCache`, the host cache of read and checked adapters
(`max_cpu_loras`, least recently used first out); the scheduler's record of the device slots is `lora/slots.py`.

A request takes its `LoadedAdapter` from the host cache when it is accepted (read from disk on a miss, on the
caller's thread) and holds it until it ends, so an adapter evicted from the host cache meanwhile is only re-read by
later requests. A waiting sequence is admitted only when its adapter holds a slot or a slot is free of pins; the
step that admits it first writes the adapter into its slot if the slot holds another (`SchedulerOutput.lora_loads`).
Adapters are known by the sha256 of their files, so a changed adapter under the same id never reads a slot, or a
prefix-cache page, of the old one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.lora.peft_format import read_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import LoadedAdapter
from jaxserve.lora.weights import fused_columns, serving_adapter


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

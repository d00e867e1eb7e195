"""`Step`: one jitted device call as one record; `StepRegistry`: how the runner runs, warms up and replays them.

A step's function takes its state arrays (read from their owner: the runner, its speculator, a draft model) and
one pytree of inputs, and returns `(outputs, new_state)`; the state is donated, so the registry hands the new state
to the step's `store` before anything else can read the old. Every call goes through `run`: a multi-host leader
tells its followers each call first (`on_call`), and after warm-up a call that compiles is logged. Inputs that are
an earlier call's output on the device (a forward's logits, a draft model's proposal) are not sent: a follower
takes its own latest output of the same name, or, for a call that takes an output after other calls ran (a sampler
waiting for token masks takes its forward's logits), the output the earlier call was asked to keep (`replay`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import REPLICATED
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.distributed.wire import Call
from jaxserve.engine.allocator import Allocator
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.input_batch import InputBatch
from jaxserve.engine.steps import SlotState
from jaxserve.layers.attention import PagedAttention
from jaxserve.layers.matmul_blocks import lowering_platform
from jaxserve.layers.sampler import PenaltyState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    fn: Callable[..., tuple[Any, tuple]]  # jitted: fn(*state(), inputs) -> (outputs, new_state)
    state: Callable[[], tuple]  # the state arguments, read from their owner at each call
    store: Callable[..., None]  # store(*new_state) keeps the new state with its owner
    examples: Callable[[], Iterable[Any]]  # inputs of every shape it can be called with (warm-up); scratch page only
    forwards: tuple[str, ...] = ()  # fields of its outputs later calls take as inputs (a follower keeps them)
    forwarded: tuple[str, ...] = ()  # fields of its inputs that may be such an output, on the device


def assign(owner: Any, *names: str) -> Callable[..., None]:
    """A `Step.store` that sets `owner`'s attributes `names` to the new state, in order."""
    def store(*values) -> None:
        for name, value in zip(names, values):
            setattr(owner, name, value)
    return store


def jit_step(fn: Callable, mesh: Mesh, state_shardings: tuple, new_state_shardings: tuple,
             donate: tuple[int, ...]) -> Callable:
    """`fn` jitted as a `Step.fn`: its state placed by `state_shardings` (the `donate` arguments donated), its new
    state by `new_state_shardings`, its inputs and outputs replicated over `mesh`."""
    replicated = NamedSharding(mesh, REPLICATED)
    return jax.jit(fn, in_shardings=(*state_shardings, replicated), out_shardings=(replicated, new_state_shardings),
                   donate_argnums=donate)


def shape_key(inputs: Any) -> tuple:
    """The shapes and dtypes of a step's inputs: which executable serves them."""
    return tuple((leaf.shape, leaf.dtype.name) for leaf in jax.tree.leaves(inputs))


class RunnerState(Protocol):
    """What the step records of the runner (and of its `Speculator`) read off the runner: its configs, mesh and
    device state, the accessors of the state its forwards and samplers donate, and its registry."""

    engine_config: EngineConfig
    model_config: ModelConfig
    mesh: Mesh
    tp: TensorParallel
    backend: PagedAttention
    dtype: Any
    kv_plan: KVPlan  # its KV cache groups and their pools' pages (`engine/kv_plan.py`)
    params: dict
    batch: InputBatch  # each slot's rows, slot state, penalty state and device sampling table
    all_allowed: dict[int, jax.Array]  # a sampler call's bitmask without constrained rows, per row count
    allocator: Allocator  # where its device state and its steps' device-side examples come from
    steps: StepRegistry
    aux_layers: tuple[int, ...]  # the layers whose inputs its forwards return (an EAGLE-3 head's; empty: none)

    def jit_forward(self, step_fn: Callable, **options) -> Callable: ...
    def forward_state(self) -> tuple: ...
    def keep_forward_state(self, kv_cache, slot_state: SlotState) -> None: ...
    def sampler_state(self) -> tuple: ...
    def keep_sampler_state(self, penalties: PenaltyState, slot_state: SlotState) -> None: ...
    def send_sampling_table(self) -> None: ...


class StepRegistry:
    """The runner's steps by name. `on_call(call)`, when set (a multi-host leader), hears every call before it
    runs, as the follower is to run it (`Call`)."""

    def __init__(self):
        self.steps: dict[str, Step] = {}
        self.on_call: Callable[[Call], None] | None = None
        self._warm = False  # after warm-up, a jitted step's cache growing means a compile while serving
        self._cache_sizes: dict[str, int] = {}
        self._forwarded: dict[str, Any] = {}  # a follower's latest outputs that later calls take (`replay`)
        self._serials = itertools.count()
        self._kept_ids: dict[int, int] = {}  # leader: id of a kept output (alive until taken) -> its serial
        self._kept: dict[int, dict[str, Any]] = {}  # follower: serial -> its own kept outputs

    def add(self, steps: Iterable[Step]) -> None:
        for step in steps:
            self.steps[step.name] = step

    def __getitem__(self, name: str) -> Step:
        return self.steps[name]

    def run(self, name: str, inputs: Any, keep: tuple[str, ...] = ()) -> Any:
        """Runs one call through jax's C++ dispatch path, keeps its new state and returns its outputs. After
        warm-up every shape is compiled: a miss is logged (it compiled while serving). `keep`: output fields a
        later call takes after other calls of the step ran (a sampler waiting for token masks takes its forward's
        logits), which a multi-host follower then keeps for it."""
        step = self.steps[name]
        serial = None
        if self.on_call is not None:
            inputs_sent, sources = self.as_sent(name, inputs)
            serial = next(self._serials) if keep else None
            self.on_call(Call(name, inputs_sent, (serial, keep) if keep else None, sources))
        outputs, new_state = step.fn(*step.state(), inputs)
        step.store(*new_state)
        if serial is not None:
            self._kept_ids.update({id(getattr(outputs, field)): serial for field in keep})
        if self._warm and step.fn._cache_size() != self._cache_sizes[name]:
            self._cache_sizes[name] = step.fn._cache_size()
            logger.warning("compiled a %s step for shapes %s while serving: warm-up missed it", name,
                           shape_key(inputs))
        return outputs

    def replay(self, call: Call) -> None:
        """Runs one call as `run` does and keeps only its new state (and the outputs later calls take): how a
        multi-host follower runs the leader's calls. An input the leader left out (None) is this host's kept output
        the call names (`Call.sources`), else its latest output of that name; ValueError for one it does not hold."""
        step = self.steps[call.step]
        missing = {}
        for field in step.forwarded:
            if getattr(call.inputs, field) is not None:
                continue
            if field in call.sources:
                kept = self._kept.pop(call.sources[field], {})
                if field not in kept:
                    raise ValueError(f"step {call.step!r} takes the {field} kept by call {call.sources[field]}, "
                                     "which this host does not hold")
                missing[field] = kept[field]
            else:
                missing[field] = self._forwarded.get(field)
        outputs = self.run(call.step, call.inputs.replace(**missing) if missing else call.inputs)
        self._forwarded.update({field: getattr(outputs, field) for field in step.forwards})
        if call.keep is not None:
            serial, fields = call.keep
            self._kept[serial] = {field: getattr(outputs, field) for field in fields if field in step.forwards}

    def as_sent(self, name: str, inputs: Any) -> tuple[Any, dict[str, int]]:
        """`inputs` as a multi-host leader sends them, and their sources: device outputs of earlier calls stay
        behind (None), since followers hold their own; one that a call was asked to keep is named by its serial."""
        sent, left_out = self._leave_out(name, inputs)
        ids = {field: id(getattr(inputs, field)) for field in left_out}
        return sent, {field: self._kept_ids.pop(key) for field, key in ids.items() if key in self._kept_ids}

    def sent_examples(self) -> Iterator[tuple[str, Any]]:
        """`(name, inputs)` for every shape of every step, as a leader sends them: what a follower may run."""
        for name, inputs in self.examples():
            yield name, self._leave_out(name, inputs)[0]

    def _leave_out(self, name: str, inputs: Any) -> tuple[Any, list[str]]:
        """`inputs` without their forwarded inputs that are device arrays, and those fields."""
        left_out = [field for field in self.steps[name].forwarded if isinstance(getattr(inputs, field), jax.Array)]
        return (inputs.replace(**dict.fromkeys(left_out)) if left_out else inputs), left_out

    def examples(self) -> Iterator[tuple[str, Any]]:
        """`(name, inputs)` for every shape of every step."""
        for step in self.steps.values():
            for inputs in step.examples():
                yield step.name, inputs

    def warmup(self) -> float:
        """Compiles every shape ahead of time (lowered in turn, each compiled in a pool as soon as it is lowered),
        then runs each once through the jitted functions, which reuse those executables, since an executable's
        first run is slower than later ones and would otherwise land on a request. Returns its seconds."""
        started = time.perf_counter()
        compiling = {}
        with concurrent.futures.ThreadPoolExecutor(compile_threads()) as pool:
            for name, inputs in self.examples():
                key = (name, shape_key(inputs))
                if key not in compiling:
                    step = self.steps[name]
                    compiling[key] = pool.submit(step.fn.lower(*step.state(), inputs).compile)
            for future in compiling.values():
                future.result()
        for name, inputs in self.examples():
            self.run(name, inputs)
        jax.block_until_ready([step.state() for step in self.steps.values()])
        self._cache_sizes = {name: step.fn._cache_size() for name, step in self.steps.items()}
        self._warm = True
        return time.perf_counter() - started


def compile_threads(jobs: int | None = None) -> int:
    """Threads compiling steps at once (compiling frees the GIL): `jobs`, default one per core, but one on TPU,
    whose compiler (libtpu 0.0.42) crashed the process (SIGSEGV) now and then compiling gpt-oss-20b's steps on
    two threads for v6e targets, never on one (`jaxserve compile`)."""
    if lowering_platform() == "tpu":
        return 1
    return max(1, jobs or os.cpu_count() or 1)

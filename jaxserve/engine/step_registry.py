"""`Step`: one jitted device call as one record; `StepRegistry`: how the runner runs, warms up and replays them.

A step's function takes its state arrays (read from their owner: the runner, its speculator, a draft model) and
one pytree of inputs, and returns `(outputs, new_state)`; the state is donated, so the registry hands the new state
to the step's `store` before anything else can read the old. Every call goes through `run`: a multi-host leader
tells its followers each call first (`on_call`), and after warm-up a call that compiles is logged. Inputs that are
an earlier call's output on the device (a forward's logits, a draft model's proposal) are not sent: a follower
takes its own copy, kept under the same field name (`replay`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.distributed.shardings import REPLICATED
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.slot_params import SlotSamplingParams
from jaxserve.engine.steps import SlotState
from jaxserve.layers.attention import PagedAttention
from jaxserve.layers.sampler import PenaltyState, SamplingBatch

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
    config: ModelConfig
    mesh: Mesh
    tp: TensorParallel
    backend: PagedAttention
    dtype: Any
    params: dict
    penalties: PenaltyState
    slot_state: SlotState
    sampling_table: SamplingBatch
    slot_params: SlotSamplingParams
    all_allowed: dict[int, jax.Array]  # a sampler call's bitmask without constrained rows, per row count
    steps: StepRegistry

    def jit_forward(self, step_fn: Callable, **options) -> Callable: ...
    def forward_state(self) -> tuple: ...
    def keep_forward_state(self, kv_cache, slot_state: SlotState) -> None: ...
    def sampler_state(self) -> tuple: ...
    def keep_sampler_state(self, penalties: PenaltyState, slot_state: SlotState) -> None: ...
    def send_sampling_table(self) -> None: ...


class StepRegistry:
    """The runner's steps by name. `on_call(name, inputs)`, when set (a multi-host leader), hears every call before
    it runs."""

    def __init__(self):
        self.steps: dict[str, Step] = {}
        self.on_call: Callable[[str, Any], None] | None = None
        self._warm = False  # after warm-up, a jitted step's cache growing means a compile while serving
        self._cache_sizes: dict[str, int] = {}
        self._forwarded: dict[str, Any] = {}  # a follower's latest outputs that later calls take (`replay`)

    def add(self, steps: Iterable[Step]) -> None:
        for step in steps:
            self.steps[step.name] = step

    def __getitem__(self, name: str) -> Step:
        return self.steps[name]

    def run(self, name: str, inputs: Any) -> Any:
        """Runs one call through jax's C++ dispatch path, keeps its new state and returns its outputs. After
        warm-up every shape is compiled: a miss is logged (it compiled while serving)."""
        step = self.steps[name]
        if self.on_call is not None:
            self.on_call(name, self.as_sent(name, inputs))
        outputs, new_state = step.fn(*step.state(), inputs)
        step.store(*new_state)
        if self._warm and step.fn._cache_size() != self._cache_sizes[name]:
            self._cache_sizes[name] = step.fn._cache_size()
            logger.warning("compiled a %s step for shapes %s while serving: warm-up missed it", name,
                           shape_key(inputs))
        return outputs

    def replay(self, name: str, inputs: Any) -> None:
        """Runs one call as `run` does and keeps only its new state (and the outputs later calls take): how a
        multi-host follower runs the leader's calls. An input the leader left out (None) is this host's latest
        output of that name, from the leader's earlier call."""
        step = self.steps[name]
        missing = {field: self._forwarded.get(field) for field in step.forwarded if getattr(inputs, field) is None}
        outputs = self.run(name, inputs.replace(**missing) if missing else inputs)
        self._forwarded.update({field: getattr(outputs, field) for field in step.forwards})

    def as_sent(self, name: str, inputs: Any) -> Any:
        """`inputs` as a multi-host leader sends them: device outputs of earlier calls stay behind (None), since
        followers hold their own."""
        on_device = {field: None for field in self.steps[name].forwarded
                     if isinstance(getattr(inputs, field), jax.Array)}
        return inputs.replace(**on_device) if on_device else inputs

    def sent_examples(self) -> Iterator[tuple[str, Any]]:
        """`(name, inputs)` for every shape of every step, as a leader sends them: what a follower may run."""
        for name, inputs in self.examples():
            yield name, self.as_sent(name, inputs)

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
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:  # compiling frees the GIL
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

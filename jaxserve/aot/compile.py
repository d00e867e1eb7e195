"""`compile_engine`: every step an engine would compile at start-up, compiled for a target that is not attached,
with the memory plan the engine would make there.

The engine's own code builds everything: `EngineConfig.resolve` for the target's platform (its attention backend
and dtype defaults), the model registry's shapes and the sharding table for the params (`ShapeDtypeStruct`s: no
weights are read, so a model directory holding only config.json is enough), a `ModelRunner` whose allocator makes
abstract arrays on the target's compile-only devices (`aot/abstract.py`), and that runner's step registry, whose
every example shape is lowered and compiled here, in turn, as warm-up would compile it. What comes back per step is
the compiler's verdict, its seconds on this machine, its memory per device and, on TPU, the compiler's roofline
estimate of its run time (`optimal_seconds`); a step that fails carries the compiler's message.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from jaxserve.aot.abstract import AbstractAllocator, abstract_weights, device_bytes
from jaxserve.aot.targets import Target, compiling_for, target
from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel, make_mesh
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_plan import KVPlan, check_plan
from jaxserve.engine.jax_transfer_connector import page_sharding, transfer_steps
from jaxserve.engine.kv_tiers import HostTier, KVTiers
from jaxserve.engine.kv_tier_copies import page_specs, transfer_buckets
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.engine.page_manager import page_key
from jaxserve.engine.step_registry import StepRegistry, compile_threads, shape_key
from jaxserve.loading import model_config, resolve_model
from jaxserve.loading.placement import serving_params
from jaxserve.loading.vision import load_vision
from jaxserve.multimodal.vision import is_image_model
from jaxserve.spec_decode import proposer_config

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepCompile:
    """One compiled shape of one step."""

    name: str
    shape: str  # its inputs' leading shapes, e.g. "rows=4 tokens=128"
    compiled: bool
    seconds: float  # compiling on this machine (lowering included)
    argument_bytes: int = 0  # per device, as the compiler plans them
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse donated arguments (the pools, the slot state)
    temp_bytes: int = 0
    peak_bytes: int = 0  # per device: everything the engine holds, plus this step's temporaries and new outputs
    estimated_seconds: float | None = None  # TPU: the compiler's roofline estimate of one run (not a measurement)
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """What the engine would hold on each device of `target`, before any step runs."""

    target: Target
    model_config: ModelConfig
    engine_config: EngineConfig  # resolved for the target
    num_devices: int  # the engine's (tensor_parallel_size), of the target's
    usable_bytes: int  # per device: gpu_memory_utilization of its memory
    weights_bytes: int  # per device
    resident_bytes: int  # per device: weights, KV pools, slot, penalty and LoRA state
    kv_cache_bytes: int  # per device
    kv_cache_tokens: int
    problem: str | None = None  # why the plan does not fit before any step is compiled
    kv_plan: KVPlan | None = None  # the KV cache groups and their pages (None: the weights alone do not fit)
    kv_transfer: dict[str, Any] | None = None  # --kv-transfer-config: the pages P/D moves (`transfer_layout`)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    plan: EnginePlan
    steps: list[StepCompile]
    wall_seconds: float = 0.0  # compiling them all, on `jobs` threads

    @property
    def peak_bytes(self) -> int:
        """The most any step needs per device (the resident state alone when no step compiled)."""
        return max([step.peak_bytes for step in self.steps if step.compiled] or [self.plan.resident_bytes])

    @property
    def failed(self) -> list[StepCompile]:
        return [step for step in self.steps if not step.compiled]

    @property
    def fits(self) -> bool:
        return self.plan.problem is None and self.peak_bytes <= self.plan.usable_bytes

    @property
    def ok(self) -> bool:
        return self.fits and not self.failed

    def verdict(self) -> str:
        """One line: all compiled and fit, or the first failure with the compiler's message, or what does not fit."""
        plan = self.plan
        if plan.problem is not None:
            return f"does not fit on {plan.target.name}: {plan.problem}"
        if self.failed:
            step = self.failed[0]
            more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
            return f"step {step.name} ({step.shape}) failed to compile for {plan.target.name}{more}: {step.error}"
        if not self.fits:
            worst = max(self.steps, key=lambda step: step.peak_bytes)
            return (f"does not fit on {plan.target.name}: step {worst.name} ({worst.shape}) needs {gib(worst.peak_bytes)} "
                    f"per device with the engine's state, over {gib(plan.usable_bytes)} "
                    f"(gpu_memory_utilization {plan.engine_config.gpu_memory_utilization:g}); its temporaries take "
                    f"{gib(worst.temp_bytes)}")
        return (f"all {len(self.steps)} step shapes compile for {plan.target.name} and fit "
                f"({gib(self.peak_bytes)} of {gib(plan.usable_bytes)} per device at the largest step)")


def plan_engine(config: EngineConfig, target_name: str) -> tuple[EnginePlan, ModelRunner | None]:
    """The runner `config` would build on `target_name` (with abstract arrays) and its memory plan. The runner is
    None when the weights alone leave no room (the plan says why). ValueError for a config the engine refuses."""
    t = target(target_name)
    config = config.localized("config")  # a hub id: its config.json (and image processor's) alone
    with compiling_for(target_name) as devices:
        model = model_config(resolve_model(config.model))
        config = config.resolve(model.max_position_embeddings, platform=t.platform)
        if config.tensor_parallel_size > len(devices):
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs {config.tensor_parallel_size} "
                             f"devices, but target {t.name} has {len(devices)}")
        proposer = proposer_config(config.speculative_config, model, config.max_model_len, config.model)
        mesh = make_mesh(config.tensor_parallel_size, list(devices))
        allocator = AbstractAllocator(t, config.gpu_memory_utilization)
        params = abstract_weights(model, config.jax_dtype, mesh, config.enable_expert_parallel)
        usable = int(t.chip.hbm_bytes * config.gpu_memory_utilization)
        tp = TensorParallel(mesh.size, config.enable_expert_parallel)  # as served: quantized, fused
        weights = device_bytes(serving_params(dict(params), model, tp, mesh, config.jax_dtype, config.quantization))
        base = dict(target=t, model_config=model, engine_config=config, num_devices=mesh.size, usable_bytes=usable,
                    weights_bytes=weights)
        if weights >= usable:
            return EnginePlan(**base, resident_bytes=weights, kv_cache_bytes=0, kv_cache_tokens=0, problem=(
                f"the weights need {gib(weights)} per device, more than {config.gpu_memory_utilization:g} of "
                f"{t.name}'s {gib(t.chip.hbm_bytes)}: use more devices (-tp), a smaller dtype or --quantization")), None
        vision = None
        if is_image_model(model.model_type):
            vision = load_vision(config.model, config.jax_dtype, mesh, "abstract", config.mm_processor_kwargs)
        runner = ModelRunner(model, params, config, set(model.eos_token_ids), mesh, proposer, allocator, vision)
        if config.kv_tiers:  # their copies between the pool and host memory are steps too (no disk is touched)
            runner.attach_tiers(KVTiers(HostTier(int((config.kv_offloading_size or 0) * 2**30)), None,
                                        config.page_size, page_key))
        transfer = None
        if config.kv_transfer is not None:  # prefill/decode disaggregation's gather and scatter (no server starts)
            runner.steps.add(transfer_steps(runner))
            transfer = transfer_layout(runner)
        kv_bytes = device_bytes(runner.kv_cache)
        problem = None
        try:
            check_plan(runner.kv_plan, config)
        except ValueError as error:
            problem = f"{error} ({gib(weights)} of weights leave too little of {gib(usable)})"
        return EnginePlan(**base, resident_bytes=device_bytes(runner.resident_state()), kv_cache_bytes=kv_bytes,
                          kv_cache_tokens=runner.kv_plan.capacity_tokens, problem=problem,
                          kv_plan=runner.kv_plan, kv_transfer=transfer), runner


def transfer_layout(runner: ModelRunner) -> dict[str, Any]:
    """What a P/D transfer moves per page (each leaf kind's dtype and `[2 * layers, heads, page_size(, head_dim)]`),
    its bytes over all devices, how the pages are split over them, and the page counts compiled."""
    specs = page_specs(runner.kv_cache)
    return {"pages": [[dtype, list(shape)] for dtype, shape in specs],
            "page_bytes": sum(math.prod(shape) * jnp.dtype(dtype).itemsize for dtype, shape in specs),
            "split": str(page_sharding(runner).spec), "buckets": list(transfer_buckets(runner.engine_config))}


def compile_steps(steps: StepRegistry, target_name: str, resident_bytes: int, names: set[str] | None = None,
                  jobs: int = 1) -> list[StepCompile]:
    """Every shape of every step in `steps` (or of those `names`), lowered and compiled for `target_name`: lowered
    in turn, compiled by `jobs` threads (as warm-up does: `compile_threads`, one for a TPU). Each step's seconds are
    its lowering and its compiling. Lowering stays in this thread: the default device Pallas' TPU lowering reads
    is this thread's."""
    with compiling_for(target_name), no_persistent_cache(), \
            concurrent.futures.ThreadPoolExecutor(compile_threads(jobs)) as pool:
        futures, seen = [], set()
        for name, inputs in steps.examples():
            key = (name, shape_key(inputs))
            if key in seen or (names is not None and name not in names):
                continue
            seen.add(key)
            step, started = steps[name], time.perf_counter()
            try:
                lowered = step.fn.lower(*step.state(), inputs)
            except Exception as err:  # a kernel's own checks (ValueError) or Mosaic's (while lowering)
                futures.append(failed(name, describe(inputs), started, err))
                continue
            futures.append(pool.submit(compile_lowered, name, describe(inputs), lowered,
                                       time.perf_counter() - started, resident_bytes))
        return [future.result() for future in futures]


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    """jax's persistent compilation cache off meanwhile (for every thread): an engine that ran in this process
    turns it on, and it cannot hold executables for devices that are not attached."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def failed(name: str, shape: str, started: float, err: Exception) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(StepCompile(name, shape, False, time.perf_counter() - started, error=compiler_message(err)))
    return future


def compile_lowered(name: str, shape: str, lowered: Any, lowering_seconds: float,
                    resident_bytes: int) -> StepCompile:
    """One lowered step shape compiled."""
    started = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:  # the compilers raise JaxRuntimeError, ValueError, NotImplementedError, ...
        return StepCompile(name, shape, False, lowering_seconds + time.perf_counter() - started,
                           error=compiler_message(err))
    seconds = lowering_seconds + time.perf_counter() - started
    logger.info("compiled %s %s in %.1fs", name, shape, seconds)
    return step_compile(name, shape, compiled, seconds, resident_bytes)


def compile_engine(config: EngineConfig, target_name: str, names: set[str] | None = None,
                   jobs: int = 1) -> CompileResult:
    """`config`'s engine planned for `target_name` and its steps (or those `names`) compiled there."""
    plan, runner = plan_engine(config, target_name)
    if runner is None:
        return CompileResult(plan, [])
    if names is not None and not names <= set(runner.steps.steps):
        raise ValueError(f"unknown steps {sorted(names - set(runner.steps.steps))}; this engine has "
                         f"{sorted(runner.steps.steps)}")
    started = time.perf_counter()
    steps = compile_steps(runner.steps, target_name, plan.resident_bytes, names, jobs)
    return CompileResult(plan, steps, time.perf_counter() - started)


def step_compile(name: str, shape: str, compiled: Any, seconds: float, resident_bytes: int) -> StepCompile:
    memory = compiled.memory_analysis()
    new_outputs = max(0, memory.output_size_in_bytes - memory.alias_size_in_bytes)
    return StepCompile(name, shape, True, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                       memory.alias_size_in_bytes, memory.temp_size_in_bytes,
                       resident_bytes + memory.temp_size_in_bytes + new_outputs, estimated_seconds(compiled))


# Custom calls the TPU compiler adds itself and its cost analysis leaves to XLA's HloCostAnalysis::HandleCustomCall,
# which marks them "unknown": -1 second (and -1 flop, -1 byte) each, summed into `optimal_seconds` with the rest.
# None costs anything: memory-space assignment joins the slices of a sliced prefetch into VMEM with a
# ConcatBitcast and makes scratch buffers with AllocateBuffer; a scatter offloaded to the SparseCore (the experts'
# scatter-add) is bracketed by PrepareAsyncCallStart/Done, which take no operands.
UNCOSTED_CUSTOM_CALLS = ("ConcatBitcast", "AllocateBuffer", "PrepareAsyncCallStart", "PrepareAsyncCallDone")


def estimated_seconds(compiled: Any) -> float | None:
    """The compiler's roofline estimate of one run (`optimal_seconds`) without its -1 per uncosted custom call, for
    a step under a second (every engine step of the models measured): the sentinels are the whole seconds below
    zero. None where there is no estimate, or more sentinels than such custom calls in the program. (Counting the
    calls in the program's text instead overcounts a loop's: the cost of a loop body is counted once.)"""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    estimate = (cost or {}).get("optimal_seconds")
    if estimate is None:
        return None
    if estimate < 0:
        sentinels = math.ceil(-estimate)
        text = compiled.as_text() or ""
        if sentinels > sum(text.count(f'custom_call_target="{kind}"') for kind in UNCOSTED_CUSTOM_CALLS):
            return None
        estimate += sentinels
    return float(estimate) if estimate > 0 else None


def describe(inputs: Any) -> str:
    """A step's example as its row count and (prefill) tokens per row: the shape a user chooses buckets by."""
    leaves = [leaf for leaf in jax.tree.leaves(inputs) if len(getattr(leaf, "shape", ())) >= 1]
    if not leaves:
        return "-"
    widest = max(leaves, key=lambda leaf: len(leaf.shape))
    if hasattr(inputs, "token_ids") and getattr(inputs.token_ids, "ndim", 0) == 2:
        return f"rows={inputs.token_ids.shape[0]} tokens={inputs.token_ids.shape[1]}"
    if getattr(getattr(inputs, "slots", None), "ndim", 0) == 1:  # a decode's or verify's (its pages lead with groups)
        return f"rows={inputs.slots.shape[0]}"
    return f"rows={widest.shape[0]}"


def compiler_message(err: Exception) -> str:
    """The compiler's own words, on one line: its message's first lines, without jax's traceback hints."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    message = " ".join(lines[:3]) if lines else type(err).__name__
    return f"{type(err).__name__}: {message}"[:600]


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"

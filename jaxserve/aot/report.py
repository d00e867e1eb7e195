"""What `jaxserve compile` prints and writes: the steps' table, the memory plan, and the JSON result (`result`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.aot.compile import CompileResult, gib
from jaxserve.engine.kv_plan import KVCacheGroup, KVPlan


def table(result: CompileResult) -> str:
    """The steps' table: one line per compiled shape."""
    lines = [f"{'step':<14} {'shape':<22} {'ok':<3} {'compile s':>9} {'args GiB':>9} {'temp GiB':>9} "
             f"{'out GiB':>8} {'est. ms':>8}"]
    for step in result.steps:
        estimate = f"{step.estimated_seconds * 1e3:8.3f}" if step.estimated_seconds is not None else f"{'-':>8}"
        lines.append(f"{step.name:<14} {step.shape:<22} {'yes' if step.compiled else 'NO':<3} {step.seconds:9.2f} "
                     f"{step.argument_bytes / 2**30:9.3f} {step.temp_bytes / 2**30:9.3f} "
                     f"{step.output_bytes / 2**30:8.3f} {estimate}")
        if step.error:
            lines.append(f"    {step.error}")
    return "\n".join(lines)


def memory_plan(result: CompileResult) -> str:
    plan, config = result.plan, result.plan.engine_config
    chip = plan.target.chip
    return "\n".join([
        f"target {plan.target.name}: {plan.num_devices} of its {plan.target.num_devices} {chip.kind} devices, "
        f"{gib(chip.hbm_bytes)} each; attention {config.attention_backend}, dtype {config.dtype}, "
        f"kv_cache_dtype {config.kv_cache_dtype}",
        f"per device: usable {gib(plan.usable_bytes)} (gpu_memory_utilization {config.gpu_memory_utilization:g}), "
        f"weights {gib(plan.weights_bytes)}, KV cache {gib(plan.kv_cache_bytes)} ({plan.kv_cache_tokens} tokens, "
        f"page size {config.page_size}), resident {gib(plan.resident_bytes)}, peak of the largest step "
        f"{gib(result.peak_bytes)}: {'fits' if result.fits else 'DOES NOT FIT'}",
        *kv_group_lines(plan.kv_plan),
        *([f"  KV transfer (P/D): per page {', '.join(f'{d}{s}' for d, s in plan.kv_transfer['pages'])} = "
           f"{plan.kv_transfer['page_bytes'] / 2**10:.1f} KiB over all devices, split {plan.kv_transfer['split']}; "
           f"page counts {plan.kv_transfer['buckets']}"] if plan.kv_transfer else []),
        f"compile seconds on this machine: {sum(step.seconds for step in result.steps):.1f} for "
        f"{len(result.steps)} shapes one at a time, {result.wall_seconds:.1f} from first to last on its threads",
    ])


def group_json(group: KVCacheGroup) -> dict[str, Any]:
    """One KV cache group of the plan: its kind (and window), layers, pages (scratch included) and tokens."""
    return {"kind": type(group.spec).__name__, "window": getattr(group.spec, "window", None),
            "layers": len(group.layers), "pages": group.num_pages, "tokens": group.capacity_tokens}


def kv_group_lines(kv_plan: KVPlan | None) -> list[str]:
    if kv_plan is None:
        return []
    lines = []
    for index, group in enumerate(kv_plan.groups if len(kv_plan.groups) > 1 or kv_plan.state else ()):
        entry = group_json(group)
        window = f" {entry['window']}" if entry["window"] else ""
        lines.append(f"  KV cache group {index}: {entry['kind']}{window}, {entry['layers']} layers, "
                     f"{entry['pages']} pages ({entry['tokens']} tokens)")
    if kv_plan.state is not None:  # in the KV cache figure above
        lines.append(f"  state slots: {kv_plan.state_slots} slots and {kv_plan.state_checkpoints} checkpoints of "
                     f"{kv_plan.state_slot_bytes / 2**20:.2f} MiB each over all devices ({gib(kv_plan.state_bytes)})")
    return lines


def result_json(result: CompileResult) -> dict[str, Any]:
    plan = result.plan
    return {
        "target": plan.target.name,
        "platform": plan.target.platform,
        "num_devices": plan.num_devices,
        "attention_backend": plan.engine_config.attention_backend,
        "dtype": plan.engine_config.dtype,
        "kv_cache_dtype": plan.engine_config.kv_cache_dtype,
        "max_num_seqs": plan.engine_config.max_num_seqs,
        "max_model_len": plan.engine_config.max_model_len,
        "max_num_batched_tokens": plan.engine_config.max_num_batched_tokens,
        "steps": [{key: value for key, value in dataclasses.asdict(step).items()
                   if value is not None or key == "error"} for step in result.steps],
        "compile_seconds": sum(step.seconds for step in result.steps),
        "compile_wall_seconds": result.wall_seconds,
        "hbm_bytes_per_device": plan.target.chip.hbm_bytes,
        "usable_bytes_per_device": plan.usable_bytes,
        "weights_bytes_per_device": plan.weights_bytes,
        "kv_cache_bytes_per_device": plan.kv_cache_bytes,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "kv_cache_groups": [group_json(group) for group in plan.kv_plan.groups] if plan.kv_plan else [],
        "state_slots": plan.kv_plan.state_slots if plan.kv_plan else 0,
        "state_checkpoints": plan.kv_plan.state_checkpoints if plan.kv_plan else 0,
        "state_bytes": plan.kv_plan.state_bytes if plan.kv_plan else 0,
        "kv_transfer": plan.kv_transfer,
        "peak_bytes_per_device": result.peak_bytes,
        "fits": result.fits,
        "ok": result.ok,
        "verdict": result.verdict(),
    }

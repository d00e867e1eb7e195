"""Benchmark of the paged-attention decode kernel against jax's bundled one and plain XLA.

Implementations timed per (batch, context) point, all on full-length sequences
with a scattered page table:
  pallas-ours   pallas_kernels' Triton decode kernel, or with --backend pallas-tpu (the default on a TPU)
                the Mosaic TPU ragged kernel of pallas_kernels.tpu on decode rows (interpret mode elsewhere
                only with --interpret; it is a correctness tool there, not a fast path)
  pallas-jax    jax.experimental.pallas.ops.gpu.paged_attention (GPU only, if importable)
  xla-ref       pallas_kernels.paged_attention_reference (gather + masked softmax)
For each it reports time per call, achieved bandwidth (bytes of K/V that must be
read / time) and that bandwidth as a fraction of the device's copy bandwidth,
measured here with a jitted copy.  Results go to a JSON file (rewritten after
every point, so a timeout still leaves what was measured) and a table at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import timing  # noqa: E402
from pallas_kernels import paged_attention_reference  # noqa: E402
from pallas_kernels.tpu import ragged as tpu_ragged  # noqa: E402
from pallas_kernels.triton import decode as triton_decode  # noqa: E402

PRESETS = {
    # name: (num_q_heads, num_kv_heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
    "mistral-7b": (32, 8, 128),
}
GRIDS = {
    # (on_gpu, quick): (batches, contexts)
    (True, False): ([1, 8, 32, 64, 128, 256], [512, 2048, 8192, 32768]),
    (True, True): ([1, 64], [512, 4096]),
    (False, False): ([1, 4], [128, 512]),
    (False, True): ([1], [128]),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    on_gpu = jax.default_backend() in ("gpu", "tpu")  # an accelerator: its grid and defaults
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small grid")
    p.add_argument("--batches", type=int, nargs="+", help="override the batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", help="override the context lengths")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   default="llama3-8b" if on_gpu else "smollm2-135m",
                   help="attention shape (q heads, kv heads, head_dim) of one layer")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   default="bfloat16" if on_gpu else "float32")
    p.add_argument("--kv-int8", action="store_true", help="int8 K/V pools with per-token scales")
    p.add_argument("--impls", nargs="+", choices=["pallas-ours", "pallas-jax", "xla-ref"],
                   default=["pallas-ours", "pallas-jax", "xla-ref"])
    p.add_argument("--backend", choices=["pallas", "pallas-tpu"],
                   default="pallas-tpu" if jax.default_backend() == "tpu" else "pallas",
                   help="the kernel pallas-ours times: Triton (GPU) or Mosaic TPU")
    p.add_argument("--interpret", action="store_true",
                   help="without the --backend's device, also time pallas-ours in interpret mode")
    p.add_argument("--num-warps", type=int, nargs="+", default=[4],
                   help="pallas-ours: one row per value")
    p.add_argument("--pages-per-compute-block", type=int, nargs="+", default=[0],
                   help="pallas-ours: one row per value (0 = the kernel's default)")
    p.add_argument("--num-splits", type=int, default=0,
                   help="pallas-ours split-K factor (0 = the kernel's default)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-pool-gib", type=float, default=48.0 if on_gpu else 1.0,
                   help="skip points whose K+V pool is larger")
    p.add_argument("--xla-max-gib", type=float, default=24.0 if on_gpu else 1.0,
                   help="skip xla-ref where its gathered float32 K/V copies are larger")
    p.add_argument("--copy-bytes", type=int, default=(1 << 30) if on_gpu else (1 << 28),
                   help="array size for the copy-bandwidth measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--out", type=Path, help="result file (default: <out-dir>/kernels-<backend>-<time>.json)")
    args = p.parse_args(argv)
    batches, contexts = GRIDS[(on_gpu, args.quick)]
    args.batches = args.batches or batches
    args.contexts = args.contexts or contexts
    return args


def make_inputs(batch: int, context: int, args: argparse.Namespace) -> dict[str, Any]:
    """Full-length sequences on a randomly permuted page table (fixed seed per point)."""
    num_q_heads, num_kv_heads, head_dim = PRESETS[args.preset]
    page_size = args.page_size
    pages_per_seq = math.ceil(context / page_size)
    num_pages = batch * pages_per_seq
    key = jax.random.PRNGKey(args.seed * 1_000_003 + batch * 131 + context)
    kq, kk, kv, ks, kp = jax.random.split(key, 5)
    dtype = jnp.dtype(args.dtype)
    # Random data for at most `distinct` pages, repeated to fill the pool: big
    # pools then cost no random-number temporaries larger than the pool itself.
    distinct = min(num_pages, 2048)
    pool_shape = (num_kv_heads, distinct, page_size, head_dim)
    fill = jnp.arange(num_pages) % distinct
    q = jax.random.normal(kq, (batch, num_q_heads, head_dim), dtype)
    inputs: dict[str, Any] = {}
    if args.kv_int8:
        inputs["k_pages"] = jax.random.randint(kk, pool_shape, -127, 128, jnp.int8)[:, fill]
        inputs["v_pages"] = jax.random.randint(kv, pool_shape, -127, 128, jnp.int8)[:, fill]
        k_scale_key, v_scale_key = jax.random.split(ks)
        inputs["k_scales"] = jax.random.uniform(
            k_scale_key, pool_shape[:3], jnp.float32, 0.002, 0.02)[:, fill]
        inputs["v_scales"] = jax.random.uniform(
            v_scale_key, pool_shape[:3], jnp.float32, 0.002, 0.02)[:, fill]
    else:
        inputs["k_pages"] = jax.random.normal(kk, pool_shape, dtype)[:, fill]
        inputs["v_pages"] = jax.random.normal(kv, pool_shape, dtype)[:, fill]
    perm = jax.random.permutation(kp, num_pages).astype(jnp.int32)
    inputs.update(
        q=q,
        lengths=jnp.full((batch,), context, jnp.int32),
        page_indices=perm.reshape(batch, pages_per_seq),
    )
    return inputs


def kv_bytes_read(batch: int, context: int, args: argparse.Namespace) -> int:
    """Bytes of K and V (and scales) a decode step must read at least once."""
    _, num_kv_heads, head_dim = PRESETS[args.preset]
    item = 1 if args.kv_int8 else jnp.dtype(args.dtype).itemsize
    per_token = 2 * num_kv_heads * (head_dim * item + (4 if args.kv_int8 else 0))
    return batch * context * per_token


def pool_bytes(batch: int, context: int, args: argparse.Namespace) -> int:
    return kv_bytes_read(batch, math.ceil(context / args.page_size) * args.page_size, args)


def xla_ref_bytes(batch: int, context: int, args: argparse.Namespace) -> int:
    _, num_kv_heads, head_dim = PRESETS[args.preset]
    return 2 * batch * context * num_kv_heads * head_dim * 4


def jax_bundled_paged_attention() -> Callable[..., Any] | None:
    """jax's own Pallas GPU paged attention, if this jax ships it and a GPU is present."""
    if jax.default_backend() != "gpu":
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as module
        return module.paged_attention
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def build_impls(args: argparse.Namespace, batch: int, context: int) -> list[tuple[str, Callable, str]]:
    """(name, jitted fn taking the input dict, skip reason or '') for one point.

    xla-ref comes first: it is the baseline the others' outputs are compared with.
    """
    on_gpu = jax.default_backend() == "gpu"
    impls: list[tuple[str, Callable, str]] = []
    if "xla-ref" in args.impls:
        too_big = xla_ref_bytes(batch, context, args) > args.xla_max_gib * 2**30
        reason = f"gathered copies > --xla-max-gib {args.xla_max_gib}" if too_big else ""
        ref = jax.jit(paged_attention_reference)
        impls.append(("xla-ref", lambda x, ref=ref: ref(**x), reason))
    if "pallas-ours" in args.impls and args.backend == "pallas-tpu":
        on_tpu = jax.default_backend() == "tpu"
        reason = "" if (on_tpu or args.interpret) else "no TPU (pass --interpret to time interpret mode)"
        interpret = None if on_tpu else pltpu.InterpretParams()
        for ppcb in args.pages_per_compute_block:
            name = "pallas-ours" + (f"[p{ppcb or 'auto'}]" if len(args.pages_per_compute_block) > 1 else "")

            @jax.jit
            def tpu_decode(x, ppcb=ppcb):  # decode rows: one query token each, all of the context
                scales = {key: x[key] for key in ("k_scales", "v_scales") if key in x}
                out = tpu_ragged.ragged_paged_attention(
                    x["q"][:, None], x["k_pages"], x["v_pages"], x["lengths"], jnp.ones_like(x["lengths"]),
                    x["page_indices"], pages_per_block=ppcb or None, interpret=interpret, **scales)
                return out[:, 0]
            impls.append((name, tpu_decode, reason))
    elif "pallas-ours" in args.impls:
        interpret = not on_gpu
        reason = "" if (on_gpu or args.interpret) else "no GPU (pass --interpret to time interpret mode)"
        for warps in args.num_warps:
            for ppcb in args.pages_per_compute_block:
                name = "pallas-ours"
                if len(args.num_warps) > 1 or len(args.pages_per_compute_block) > 1:
                    name += f"[w{warps},p{ppcb or 'auto'}]"
                fn = jax.jit(functools.partial(
                    triton_decode.paged_attention,
                    pages_per_compute_block=ppcb or None,
                    num_splits=args.num_splits or None,
                    num_warps=warps,
                    interpret=interpret,
                ))
                impls.append((name, lambda x, fn=fn: fn(**x), reason))
    if "pallas-jax" in args.impls:
        bundled = jax_bundled_paged_attention()
        reason = "" if bundled is not None else "needs a GPU and jax.experimental.pallas.ops.gpu"
        pages_per_seq = math.ceil(context / args.page_size)
        k_splits = max(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
        fn = None
        if bundled is not None:
            fn = jax.jit(functools.partial(bundled, k_splits=k_splits))

        def call_bundled(x: dict[str, Any], fn=fn) -> Any:
            return fn(x["q"], x["k_pages"], x["v_pages"], x["page_indices"], x["lengths"],
                      x.get("k_scales"), x.get("v_scales"))

        impls.append(("pallas-jax", call_bundled, reason))
    return impls


def run(args: argparse.Namespace) -> dict[str, Any]:
    backend = jax.default_backend()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or args.out_dir / f"kernels-{backend}-{stamp}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)

    print(f"measuring copy bandwidth ({args.copy_bytes / 2**20:.0f} MiB array) ...", flush=True)
    copy_bw = timing.measure_copy_bandwidth(args.copy_bytes)
    print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write)", flush=True)
    report: dict[str, Any] = {
        "meta": {
            **timing.device_summary(),
            "time": stamp,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "shape": dict(zip(("num_q_heads", "num_kv_heads", "head_dim"), PRESETS[args.preset])),
        },
        "rows": [],
    }

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=1))

    for batch in args.batches:
        for context in args.contexts:
            base = dict(batch=batch, context=context, kv_bytes=kv_bytes_read(batch, context, args))
            if pool_bytes(batch, context, args) > args.max_pool_gib * 2**30:
                report["rows"].append({**base, "impl": "*", "skipped": "pool > --max-pool-gib"})
                save()
                continue
            inputs = make_inputs(batch, context, args)
            baseline: tuple[str, np.ndarray] | None = None
            for name, fn, skip in build_impls(args, batch, context):
                row: dict[str, Any] = {**base, "impl": name}
                if skip:
                    row["skipped"] = skip
                else:
                    try:
                        t = timing.time_fn(fn, inputs, warmup=args.warmup, repeats=args.repeats)
                        out = np.asarray(fn(inputs), np.float32)
                        if baseline is None:
                            baseline = (name, out)
                        row.update(
                            t.as_dict(),
                            bandwidth_bytes_per_s=base["kv_bytes"] / t.median_s,
                            fraction_of_copy_bw=base["kv_bytes"] / t.median_s / copy_bw,
                            baseline=baseline[0],
                            max_abs_diff_vs_baseline=float(np.max(np.abs(out - baseline[1]))),
                        )
                    except Exception as exc:  # noqa: BLE001 - record and go on
                        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                        traceback.print_exc(limit=2)
                report["rows"].append(row)
                save()
                print(format_row(row), flush=True)
            del inputs
    save()
    print(f"\nresults: {out_path}")
    print_table(report)
    return report


def format_row(row: dict[str, Any]) -> str:
    head = f"{row['batch']:>6} {row['context']:>7} {row['impl']:<22}"
    if "median_s" in row:
        return (f"{head} {row['median_s'] * 1e3:>10.3f} {row['bandwidth_bytes_per_s'] / 1e9:>9.1f}"
                f" {100 * row['fraction_of_copy_bw']:>7.1f}% {row['max_abs_diff_vs_baseline']:>9.2e}")
    return f"{head} {row.get('skipped') or row.get('error', '')}"


def print_table(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(f"\n{meta['device_kind']} ({meta['backend']}), jax {meta['jax']}, shape {meta['shape']}, "
          f"copy bandwidth {meta['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"{'batch':>6} {'context':>7} {'impl':<22} {'ms/call':>10} {'GB/s':>9} {'of copy':>8}"
          f" {'max|diff|':>9}  (diff vs the first impl that ran at that point)")
    for row in report["rows"]:
        print(format_row(row))


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile-only checks of the Pallas kernels for real accelerators, on the CPU: each kernel is lowered and compiled
by libtpu's compiler and Mosaic for TPU v5e and v6e, or by XLA's CUDA compiler, Triton and Mosaic GPU for an H200
(`jaxserve.aot.targets.compiling_for`; no chip needed). Nothing runs: the interpret-mode tests
(tests/test_tpu_kernels.py, tests/test_kernels.py, tests/test_mosaic_gpu_kernels.py) check the values. These
catch what the interpreters accept and the compilers refuse (DMA alignment, layouts, VMEM and shared memory), and
read the TPU compiler's cost model of a step holding a kernel. Skipped where the `[aot]` compilers are missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # else libtpu admits one process at a time (xdist workers)

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels
from jaxserve.aot.targets import CompilerMissing, compiling_for, target, target_devices
from pallas_kernels.mosaic_gpu import paged_attention as mosaic_gpu_decode
from pallas_kernels.tpu import ragged_paged_attention, write_to_pages

TPU_TARGETS = ("v5e-1", "v6e-1")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def compile_for(name: str, fn, *args, donate: tuple[int, ...] = (), row_major: bool = False, **kwargs):
    """`fn` lowered and compiled for target `name` at these shapes (ShapeDtypeStructs, or pytrees of them); with
    `row_major`, every argument and result in the row-major layout the kernels read."""
    try:
        target_devices(name)
    except CompilerMissing as err:
        pytest.skip(str(err))
    with compiling_for(name) as devices:
        sharding = NamedSharding(Mesh(np.array(devices[:1]), ("model",)), P())
        static = {key: value for key, value in kwargs.items() if not hasattr(value, "shape")}
        arrays = {key: value for key, value in kwargs.items() if hasattr(value, "shape")}
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), (*args, arrays))

        def call(*a):
            return fn(*a[:-1], **a[-1], **static)

        layouts = {}
        if row_major:
            def formats(tree):
                return jax.tree.map(lambda a: Format(Layout(major_to_minor=tuple(range(a.ndim))), sharding), tree)
            layouts = dict(in_shardings=formats(args), out_shardings=formats(jax.eval_shape(call, *args)))
        return jax.jit(call, donate_argnums=donate, **layouts).lower(*args).compile()


def spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), DTYPES.get(dtype, dtype))


def write_args(dtype: str, page_size: int, head_dim: int, tokens: int, kv_heads: int = 2, pages: int = 64):
    """(pools, new, slots) shapes of one K/V write: two pools, or two (values, scales) pairs when 8-bit."""
    values, new = spec((kv_heads, pages, page_size, head_dim), dtype), spec((kv_heads, tokens, head_dim), dtype)
    if jnp.dtype(DTYPES[dtype]).itemsize == 1:
        pools = (values, spec((kv_heads, pages, page_size), jnp.float32)) * 2
        news = (new, spec((kv_heads, tokens), jnp.float32)) * 2
    else:
        pools, news = (values,) * 2, (new,) * 2
    return pools, news, spec((tokens,), jnp.int32)


WRITE_CASES = [  # id, value dtype, page_size, head_dim, tokens (1: a lone decode token; many: a prefill chunk)
    ("f32-p16-d128-decode", "float32", 16, 128, 1),
    ("bf16-p16-d128-decode", "bfloat16", 16, 128, 8),
    ("bf16-p64-d64-prefill", "bfloat16", 64, 64, 512),
    ("int8-p16-d128-decode", "int8", 16, 128, 8),
    ("int8-p128-d256-prefill", "int8", 128, 256, 256),
    ("fp8-p32-d64-prefill", "fp8", 32, 64, 64),
]


@pytest.mark.parametrize("name", TPU_TARGETS)
@pytest.mark.parametrize("dtype,page_size,head_dim,tokens", [c[1:] for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES])
def test_write_to_pages_compiles_for_tpu(name, dtype, page_size, head_dim, tokens):
    """Fails with 'Offsets along tiled dimensions must be aligned to tiles' on a one-row DMA of 16- or 8-bit
    pools; the pools stay aliased to the outputs."""
    compiled = compile_for(name, write_to_pages, *write_args(dtype, page_size, head_dim, tokens), donate=(0,))
    assert "input_output_alias" in compiled.as_text().split("\n")[0]


RAGGED_CASES = [
    # id, q dtype, pages (None: q's), group, head_dim, page_size, rows, T, window, soft-cap, sinks, pages/block, q tokens
    ("f32-gqa1-d128-p16-decode", "float32", None, 1, 128, 16, 8, 1, None, None, False, None, None),
    ("bf16-gqa8-d64-p32-decode-window", "bfloat16", None, 8, 64, 32, 8, 1, 40, None, False, None, None),
    ("bf16-int8-gqa4-d128-p16-decode", "bfloat16", "int8", 4, 128, 16, 4, 1, None, None, False, None, None),
    ("bf16-fp8-gqa2-d256-p64-chunk16-cap-sinks", "bfloat16", "fp8", 2, 256, 64, 2, 16, None, 30.0, True, None, None),
    ("f32-int8-gqa1-d64-p128-prefill512", "float32", "int8", 1, 64, 128, 1, 512, None, None, False, None, None),
    ("bf16-gqa4-d128-p16-prefill256-window-blocks", "bfloat16", None, 4, 128, 16, 2, 256, 100, None, False, 4, 32),
    ("bf16-int8-gqa8-d128-p32-prefill128-sinks", "bfloat16", "int8", 8, 128, 32, 1, 128, None, None, True, None, None),
    ("bf16-gqa2-d256-p128-prefill512-cap", "bfloat16", None, 2, 256, 128, 1, 512, None, 50.0, False, None, None),
    ("f32-fp8-gqa3-d128-p16-chunk16", "float32", "fp8", 3, 128, 16, 2, 16, None, None, False, 2, 8),
    ("bf16-fp8-gqa1-d64-p64-chunk32-window-cap", "bfloat16", "fp8", 1, 64, 64, 2, 32, 48, 20.0, False, 1, None),
    ("bf16-gqa4-d512-p16-chunk16", "bfloat16", None, 4, 512, 16, 2, 16, None, None, False, None, None),
]


def ragged_call(dtype, pages_dtype, group, head_dim, page_size, rows, tokens, window, soft_cap, sinks,
                pages_per_block, query_tokens, kv_heads=2, num_pages=64, width=8, limits=False):
    """(function, argument shapes) of one ragged attention call; with `limits`, `query_limits` (Gemma 3's images)."""
    kv = spec((kv_heads, num_pages, page_size, head_dim), pages_dtype or dtype)
    args = [spec((rows, tokens, kv_heads * group, head_dim), dtype), kv, kv, spec((rows,), jnp.int32),
            spec((rows,), jnp.int32), spec((rows, width), jnp.int32)]
    if pages_dtype is not None:
        args += [spec((kv_heads, num_pages, page_size), jnp.float32)] * 2
    if sinks:
        args.append(spec((kv_heads * group,), jnp.float32))
    if limits:
        args.append(spec((rows, tokens), jnp.int32))

    def call(q, k, v, contexts, query_lens, tables, *rest):
        rest = list(rest)
        scales = dict(k_scales=rest.pop(0), v_scales=rest.pop(0)) if pages_dtype is not None else {}
        return ragged_paged_attention(q, k, v, contexts, query_lens, tables, sliding_window=window,
                                      soft_cap=soft_cap, sinks=rest.pop(0) if sinks else None,
                                      query_limits=rest.pop(0) if limits else None,
                                      pages_per_block=pages_per_block, query_tokens=query_tokens, **scales)
    return call, args


@pytest.mark.parametrize("name", TPU_TARGETS)
@pytest.mark.parametrize("case", [c[1:] for c in RAGGED_CASES], ids=[c[0] for c in RAGGED_CASES])
def test_ragged_paged_attention_compiles_for_tpu(name, case):
    """Fails with 'Source and target leading tiles have different trailing dimensions' when int8/fp8 pages' scales
    are copied into a lane slice of a VMEM buffer."""
    call, args = ragged_call(*case)
    compile_for(name, call, *args)


LIMIT_CASES = [c for c in RAGGED_CASES if c[0] in ("bf16-fp8-gqa2-d256-p64-chunk16-cap-sinks",
                                                    "bf16-gqa4-d128-p16-prefill256-window-blocks",
                                                    "f32-int8-gqa1-d64-p128-prefill512", "bf16-gqa4-d512-p16-chunk16")]


@pytest.mark.parametrize("name", TPU_TARGETS)
@pytest.mark.parametrize("case", [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES])
def test_ragged_paged_attention_with_query_limits_compiles_for_tpu(name, case):
    """Gemma 3's image chunks (`query_limits`): each cell's limits a VMEM block, its query block's largest
    scalar-prefetched."""
    call, args = ragged_call(*case, limits=True)
    compile_for(name, call, *args)


@pytest.mark.parametrize("name", TPU_TARGETS)
def test_ragged_paged_attention_compiles_with_a_table_over_smem(name):
    """512 decode rows of 1024 pages: 2 MiB of page table, which, scalar-prefetched whole, overflowed SMEM (1 MiB:
    'would exceed memory ... space=smem')."""
    call, args = ragged_call("bfloat16", None, 4, 128, 16, 512, 1, None, None, False, None, None, width=1024)
    compile_for(name, call, *args)


def test_tpu_kernels_copy_no_pool_in_row_major_layout():
    """With the pools in the row-major layout Mosaic reads (XLA's default TPU layout is not row-major for pools of
    head_dim < 128 or scales of page_size < 128, and then each call copies whole pools around the kernels), a step
    that writes int8 K/V and attends holds no copy of a pool."""
    pools, new, slots = write_args("int8", 16, 64, 32, kv_heads=8, pages=8192)
    call, args = ragged_call("bfloat16", "int8", 4, 64, 16, 8, 1, None, None, False, None, None, kv_heads=8,
                             num_pages=8192)

    def step(pools, new, slots, q, contexts, query_lens, tables):
        pools = write_to_pages(pools, new, slots)
        return pools, call(q, pools[0], pools[2], contexts, query_lens, tables, pools[1], pools[3])

    compiled = compile_for("v6e-1", step, pools, new, slots, args[0], *args[3:6], donate=(0,), row_major=True)
    pool_shapes = {f"{jnp.dtype(p.dtype).name.replace('int8', 's8').replace('float32', 'f32')}"
                   f"[{','.join(map(str, p.shape))}]" for p in pools}
    copies = [line for line in compiled.as_text().split("\n") if re.search(r"= \S+ copy(-start)?\(", line)]
    assert not [line for line in copies if any(shape in line.split("=")[1] for shape in pool_shapes)], copies


def test_tpu_cost_model_counts_the_kernels():
    """The TPU compiler's `optimal_seconds` of a decode step (write one token per row, attend over 4096-token
    tables) is about the time to read the K/V pages at HBM bandwidth: the kernels' cost estimates reach it."""
    rows, kv_heads, group, head_dim, page_size, width = 64, 8, 4, 128, 16, 256
    pools, new, slots = write_args("bfloat16", page_size, head_dim, rows, kv_heads=kv_heads, pages=4096)
    call, args = ragged_call("bfloat16", None, group, head_dim, page_size, rows, 1, None, None, False, None, None,
                             kv_heads=kv_heads, num_pages=4096, width=width)

    def step(pools, new, slots, q, contexts, query_lens, tables):
        pools = write_to_pages(pools, new, slots)
        return pools, call(q, pools[0], pools[1], contexts, query_lens, tables)

    compiled = compile_for("v6e-1", step, pools, new, slots, args[0], *args[3:6], donate=(0,))
    pages_read = rows * width * page_size * kv_heads * head_dim * 2 * 2  # K and V, bf16, every table entry
    roofline = pages_read / target("v6e-1").chip.hbm_bandwidth
    assert 0.9 * roofline < compiled.cost_analysis()["optimal_seconds"] < 1.5 * roofline


def test_tpu_kernel_over_vmem_fails_with_the_compilers_message():
    """64 pages of 128 float32 keys at head_dim 256, double-buffered for K and V, are 32 MiB of VMEM blocks."""
    call, args = ragged_call("float32", None, 1, 256, 128, 1, 8, None, None, False, 64, None, num_pages=512,
                             width=256)
    with pytest.raises(Exception, match="Ran out of memory in memory space vmem"):
        compile_for("v6e-1", call, *args)


GPU_CASES = [  # id, q dtype, pages (None: q's), group, head_dim, page_size, window, soft-cap, sinks
    ("f32-gqa1-d64-p16", "float32", None, 1, 64, 16, None, None, False),
    ("f32-gqa2-d256-p16", "float32", None, 2, 256, 16, None, None, False),
    ("bf16-gqa8-d128-p32-window-cap-sinks", "bfloat16", None, 8, 128, 32, 64, 30.0, True),
    ("bf16-int8-gqa4-d128-p16-window", "bfloat16", "int8", 4, 128, 16, 40, None, False),
    ("bf16-fp8-gqa1-d256-p128-cap", "bfloat16", "fp8", 1, 256, 128, None, 50.0, False),
    ("bf16-gqa3-d64-p64-sinks", "bfloat16", None, 3, 64, 64, None, None, True),
    ("bf16-gqa4-d512-p16", "bfloat16", None, 4, 512, 16, None, None, False),  # Gemma 4: 404 KiB before tiling
]


def gpu_args(dtype, pages_dtype, group, head_dim, page_size, *, tokens, rows=4, kv_heads=2, num_pages=64, width=8):
    kv = spec((kv_heads, num_pages, page_size, head_dim), pages_dtype or dtype)
    scales = {}
    if pages_dtype is not None:
        scales = dict(k_scales=spec((kv_heads, num_pages, page_size), jnp.float32),
                      v_scales=spec((kv_heads, num_pages, page_size), jnp.float32))
    return spec((tokens, kv_heads * group, head_dim), dtype), kv, spec((rows, width), jnp.int32), scales


@pytest.mark.parametrize("kernel", ["decode", "ragged", "ragged-limits"])
@pytest.mark.parametrize("case", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_triton_kernels_compile_for_h200(kernel, case):
    """`pallas_kernels.paged_attention` / `ragged_paged_attention` (Triton; "ragged-limits" with `query_limits`,
    Gemma 3's images); float32 at head_dim 256 overflowed shared memory with 64-token tiles."""
    dtype, pages_dtype, group, head_dim, page_size, window, soft_cap, sinks = case
    rows = 4
    q, kv, table, scales = gpu_args(dtype, pages_dtype, group, head_dim, page_size, tokens=rows if kernel == "decode"
                                    else 64, rows=rows)
    options = dict(sliding_window=window, soft_cap=soft_cap, **scales)
    if sinks:
        options["sinks"] = spec((q.shape[1],), jnp.float32)
    if kernel == "ragged-limits":
        options["query_limits"] = spec((q.shape[0],), jnp.int32)
    if kernel == "decode":
        compile_for("h200", pallas_kernels.paged_attention, q, kv, kv, spec((rows,), jnp.int32), table, **options)
    else:
        compile_for("h200", pallas_kernels.ragged_paged_attention, q, kv, kv, spec((rows,), jnp.int32), table,
                    spec((rows + 1,), jnp.int32), spec((1,), jnp.int32), **options)


@pytest.mark.parametrize("pages_dtype,group,head_dim,page_size,window", [
    (None, 8, 128, 16, None), ("int8", 1, 64, 64, 100), ("fp8", 4, 128, 128, None)], ids=["bf16", "int8", "fp8"])
def test_mosaic_gpu_decode_compiles_for_h200(pages_dtype, group, head_dim, page_size, window):
    q, kv, table, scales = gpu_args("bfloat16", pages_dtype, group, head_dim, page_size, tokens=4)
    compile_for("h200", mosaic_gpu_decode, q, kv, kv, spec((4,), jnp.int32), table, sliding_window=window, **scales)


def test_gpu_kernel_over_shared_memory_fails_with_the_compilers_message():
    """A 64-token float32 KV tile at head_dim 256, asked for explicitly, needs more shared memory than an H200 has."""
    q, kv, table, _ = gpu_args("float32", None, 1, 256, 16, tokens=4)
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compile_for("h200", pallas_kernels.paged_attention, q, kv, kv, spec((4,), jnp.int32), table,
                    pages_per_compute_block=4)


MOE_SHAPES = {"qwen3-30b-a3b-prefill": (16384, 128, 2048, 1536), "qwen3-30b-a3b-decode": (64, 128, 2048, 1536),
              "gpt-oss-down-decode": (32, 32, 2880, 2880)}  # rows (tokens x top_k), experts, K, N


@pytest.mark.parametrize("kernel_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("shape", MOE_SHAPES.values(), ids=MOE_SHAPES.keys())
def test_grouped_matmul_compiles_for_h200_without_dense_temporaries(shape, kernel_dtype):
    """XLA's GPU `ragged_dot` is dense: 8 GiB of temporaries at Qwen3-30B-A3B's prefill shape (`[R, G*K]` masked
    copies of x and the kernel reshaped to `[G*K, N]`). The Triton kernel keeps only the schedule."""
    rows, groups, fan_in, fan_out = shape
    compiled = compile_for("h200", pallas_kernels.ops.grouped_matmul, spec((rows, fan_in), "bfloat16"),
                           spec((groups, fan_in, fan_out), kernel_dtype), spec((groups,), jnp.int32))
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20


def test_moe_grouped_matmul_for_h200_is_the_triton_kernel():
    """`jaxserve.layers.moe.grouped_matmul` traced for a GPU target takes the kernel, not `ragged_dot`."""
    from jaxserve.layers.moe import grouped_matmul

    compiled = compile_for("h200", grouped_matmul, spec((4096, 2048), "bfloat16"), spec((128, 2048, 768), "int8"),
                           spec((128,), jnp.int32))
    assert "jaxserve_grouped_matmul" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20

#!/usr/bin/env bash
# GPU check of jaxserve, prepared for a session that has an NVIDIA GPU (H200).
#
# Installs nothing from the network.  Assumes python3 with jax (CUDA) already
# installed; extra wheels, if a .whl/ folder exists at the repo root, are
# installed offline into /tmp/site.  Steps, most important first, each under
# `timeout` and all inside a ~8 minute budget (BUDGET_S; a step that would start
# with too little time left is skipped, and the 8B stage skips its own later parts):
#   1. environment: GPU, jax version and devices
#   2. smoke: both kernels compiled (not interpreted) vs the XLA reference (no pytest needed)
#   3. the 8B stand-in (`gpu_8b.py`): Llama-3.1-8B's shapes with random weights drawn on the device
#      (load_format="dummy", a config.json alone travels) served through `LLM` in bfloat16 with the Pallas
#      backend: decode step at batch 1/8/64/256 against the roofline, offline throughput at 64 and 256 requests
#      in flight (128-token prompts, 128 output tokens), single-stream tok/s, TTFT of a 2,048-token prompt, and
#      int8 weights and fp8 KV pages against bf16
#   3b. the MoE stand-in: Qwen3-30B-A3B's shapes the same way (decode step at batch 1/8/64, offline at 64)
#   3c. LoRA on the 8B stand-in: 64 requests through the base engine, a LoRA engine's base rows, and 4 rank-16
#      adapters mixed (`lora.py`)
#   3d. EAGLE-3 on the 8B stand-in with a random head: decode, proposal, verify and keep steps at batch 1/8/64,
#      and the tokens per verify step a head must reach to pay (`eagle3_speed.py`; speed, not acceptance)
#   4. host overhead: a tiny model's offline run with the host's time per step phase and the device's busy
#      fraction (`host_overhead.py`), then with detokenization inline and in a second process
#   5. the default model's shapes (135M, a random-weight HF checkpoint built with torch): decode step against
#      the roofline (`roofline.py`)
#   6. pytest tests/test_kernels.py and tests/test_mosaic_gpu_kernels.py with JAXSERVE_KERNEL_INTERPRET=0
#      (compiled Triton and Mosaic GPU kernels)
#   7. benchmarks/kernel_bench.py: default grid (bf16), then a quick int8 grid
#   8. the KV host tier: multi-turn later-turn TTFT with and without it (`multi_turn.py`), the default model's shapes
# Everything goes to $OUT (or benchmarks/results/ when OUT is unset):
# gpu_check.log, summary.txt (with the 8B and MoE tables), gpu-8b.json, gpu-8b.txt, gpu-moe.json, gpu-moe.txt,
# lora-gpu.json, eagle3-gpu.json,
# host-overhead-gpu.json,
# host-overhead-detok-*.json,
# roofline-gpu.json, test_kernels.xml, kernels-*.json, multi-turn-gpu.json.
#
# Usage: bash benchmarks/gpu_check.sh        (env: OUT, PY, BUDGET_S)
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO="$PWD"
OUT_DIR="${OUT:-$REPO/benchmarks/results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
SUMMARY="$OUT_DIR/summary.txt"
PY="${PY:-python3}"
BUDGET_S="${BUDGET_S:-500}"   # whole script, seconds
: >"$SUMMARY"
exec > >(tee -a "$LOG") 2>&1

if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing local wheels from .whl/ into /tmp/site (offline)"
    "$PY" -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl \
        || echo "wheel install failed; continuing with what is installed"
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$REPO:${PYTHONPATH:-}"
export JAXSERVE_KERNEL_INTERPRET=0

remaining() { echo $((BUDGET_S - SECONDS)); }

# step NAME LIMIT_S CMD... : runs CMD under timeout min(LIMIT_S, time left - 10 s)
step() {
    local name="$1" limit="$2"
    shift 2
    local left
    left=$(($(remaining) - 10))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped (budget spent)"
        echo "$name: skipped (budget spent)" >>"$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "== $name (timeout ${limit}s, t=${SECONDS}s)"
    local start=$SECONDS rc
    timeout -k 10 "$limit" "$@"
    rc=$?
    local status="ok"
    [ "$rc" -ne 0 ] && status="FAILED rc=$rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMED OUT after ${limit}s"
    echo "$name: $status ($((SECONDS - start))s)" | tee -a "$SUMMARY"
    return 0
}

step "environment" 60 bash -c "nvidia-smi -L || true; \"$PY\" -c 'import jax, jaxlib; print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__); print(jax.devices())'"

step "smoke (compiled kernels vs XLA reference)" 90 "$PY" - <<'PYEOF'
import sys
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk

assert jax.default_backend() == "gpu", f"no GPU backend: {jax.default_backend()}"
rng = np.random.default_rng(0)
failures = 0

def check(name, out, ref, tol):
    global failures
    out = np.asarray(out, np.float32); ref = np.asarray(ref, np.float32)
    err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))
    ok = np.isfinite(out).all() and err < tol
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: rel err {err:.2e}")

for dtype, tol in ((jnp.float32, 1e-3), (jnp.bfloat16, 2e-2)):
    for group, kvh, d, ps in ((1, 4, 64, 16), (4, 8, 128, 16), (8, 1, 128, 32), (3, 2, 64, 8)):
        pages_per_seq, batch = 9, 5
        num_pages = batch * pages_per_seq
        k = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dtype)
        v = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dtype)
        q = jnp.asarray(rng.standard_normal((batch, group * kvh, d)), dtype)
        table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
        lens = jnp.asarray([0, 1, ps + 1, pages_per_seq * ps, 3 * ps], jnp.int32)
        for window in (None, 2 * ps + 1):
            out = pk.paged_attention(q, k, v, lens, table, sliding_window=window, num_splits=3)
            ref = pk.paged_attention_reference(q, k, v, lens, table, sliding_window=window)
            check(f"decode {jnp.dtype(dtype).name} g{group} kvh{kvh} d{d} p{ps} w{window}", out, ref, tol)
        cu = jnp.asarray([0, 1, 1 + ps + 1, 1 + ps + 1 + 7, 1 + ps + 1 + 7, 1 + ps + 1 + 7], jnp.int32)
        kv_lens = jnp.asarray([5, ps + 1, 3 * ps, 0, 0], jnp.int32)
        rq = jnp.asarray(rng.standard_normal((int(cu[-1]) + 2, group * kvh, d)), dtype)
        out = pk.ragged_paged_attention(rq, k, v, kv_lens, table, cu, jnp.asarray([3], jnp.int32))
        ref = pk.ragged_paged_attention_reference(rq, k, v, kv_lens, table, cu, jnp.asarray([3], jnp.int32))
        check(f"ragged {jnp.dtype(dtype).name} g{group} kvh{kvh} d{d} p{ps}", out, ref, tol)
# the experts' grouped matmul (Triton), at a decode and a prefill shape of Qwen3-30B-A3B, 5 rows past the groups
for dtype, tol in ((jnp.float32, 1e-3), (jnp.bfloat16, 2e-2)):
    for rows, groups, fan_in, fan_out in ((64, 128, 2048, 1536), (2048, 128, 768, 2048)):
        sizes = rng.multinomial(rows - 5, np.ones(groups) / groups).astype(np.int32)
        x = np.asarray(jnp.asarray(rng.standard_normal((rows, fan_in)), dtype), np.float32)
        w = np.asarray(jnp.asarray(rng.standard_normal((groups, fan_in, fan_out)) / fan_in ** 0.5, dtype), np.float32)
        ref, ends = np.zeros((rows, fan_out), np.float32), np.cumsum(sizes)
        for g in range(groups):
            ref[ends[g] - sizes[g]:ends[g]] = x[ends[g] - sizes[g]:ends[g]] @ w[g]
        out = pk.grouped_matmul(jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes))
        check(f"grouped matmul {jnp.dtype(dtype).name} rows{rows} e{groups} {fan_in}x{fan_out}", out, ref, tol)
sys.exit(1 if failures else 0)
PYEOF

# the 8B stand-in: its own later parts (TTFT, the int8 / fp8 engines) are skipped past --time-limit-s
limit=$(($(remaining) - 10)); [ "$limit" -gt 270 ] && limit=270
step "8B stand-in: llama-3.1-8b shapes, random weights, bf16 (gpu_8b.py)" 270 \
    "$PY" benchmarks/gpu_8b.py --result-file "$OUT_DIR/gpu-8b.json" --time-limit-s $((limit - 20))
[ -f "$OUT_DIR/gpu-8b.txt" ] && cat "$OUT_DIR/gpu-8b.txt" >>"$SUMMARY"

# the mixture of experts: Qwen3-30B-A3B's shapes (128 experts, 8 per token; 61 GB in bf16), decode step and one
# offline level; no variants
limit=$(($(remaining) - 10)); [ "$limit" -gt 110 ] && limit=110
step "MoE stand-in: qwen3-30b-a3b shapes, random weights, bf16 (gpu_8b.py --shape qwen3-30b-a3b)" 110 \
    "$PY" benchmarks/gpu_8b.py --shape qwen3-30b-a3b --batch-sizes 1 8 64 --concurrency 64 --ttft-repeats 1 \
    --variants --result-file "$OUT_DIR/gpu-moe.json" --time-limit-s $((limit - 20))
[ -f "$OUT_DIR/gpu-moe.txt" ] && cat "$OUT_DIR/gpu-moe.txt" >>"$SUMMARY"

step "LoRA: 8B stand-in, bf16, 64 requests, base vs 4 rank-16 adapters mixed (lora.py)" 120 \
    "$PY" benchmarks/lora.py --shape llama-3.1-8b --dtype bfloat16 --num-prompts 64 --max-num-seqs 64 \
    --input-len 128 --output-len 128 --num-adapters 4 --lora-rank 16 --result-file "$OUT_DIR/lora-gpu.json" \
    --disable-tqdm

step "EAGLE-3: 8B stand-in, random head, K=3, per-step costs (eagle3_speed.py)" 100 \
    "$PY" benchmarks/eagle3_speed.py --result-file "$OUT_DIR/eagle3-gpu.json"

step "host overhead: tiny model, async scheduling, batch 1 and 64 (host_overhead.py)" 60 \
    "$PY" benchmarks/host_overhead.py --batch-sizes 1 64 --result-file "$OUT_DIR/host-overhead-gpu.json"

# detokenization inline or in a second process (--detokenizer-process), which decides that option's default;
# needs the default model's tokenizer files (carry checkpoints/SmolLM2-135M-Instruct/tokenizer.json and
# tokenizer_config.json)
TOKENIZER=checkpoints/SmolLM2-135M-Instruct
if [ -f "$TOKENIZER/tokenizer.json" ]; then
    for mode in no-detokenizer-process detokenizer-process; do
        step "host overhead with detokenization, --$mode, batch 64 and 256 (host_overhead.py)" 60 \
            "$PY" benchmarks/host_overhead.py --batch-sizes 64 256 --tokenizer "$TOKENIZER" --vocab-size 8192 \
            --stop zqzq --$mode --result-file "$OUT_DIR/host-overhead-detok-$mode.json"
    done
else
    echo "host overhead with detokenization: skipped (no $TOKENIZER/tokenizer.json)" | tee -a "$SUMMARY"
fi

RANDOM_MODEL=/tmp/smollm2-random
step "random-weight checkpoint with the default model's shapes" 45 \
    "$PY" benchmarks/random_model.py "$RANDOM_MODEL" --checkpoint
step "default model's shapes: decode roofline, bf16, batch 1-256 (roofline.py)" 100 \
    "$PY" benchmarks/roofline.py --model "$RANDOM_MODEL" --dtype bfloat16 --batch-sizes 1 16 64 256 \
    --max-num-seqs 256 --max-model-len 1024 --context 512 --result-file "$OUT_DIR/roofline-gpu.json" \
    --no-plot --disable-tqdm

if "$PY" -c "import pytest" 2>/dev/null; then
    step "pytest tests/test_kernels.py tests/test_mosaic_gpu_kernels.py (compiled Triton and Mosaic GPU)" 170 \
        "$PY" -m pytest tests/test_kernels.py tests/test_mosaic_gpu_kernels.py -q -p no:cacheprovider \
        --junitxml="$OUT_DIR/test_kernels.xml"
else
    echo "pytest: skipped (not installed; put a pytest wheel in .whl/)" | tee -a "$SUMMARY"
fi

step "benchmarks/kernel_bench.py (bf16 grid)" 150 \
    "$PY" benchmarks/kernel_bench.py --repeats 5 --out-dir "$OUT_DIR"
step "benchmarks/kernel_bench.py (int8 quick grid)" 45 \
    "$PY" benchmarks/kernel_bench.py --quick --kv-int8 --repeats 5 --out-dir "$OUT_DIR"

# KV tiers: pinned-host stores and restores against recomputing (last: it matters least to the kernels' owners)
step "KV host tier: multi-turn TTFT, default model's shapes, bf16 (multi_turn.py)" 120 \
    "$PY" benchmarks/multi_turn.py --model "$RANDOM_MODEL" --dtype bfloat16 --modes off host \
    --result-file "$OUT_DIR/multi-turn-gpu.json" --disable-tqdm

echo "== summary (${SECONDS}s)"
cat "$SUMMARY"

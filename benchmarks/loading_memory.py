"""Peak host memory (RSS) while loading a model onto the devices, one fresh process per case (issue 12).

Cases: the default model (its converted float32 store, restored in bfloat16) and a ~1B-parameter random-weight
Llama checkpoint in bfloat16 safetensors, each with tensor_parallel_size 1 and 3 (3 CPU devices through
`XLA_FLAGS=--xla_force_host_platform_device_count=3`). The random checkpoint is built once into the cache
directory without torch: numpy draws one tensor at a time, ml_dtypes casts it to bfloat16, and safetensors'
numpy writer saves about `--shard-mib` per file with a `model.safetensors.index.json`, as HF shards do.

Each case runs in a child process that imports everything loading uses (transformers' tokenizer modules
included) and starts the backend, notes its RSS
(the baseline), resets the kernel's high-water mark (`/proc/self/clear_refs`), loads the model with
`load_model(model, bfloat16, mesh=make_mesh(tp))`, waits for every array, and reports the high-water mark
(VmHWM), `resource.getrusage(RUSAGE_SELF).ru_maxrss` (the process's peak since it started) and the RSS after
loading. On the CPU backend the devices' memory is host memory, so the RSS includes the placed params
themselves; what loading costs beyond them is the peak above the baseline minus the params' bytes.

    python benchmarks/loading_memory.py                       # all four cases
    python benchmarks/loading_memory.py --cases random-1b --tp 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common

NAME = "loading_memory"
MiB = 1 << 20
# ~1.03 B parameters; 24 query heads, 6 KV heads, an MLP width and a vocabulary that all divide by 3
RANDOM_1B_SHAPES: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=1536, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=6, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, torch_dtype="bfloat16")
DEFAULT_CACHE = Path.home() / ".cache" / "jaxserve" / "loading_memory"


def hf_tensor_shapes(shapes: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama HF checkpoint with these shapes, HF names and orientation (`[out, in]`)."""
    hidden, inter, head_dim = shapes["hidden_size"], shapes["intermediate_size"], shapes["head_dim"]
    q, kv = shapes["num_attention_heads"] * head_dim, shapes["num_key_value_heads"] * head_dim
    tensors = {"model.embed_tokens.weight": (shapes["vocab_size"], hidden)}
    for layer in range(shapes["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,),
                    prefix + "self_attn.q_proj.weight": (q, hidden), prefix + "self_attn.k_proj.weight": (kv, hidden),
                    prefix + "self_attn.v_proj.weight": (kv, hidden), prefix + "self_attn.o_proj.weight": (hidden, q),
                    prefix + "mlp.gate_proj.weight": (inter, hidden), prefix + "mlp.up_proj.weight": (inter, hidden),
                    prefix + "mlp.down_proj.weight": (hidden, inter)}
    tensors["model.norm.weight"] = (hidden,)
    if not shapes["tie_word_embeddings"]:
        tensors["lm_head.weight"] = (shapes["vocab_size"], hidden)
    return tensors


def build_random_checkpoint(path: Path, shapes: dict[str, Any] = RANDOM_1B_SHAPES, shard_mib: int = 512,
                            seed: int = 0) -> Path:
    """Writes a random-weight bfloat16 Llama checkpoint (config.json + sharded safetensors + index) to `path`,
    once: a directory that already has its index is reused. Host memory: one shard's tensors plus one float32
    tensor being drawn."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    if (path / "model.safetensors.index.json").exists():
        return path
    staging = path.with_name(path.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = hf_tensor_shapes(shapes)
    files: list[list[str]] = [[]]
    sizes = [0]
    for name, shape in tensors.items():  # group the tensors into shards of about shard_mib
        nbytes = 2 * int(np.prod(shape))
        if files[-1] and sizes[-1] + nbytes > shard_mib * MiB:
            files.append([])
            sizes.append(0)
        files[-1].append(name)
        sizes[-1] += nbytes
    weight_map = {}
    for number, names in enumerate(files, start=1):
        file = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        shard = {}
        for name in names:
            if len(tensors[name]) == 1:  # norm scales
                shard[name] = (1.0 + 0.1 * rng.standard_normal(tensors[name], np.float32)).astype(ml_dtypes.bfloat16)
            else:
                shard[name] = (0.02 * rng.standard_normal(tensors[name], np.float32)).astype(ml_dtypes.bfloat16)
            weight_map[name] = file
        save_file(shard, str(staging / file), metadata={"format": "pt"})
        del shard
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, **shapes}
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    (staging / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2))
    staging.rename(path)
    return path


MEASURE_SCRIPT = r"""
import json, resource, sys, time
from pathlib import Path

def status(key):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith(key + ":"))

import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint, safetensors, transformers, gguf  # everything loading imports, outside the measurement
import transformers.models.auto.tokenization_auto, transformers.tokenization_utils_fast  # ~200 MiB of imports
from jaxserve.distributed.tensor_parallel import make_mesh
from jaxserve.loading import load_model
from jaxserve.loading import hf, store
from jaxserve.models import checkpoint_shapes

model, tp = (None if sys.argv[1] == "default" else sys.argv[1]), int(sys.argv[2])
mesh = make_mesh(tp)
jax.block_until_ready(jax.device_put(np.zeros(1), jax.devices()[0]))  # the backend is started
baseline = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
started = time.perf_counter()
loaded = load_model(model, jnp.bfloat16, mesh=mesh)
jax.block_until_ready(loaded.params)
seconds = time.perf_counter() - started
leaves = jax.tree.leaves(loaded.params)
rss_after = status("VmRSS")  # read once: jax's threads may still fault pages in between two reads
print(json.dumps({
    "model_bytes": sum(leaf.size * leaf.dtype.itemsize for leaf in leaves),
    "placed_bytes": sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards),
    "parameters": sum(leaf.size for leaf in leaves),
    "baseline_rss": baseline, "peak_rss": max(status("VmHWM"), rss_after),  # the mark lags by a few pages
    "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_after": rss_after, "rss_anon_after": status("RssAnon"), "rss_file_after": status("RssFile"),
    "seconds": seconds, "devices": mesh.size,
}))
"""


def measure(model: str, tp: int) -> dict[str, Any]:
    """One case in a fresh process (see the module docstring); `model` is "default" or a checkpoint directory."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}",
           "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", MEASURE_SCRIPT, model, str(tp)], env=env, cwd=common.REPO_ROOT,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"measuring {model} with tp={tp} failed:\n{run.stderr[-4000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["above_baseline"] = result["peak_rss"] - result["baseline_rss"]
    result["transient"] = result["above_baseline"] - result["placed_bytes"]
    result["above_baseline_x_model"] = result["above_baseline"] / result["model_bytes"]
    result["transient_x_model"] = result["transient"] / result["model_bytes"]
    return result


def ensure_default_store() -> None:
    """Converts the default model's GGUF once (a measured load would otherwise include the conversion)."""
    code = "from jaxserve.loading import load_model; load_model(None)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=common.REPO_ROOT,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["default", "random-1b"], choices=["default", "random-1b"])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 3], help="tensor_parallel_size values")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where the random checkpoint is built once")
    parser.add_argument("--shard-mib", type=int, default=512, help="size of the random checkpoint's files")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args(argv)
    common.commit_at_start()
    models = {}
    if "default" in args.cases:
        ensure_default_store()
        models["default"] = "default"
    if "random-1b" in args.cases:
        started = time.perf_counter()
        path = build_random_checkpoint(Path(args.cache_dir) / "random-llama-1b-bf16", shard_mib=args.shard_mib)
        print(f"random checkpoint: {path} ({time.perf_counter() - started:.0f} s)", flush=True)
        models["random-1b"] = str(path)
    rows, results = [], []
    for case, model in models.items():
        for tp in args.tp:
            result = {"case": case, "tp": tp, **measure(model, tp)}
            results.append(result)
            rows.append((case, tp, result["parameters"] / 1e6, result["model_bytes"] / MiB,
                         result["baseline_rss"] / MiB, result["peak_rss"] / MiB, result["ru_maxrss"] / MiB,
                         result["above_baseline"] / MiB, result["above_baseline_x_model"],
                         result["transient"] / MiB, result["transient_x_model"], result["seconds"]))
            print(f"{case} tp={tp}: peak {result['peak_rss'] / MiB:.0f} MiB, above baseline "
                  f"{result['above_baseline'] / MiB:.0f} MiB ({result['above_baseline_x_model']:.2f}x model)",
                  flush=True)
    print(common.format_table(
        ["case", "tp", "M params", "model MiB (bf16)", "baseline MiB", "peak MiB (VmHWM)", "ru_maxrss MiB",
         "above baseline MiB", "x model", "beyond params MiB", "x model", "load s"], rows))
    common.write_result(NAME, {"results": results}, args.result_file, argv=list(argv) if argv else sys.argv[1:])
    return {"results": results}


if __name__ == "__main__":
    main()

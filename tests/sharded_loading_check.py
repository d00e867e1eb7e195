"""Run by tests/test_loading.py in a fresh process with 3 CPU devices (XLA_FLAGS must be set before jax starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=3 python tests/sharded_loading_check.py SPEC_JSON

SPEC: {"models": {name: HF dir}, "store": dir to save a store in, "bad": {name: [model, tensor_parallel_size]},
"checkpoint_dir": JAXSERVE_CHECKPOINT_DIR for the bad cases}. Prints one JSON line: for every model, every
parameter's full shape, its shard shapes on 3 devices, whether each shard equals its slice of the one-device load,
and how many elements each device's read took from the safetensors file; the same (without reads) for the store
restored onto 3 devices; and for every bad case the exception raised (type and message).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.distributed.shardings import path_name
from jaxserve.distributed.tensor_parallel import make_mesh
from jaxserve.loading import hf, load_model
from jaxserve.loading.store import save_store

reads: list[list[int]] = []  # per make_array_from_callback call, the element count of every slice read
_make_array_from_callback = jax.make_array_from_callback
_read_hf_slice = hf.read_hf_slice


def make_array_from_callback(*args, **kwargs):
    reads.append([])
    return _make_array_from_callback(*args, **kwargs)


def read_hf_slice(*args, **kwargs):
    out = _read_hf_slice(*args, **kwargs)
    reads[-1].append(int(out.size))
    return out


jax.make_array_from_callback = make_array_from_callback
hf.read_hf_slice = read_hf_slice


def compare(full_params: dict, sharded_params: dict, read_counts: list[list[int]] | None) -> dict:
    report = {}
    full_leaves = jax.tree_util.tree_flatten_with_path(full_params)[0]
    sharded_leaves = jax.tree.leaves(sharded_params)
    assert len(full_leaves) == len(sharded_leaves)
    for number, ((key, full), sharded) in enumerate(zip(full_leaves, sharded_leaves)):
        full = np.asarray(full)
        shards = sharded.addressable_shards
        report[path_name(key)] = {
            "shape": list(full.shape),
            "dtype": str(sharded.dtype),
            "devices": sorted(shard.device.id for shard in shards),
            "shard_shapes": [list(shard.data.shape) for shard in shards],
            "equal": all(np.array_equal(np.asarray(shard.data), full[shard.index]) for shard in shards),
            "reads": read_counts[number] if read_counts is not None else None,
        }
    return report


def main(spec: dict) -> dict:
    assert len(jax.devices()) == 3, jax.devices()
    out: dict = {"models": {}, "store": None, "bad": {}}
    for name, path in spec["models"].items():
        full = load_model(path, jnp.float32, mesh=make_mesh(1))
        reads.clear()
        sharded = load_model(path, jnp.float32, mesh=make_mesh(3))
        out["models"][name] = compare(full.params, sharded.params, list(reads))
        if name == spec.get("store_from"):
            save_store(spec["store"], full.config, full.params, None)
            restored = load_model(spec["store"], jnp.float32, mesh=make_mesh(3))
            out["store"] = compare(full.params, restored.params, None)
    os.environ["JAXSERVE_CHECKPOINT_DIR"] = spec["checkpoint_dir"]
    for name, (model, size) in spec["bad"].items():
        try:
            load_model(model, mesh=make_mesh(size))
            out["bad"][name] = None
        except Exception as err:  # the test checks the type and the message
            out["bad"][name] = {"type": type(err).__name__, "message": str(err)}
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))

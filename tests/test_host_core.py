"""The host-only core: the scheduler and what it reads (sequences, requests, pages and their managers, the scheduler
output, SLO, prefill limits, the detokenizer and output processor, the engine's config) import with jax, jaxlib and
flax unimportable, so host bookkeeping never pulls the device side in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CORE = ["jaxserve.engine.scheduler", "jaxserve.engine.sequence", "jaxserve.engine.request",
        "jaxserve.engine.page_pool", "jaxserve.engine.page_manager", "jaxserve.engine.window_manager",
        "jaxserve.engine.state_checkpoints", "jaxserve.engine.scheduler_output", "jaxserve.engine.slo",
        "jaxserve.engine.prefill_limits", "jaxserve.engine.detokenizer", "jaxserve.engine.output_processor",
        "jaxserve.engine.config", "jaxserve.engine.buckets", "jaxserve.lora.slots", "jaxserve.sampling_params"]

WITHOUT_JAX = """
import importlib, importlib.abc, sys

class NoDevice(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax"):
            raise ImportError(f"{name} is not importable here")

sys.meta_path.insert(0, NoDevice())
for module in sys.argv[1:]:
    importlib.import_module(module)
from jaxserve.engine.config import EngineConfig
config = EngineConfig(model="tiny", max_model_len=64, page_size=8)  # checked without jax
print("imported", len(sys.argv) - 1, "jax" in sys.modules)
"""


def test_the_core_imports_without_jax():
    run = subprocess.run([sys.executable, "-c", WITHOUT_JAX, *CORE], cwd=Path(__file__).parents[1],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["imported", str(len(CORE)), "False"], run.stderr[-3000:]

"""Runs the test suite as `make test` does: one pytest over two worker processes (pytest-xdist, `--dist loadfile`
as tests/suite_scheduling.py changes it: each test file runs whole on one worker, the files sharing the default
server together, each handed to whichever is free, so the two stay busy until the end; the CI machine has two cores, and most tests
are bound by one core's compiling), the longest files first by their last measured time
(tests/suite_durations.json, xdist's own reordering off), with tests/suite_budget.py's report and per-file budget,
sharing one fresh folder for jax's persistent compilation cache, after the default model's store is converted (both
would otherwise write it at once). Extra arguments go to pytest. Exits as pytest does.

A worker that dies is not replaced (`--max-worker-restart 0`): pytest-xdist's replacement of a crashed worker under
`--dist loadfile` can wait forever (pytest-xdist issue 784), and did, on CI, until
its 90 minutes ran out. The run fails at once instead, naming the test the worker was running. A test that runs over
ten minutes has every thread's stack dumped (`faulthandler_timeout`), to show where it waits.

What crashed before: a process that built a few hundred engines died in XLA:CPU (a segfault
under `compilation_cache.get_executable_and_time` or `put_executable_and_time`): first a one-process run (issue
27), then one of these two workers on CI (issue 30's submission). The cause: jax's caches keep every compiled
executable, each holding memory maps of its code, so the process reached the kernel's limit (vm.max_map_count,
65,530; about 5,000 maps more after each large test file), and LLVM's next mapping failed ("LLVM compilation
error: Cannot allocate memory", then the segfault; reproduced here with the limit lowered to 8,000 over two files).
conftest's `release_executables` now clears jax's caches after each test file: the maps go back to about 1,150.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    tests = Path(__file__).parent
    files = ordered_files(tests)
    root = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    # CPU only (as conftest sets it): with the [aot] extra's CUDA plugin and libtpu installed, jax would try both
    env = {**os.environ, "JAXSERVE_CACHE_ROOT": root, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    try:  # the default model's converted store first, so the two never convert it at once
        subprocess.check_call([sys.executable, "-c", "from jaxserve.loading import load_model; load_model()"],
                              env=env, cwd=tests.parent)
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                                "--dist", "loadfile", "--no-loadscope-reorder", "-p", "tests.suite_budget",
                                "-p", "tests.suite_scheduling",
                                "--max-worker-restart", "0", "-o", "faulthandler_timeout=600",
                                *(f"tests/{path.name}" for path in files), *sys.argv[1:]], env=env, cwd=tests.parent)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ordered_files(tests: Path) -> list[Path]:
    """The test files, longest first by their last measured time (tests/suite_durations.json); files it does not
    know yet go first, largest first."""
    known = json.loads((tests / "suite_durations.json").read_text())
    return sorted(tests.glob("test_*.py"),
                  key=lambda path: (f"tests/{path.name}" in known, -known.get(f"tests/{path.name}", path.stat().st_size)))


if __name__ == "__main__":
    sys.exit(main())

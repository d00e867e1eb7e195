"""Runs the test suite as `make test` does: in two pytest processes at once (the CI machine has two cores, and
most tests are bound by one core's compiling), the test files dealt to them alternately by name, sharing one fresh
folder for jax's persistent compilation cache (nothing of an earlier run is read), after the default model's
store is converted (both would otherwise write it at once). Extra arguments go to both
pytest calls. Exits non-zero if either failed.

Why two: one process running every test died at the same test on CI and on a developer's machine, in XLA's loading
of a cached executable during an engine's warm-up (a segfault in jax's `compilation_cache.get_executable_and_time`)
after some 420 tests had built their engines in it; that file's tests pass in a fresh process, and each half
passes whole. The cause inside XLA is not found yet: see the note of issue 27.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    files = sorted(path.name for path in (Path(__file__).parent).glob("test_*.py"))
    halves = [files[0::2], files[1::2]]
    root = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    env = {**os.environ, "JAXSERVE_CACHE_ROOT": root}
    try:  # the default model's converted store first, so the two never convert it at once
        subprocess.check_call([sys.executable, "-c", "from jaxserve.loading import load_model; load_model()"],
                              env=env, cwd=Path(__file__).parents[1])
        runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  *(f"tests/{name}" for name in half), *sys.argv[1:]], env=env,
                                 cwd=Path(__file__).parents[1]) for half in halves]
        codes = [run.wait() for run in runs]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main())

"""Runs the test suite as `make test` does: one pytest over two worker processes (pytest-xdist, `--dist loadfile`:
each test file runs whole on one worker, handed to whichever is free, so the two stay busy until the end; the CI
machine has two cores, and most tests are bound by one core's compiling), the largest files first, sharing one
fresh folder for jax's persistent compilation cache (nothing of an earlier run is read), after the default model's
store is converted (both would otherwise write it at once). Extra arguments go to pytest. Exits as pytest does.

Why two processes rather than one: one process running every test died at the same test on CI and on a developer's
machine, in XLA's loading of a cached executable during an engine's warm-up (a segfault in jax's
`compilation_cache.get_executable_and_time`) after some 420 tests had built their engines in it; that file's tests
pass in a fresh process, and each half passes whole. The cause inside XLA is not found yet: see the note of issue 27.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    tests = Path(__file__).parent
    files = sorted(tests.glob("test_*.py"), key=lambda path: (-path.stat().st_size, path.name))  # longest first
    root = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    env = {**os.environ, "JAXSERVE_CACHE_ROOT": root}
    try:  # the default model's converted store first, so the two never convert it at once
        subprocess.check_call([sys.executable, "-c", "from jaxserve.loading import load_model; load_model()"],
                              env=env, cwd=tests.parent)
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                                "--dist", "loadfile", *(f"tests/{path.name}" for path in files), *sys.argv[1:]],
                               env=env, cwd=tests.parent)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Runs the test suite as `make test` does: in two pytest processes, one after the other, sharing one fresh folder
for jax's persistent compilation cache (so the second reuses what the first compiled, and nothing of an earlier
run is read). Extra arguments go to both pytest calls. Exits non-zero if either failed.

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

SECOND_HALF_FROM = "test_page_manager.py"  # files from this one on (by name) run in the second process


def main() -> int:
    files = sorted(path.name for path in (Path(__file__).parent).glob("test_*.py"))
    halves = [[name for name in files if name < SECOND_HALF_FROM], [name for name in files if name >= SECOND_HALF_FROM]]
    root = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    env = {**os.environ, "JAXSERVE_CACHE_ROOT": root}
    try:
        codes = [subprocess.call([sys.executable, "-m", "pytest", "-q", *(f"tests/{name}" for name in half),
                                  *sys.argv[1:]], env=env, cwd=Path(__file__).parents[1]) for half in halves]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main())

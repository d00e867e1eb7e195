"""Time to healthy: `jaxserve serve` started as a user starts it, timed from the process's start to its first
`/health` 200 (weights loaded and every step shape compiled), with jax's persistent compilation cache cold (a fresh
cache folder) and warm (the folder a previous start filled).

    python benchmarks/startup.py --runs 2                     # the default model; cold, warm, cold, warm
    python benchmarks/startup.py --runs 1 -- --max-num-seqs 128 # flags after -- go to jaxserve serve

Each cold start gets its own new cache folder (`JAXSERVE_CACHE_ROOT`), each warm start the folder of the cold start
before it. The default model's converted store under `checkpoints/` is made once before timing, so no start pays
the GGUF conversion. Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO_ROOT, format_table, write_result  # noqa: E402

POLL_SECONDS = 0.1
PLATFORMS = os.environ.get("JAX_PLATFORMS", "cpu")  # the CPU unless set (the [aot] extra's plugins are not devices)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_to_healthy(cache_root: str, serve_args: Sequence[str], timeout: float) -> float:
    """Seconds from starting `jaxserve serve` to its first /health 200; the server is stopped after."""
    port = free_port()
    env = {**os.environ, "JAXSERVE_CACHE_ROOT": cache_root, "JAX_PLATFORMS": PLATFORMS}
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--port", str(port), *serve_args],
                              env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - started < timeout:
            if server.poll() is not None:
                raise RuntimeError(f"jaxserve serve exited with {server.returncode} before it was healthy")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            time.sleep(POLL_SECONDS)
        raise RuntimeError(f"not healthy after {timeout} s")
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="cold and warm starts each (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    subprocess.check_call([sys.executable, "-c", "from jaxserve.loading import load_model; load_model()"],
                          cwd=REPO_ROOT, env={**os.environ, "JAX_PLATFORMS": PLATFORMS})  # the store, before timing
    cold, warm = [], []
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as root:
        for run in range(args.runs):
            cache = str(Path(root) / f"cache{run}")
            cold.append(time_to_healthy(cache, serve_args, args.timeout))
            warm.append(time_to_healthy(cache, serve_args, args.timeout))
            print(f"run {run}: cold {cold[-1]:.1f} s, warm {warm[-1]:.1f} s", flush=True)
    print(format_table(["cache", "runs", "median s", "min s", "max s"],
                       [[name, len(times), statistics.median(times), min(times), max(times)]
                        for name, times in (("cold", cold), ("warm", warm))]))
    result = {"serve_args": serve_args, "cold_seconds": cold, "warm_seconds": warm}
    write_result("startup", result, args.result_file, argv)
    return result


if __name__ == "__main__":
    main()

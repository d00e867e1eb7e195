"""The platform a `jaxserve` command picks before jax starts (jaxserve/platforms.py): on this machine, with jax's
CUDA and TPU plugins installed but no GPU or TPU, the CPU alone, so a process's log has no plugin tracebacks and a
`jaxserve compile` for a TPU target runs beside it (the process never starts libtpu, whose lockfile a compile
would otherwise find taken)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import tiny_hf_config
from tests.test_compile_targets import compilers_present
from tests.test_server_process import REPO

HOLDER = """
import sys, time
if sys.argv[1] == "picked":
    from jaxserve.platforms import pick_platform
    pick_platform()
import jax
print(jax.devices()[0].platform, flush=True)
time.sleep(300)
"""


def without_platforms() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}


def test_the_command_line_picks_the_cpu_before_jax_starts():
    script = ("import os\nfrom jaxserve import cli\ntry:\n    cli.main(['no-such-command'])\nexcept SystemExit:\n"
              "    pass\nimport jax\nprint(os.environ['JAX_PLATFORMS'], jax.devices()[0].platform)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=without_platforms(), capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split()[-2:] == ["cpu", "cpu"], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "cuPTI" not in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(not compilers_present(), reason="the target compilers (the [aot] extra) are not installed")
def test_a_tpu_compile_runs_beside_a_process_on_the_cpu(tmp_path):
    tiny_hf_config("llama", hidden_size=256, intermediate_size=256, head_dim=64).save_pretrained(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "picked"], cwd=REPO, env=without_platforms(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "cpu"
        done = subprocess.run([sys.executable, "-m", "jaxserve", "compile", "--model", str(tmp_path), "--target",
                               "v6e-1", "--max-num-seqs", "4", "--max-model-len", "128", "--max-num-batched-tokens",
                               "16", "--steps", "decode"], cwd=REPO, env=without_platforms(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        holder.kill()
        _, errors = holder.communicate()
    assert "Traceback" not in errors, errors[-2000:]

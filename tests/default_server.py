"""One real server process on the default model (`python -m jaxserve serve`, small engine options, the hermes
tool-call parser), shared by the end-to-end server tests of a pytest run (conftest's `default_server`): its
start-up is watched (/health 503 then 200, chat 503 with Retry-After while loading) and at the end it must stop
gracefully on SIGTERM (exit 0)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
ENGINE_OPTIONS = ["--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "128"]
PAGE_SIZE = 16  # the engine's default, which ENGINE_OPTIONS keep
STARTUP_TIMEOUT = 400  # seconds


def serve_command(args: list[str], shapes: dict | None = None, prelude: str = "") -> list[str]:
    """`jaxserve serve ARGS` as a Python process that first replaces `shapes`' fields of the EngineConfig the flags
    make (`jaxserve serve` has no flags for the compiled shapes), then runs `prelude` (Python, in that process)."""
    script = ("import dataclasses\nfrom jaxserve.server import cli_args\n_engine_config = cli_args.engine_config\n"
              f"cli_args.engine_config = lambda args: dataclasses.replace(_engine_config(args), **{shapes!r})\n"
              if shapes else "")
    return [sys.executable, "-c", f"{script}{prelude}\nfrom jaxserve.cli import main\nmain()\n", "serve", *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, port: int, process: subprocess.Popen, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {name{labels}: value} plus {name: value} summed over labels."""
        text = httpx.get(self.url + "/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
            name = key.split("{", 1)[0]
            if "{" in key and key != name:
                samples[name] = samples.get(name, 0.0) + float(value)
        return samples


@contextlib.contextmanager
def running_server(log_dir: Path) -> Iterator[ServerProcess]:
    """The server, healthy; stopped with SIGTERM afterwards (AssertionError unless it exits 0)."""
    port = free_port()
    log_path = log_dir / "server.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    command = serve_command(["--port", str(port), *ENGINE_OPTIONS, "--log-stats-interval", "2", "--shutdown-timeout",
                             "10", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    handle = ServerProcess(port, process, log_path)
    statuses = []
    chat_statuses = set()  # what a chat request for the served model got while loading
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        while True:
            assert process.poll() is None, f"server exited with {process.returncode}:\n{handle.log()[-3000:]}"
            assert time.monotonic() < deadline, f"server not healthy in time:\n{handle.log()[-3000:]}"
            try:
                status = httpx.get(handle.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status is not None and (not statuses or statuses[-1] != status):
                statuses.append(status)
            if status == 200:
                break
            if status == 503:
                chat = httpx.post(handle.url + "/v1/chat/completions", timeout=60,
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 1})
                chat_statuses.add((chat.status_code, chat.headers.get("Retry-After") is not None))
            time.sleep(0.25)
        handle.health_statuses = statuses
        handle.chat_statuses_while_loading = chat_statuses
        yield handle
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, f"exit code {process.returncode} after SIGTERM:\n{handle.log()[-3000:]}"
    assert "Shutting down" in handle.log()

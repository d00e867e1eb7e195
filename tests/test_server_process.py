"""The server process around the real engine, on a tiny random-weight model: how it ends.

A dead engine thread must not leave a zombie server: in-flight requests get a 500 (or an error event)
and the process exits non-zero by itself, so a supervisor restarts it. SIGTERM mid-stream lets the
stream finish and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest

from tests.default_server import serve_command

REPO = Path(__file__).resolve().parents[1]
TINY_OPTIONS = ["--max-num-seqs", "4", "--max-model-len", "128", "--max-num-batched-tokens", "32",
                "--log-stats-interval", "0", "--shutdown-timeout", "10"]
# one compiled shape per step kind (warmed up at start: the drain after SIGTERM must not wait on a compile): these
# tests are about how the process ends, not about bucketing
SHAPES = dict(decode_batch_buckets=(4,), smallest_prefill_bucket=32)
START_TIMEOUT = 400  # seconds: load + compile on a busy 2-core machine
EXIT_TIMEOUT = 60

# Patches the engine in the server process: its first step waits until two requests were added, then raises.
ENGINE_FAULT = """
import threading
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.model_runner import ModelRunner

two_added = threading.Event()
added = []
add_request = LLMEngine.add_request

def counting_add_request(self, *args, **kwargs):
    request_id = add_request(self, *args, **kwargs)
    added.append(request_id)
    if len(added) == 2:
        two_added.set()
    return request_id

def failing_dispatch(self, plan):
    two_added.wait(300)
    raise RuntimeError("injected device fault")

LLMEngine.add_request = counting_add_request
ModelRunner.dispatch = failing_dispatch
"""

# Patches the server process so that the engine steps only once the server began draining (after SIGTERM).
STEPS_AFTER_SIGTERM = """
import threading
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.server.async_engine import AsyncEngine

draining = threading.Event()
dispatch, drain = ModelRunner.dispatch, AsyncEngine.drain

def gated_dispatch(self, plan):
    draining.wait(300)
    return dispatch(self, plan)

def noting_drain(self, timeout):
    drain(self, timeout)
    draining.set()

ModelRunner.dispatch = gated_dispatch
AsyncEngine.drain = noting_drain
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, processes: list[subprocess.Popen], log: Callable[[int], str]) -> None:
    """Waits until `url`/health answers 200; fails with the log of a process (by index) that exited, or in time."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        for index, process in enumerate(processes):
            assert process.poll() is None, f"process {index} exited with {process.returncode}:\n{log(index)}"
        assert time.monotonic() < deadline, f"not healthy in time:\n{log(0)}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)


class Server:
    """`jaxserve serve` in a subprocess, after `prelude` (Python run first in the same process)."""

    def __init__(self, model_dir: str, log_path: Path, prelude: str = "", extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.model = model_dir
        command = serve_command(["--model", model_dir, "--port", str(self.port), *TINY_OPTIONS, *extra_args], SHAPES,
                                prelude)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        with open(log_path, "wb") as log_file:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        wait_healthy(self.url, [self.process], lambda _: self.log()[-3000:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def start_server(tiny_llama_dir, tmp_path):
    servers = []

    def start(prelude: str = "", extra_args: tuple[str, ...] = ()) -> Server:
        server = Server(tiny_llama_dir, tmp_path / f"server{len(servers)}.log", prelude, extra_args)
        servers.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.stop()


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_engine_death_fails_in_flight_requests_and_exits_nonzero(start_server):
    server = start_server(ENGINE_FAULT)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, payload: dict) -> None:
        answers[name] = httpx.post(server.url + "/v1/completions", json=payload, timeout=EXIT_TIMEOUT)

    senders = [threading.Thread(target=send, args=("whole", body)),
               threading.Thread(target=send, args=("stream", {**body, "stream": True}))]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    whole, stream = answers["whole"], answers["stream"]
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["code"] == "engine_dead" and "injected device fault" in error["message"]
    assert stream.status_code == 200  # the stream had started: the error comes as its last event
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]" and "injected device fault" in json.loads(events[-2])["error"]["message"]
    assert server.process.wait(timeout=EXIT_TIMEOUT) != 0
    log = server.log()
    assert "RuntimeError: injected device fault" in log  # the cause, with its traceback
    assert "exiting" in log


def test_sigterm_mid_stream_finishes_the_stream_then_exits_0(start_server):
    server = start_server(STEPS_AFTER_SIGTERM)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=EXIT_TIMEOUT) as response:
        assert response.status_code == 200
        server.process.send_signal(signal.SIGTERM)  # the request is in flight; the engine has not stepped yet
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finish = json.loads(events[-2])["choices"][0]
    assert finish["finish_reason"] == "length"
    assert server.process.wait(timeout=EXIT_TIMEOUT) == 0
    log = server.log()
    assert "draining: 1 requests in flight" in log and "Shutting down" in log
    with pytest.raises(httpx.TransportError):  # the listening socket is closed
        httpx.get(server.url + "/health", timeout=2)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_detokenizer_process_streams_stop_strings_and_ends_with_the_server(start_server):
    server = start_server(extra_args=("--detokenizer-process",))
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True,
            "temperature": 0}
    free = httpx.post(server.url + "/v1/completions", json=body, timeout=EXIT_TIMEOUT).json()["choices"][0]["text"]
    stop = free[len(free) // 2:len(free) // 2 + 3]
    expected = free[:free.index(stop)]
    whole = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=EXIT_TIMEOUT).json()
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == (expected, "stop")
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop], "stream": True},
                          timeout=EXIT_TIMEOUT)
    chunks = [json.loads(event) for event in sse_events(streamed.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    workers = children(server.process.pid)
    assert workers  # the detokenizer worker
    server.process.kill()  # no shutdown at all: the worker sees its pipe close and exits
    server.process.wait()
    deadline = time.monotonic() + EXIT_TIMEOUT
    while any(running(pid) for pid in workers):
        assert time.monotonic() < deadline, "the detokenizer worker outlived its server"
        time.sleep(0.1)

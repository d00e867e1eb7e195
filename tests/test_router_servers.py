"""`jaxserve router` in front of real `jaxserve serve` processes (one of them data-parallel over two devices):
the same greedy answers as a worker gives directly, a conversation kept where its prefix is cached (the hits seen in
`usage.prompt_tokens_details.cached_tokens`), a killed worker ejected while requests keep succeeding."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxserve.bench import client
from benchmarks.run_default_suite import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = ["--max-num-seqs", "4", "--max-model-len", "512", "--max-num-batched-tokens", "128", "--block-size", "8",
          "--log-stats-interval", "0"]


def start(command: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "jaxserve", *command], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)


def test_router_over_a_data_parallel_server_and_a_plain_one(tiny_llama_dir, tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = f"http://127.0.0.1:{free_port()}"
    workers = [start(["serve", "--model", tiny_llama_dir, "--port", urls[0].rsplit(":", 1)[1], *WORKER,
                      "--data-parallel-size", "2"], tmp_path / "worker0.log"),
               start(["serve", "--model", tiny_llama_dir, "--port", urls[1].rsplit(":", 1)[1], *WORKER],
                     tmp_path / "worker1.log")]
    front = None
    try:
        for url, process in zip(urls, workers):
            client.wait_for_server(url, 180, process)
        front = start(["router", "--worker-urls", *urls, "--policy", "cache_aware", "--port",
                       router.rsplit(":", 1)[1], "--health-check-interval", "0.2"], tmp_path / "router.log")
        client.wait_for_server(router, 60, front)
        with httpx.Client(timeout=60) as http:
            body = {"model": tiny_llama_dir, "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            direct = [http.post(url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
                      for url in urls]
            routed = http.post(router + "/v1/completions", json=body)
            assert direct[0] == direct[1] == routed.json()["choices"][0]["token_ids"]

            messages = [{"role": "system", "content": "You answer questions about the notes below. " * 4}]
            served, cached = [], []
            for turn in range(3):
                messages.append({"role": "user", "content": f"What does note {turn} say?"})
                answer = http.post(router + "/v1/chat/completions", json={
                    "model": tiny_llama_dir, "messages": messages, "max_tokens": 4, "temperature": 0})
                assert answer.status_code == 200, answer.text
                messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
                served.append(answer.headers["x-jaxserve-worker"])
                cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert served == [served[0]] * 3 and cached[0] == 0 and all(hit > 0 for hit in cached[1:]), cached

            workers[1].kill()
            workers[1].wait()
            for _ in range(4):  # each gets an answer: retried on the live worker, or sent there once ejected
                answer = http.post(router + "/v1/completions", json=body)
                assert answer.status_code == 200 and answer.headers["x-jaxserve-worker"] == urls[0]
            deadline = time.monotonic() + 30
            while f'jaxserve_router:worker_healthy{{worker="{urls[1]}"}} 0.0' not in http.get(router + "/metrics").text:
                assert time.monotonic() < deadline, "the killed worker was not ejected"
                time.sleep(0.1)
            worker_metrics = http.get(urls[0] + "/metrics").text
            assert 'replica="1"' in worker_metrics and 'replica="0"' in worker_metrics
        front.send_signal(signal.SIGTERM)
        assert front.wait(timeout=60) == 0
    finally:
        for process in [*workers, *([front] if front else [])]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)

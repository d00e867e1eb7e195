"""vllm-router (the `[router]` extra) in front of real `jaxserve serve` processes, one of them data-parallel over two
devices, each publishing its KV cache events (`--kv-events-config`): the router's `kv_aware` policy sends a prompt
to the worker whose events say it holds the prompt's pages (seen in `usage.prompt_tokens_details.cached_tokens`),
answers equal a worker's own, chats render through the workers' render endpoints, and a killed worker's share goes
to the other. The same workers (`--kv-transfer-config` kv_both) behind `vllm-router --vllm-pd-disaggregation`: the
data-parallel one prefills, the other pulls the pages and decodes, and the answers equal a worker's own with one
prompt token computed per request on the decode worker. And vllm-router's DP-aware mode
(`--intra-node-data-parallel-size 2`) places requests on the data-parallel worker's replicas by its header."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxserve.bench import client
from tests.default_server import serve_command
from tests.test_kv_events import BlockStored, replay
from tests.test_server_process import free_port

REPO = Path(__file__).resolve().parents[1]
ROUTER = Path(sys.executable).with_name("vllm-router")
DEADLINE = 60  # seconds for a worker to have published its events (a bound against hanging, not a latency check)
WORKER = ["--max-num-seqs", "4", "--max-model-len", "512", "--max-num-batched-tokens", "128", "--block-size", "8",
          "--log-stats-interval", "0"]
# one decode bucket, prefill chunks from 64 tokens, compiled when first used: routing is the point, not bucketing
SHAPES = dict(decode_batch_buckets=(4,), smallest_prefill_bucket=64, warmup=False)


def start(args: list[str], log_path: Path) -> subprocess.Popen:
    """`jaxserve serve ARGS`, its output in `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(serve_command(args, SHAPES), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (a data-parallel worker publishes on port + replica)."""
    while True:
        first = free_port()
        sockets = []
        try:
            for port in range(first, first + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_published(replay_endpoints: list[str], token_ids: list[int]) -> None:
    """Waits until one of a worker's replicas has published the first page of `token_ids` as stored (read back
    through its replay socket: what its PUB socket has sent the router too)."""
    deadline = time.monotonic() + DEADLINE
    while not any(event.token_ids == token_ids[:8] for endpoint in replay_endpoints
                  for _, batch in replay(endpoint, 0) for event in batch.events if isinstance(event, BlockStored)):
        assert time.monotonic() < deadline, "the worker never published the prompt's pages"
        time.sleep(0.05)


def metric(http: httpx.Client, url: str, name: str) -> float:
    """The sum of a worker's samples whose name and labels start with `name` (over its replicas)."""
    lines = http.get(url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"jaxserve:{name}" if "{" in name else f"jaxserve:{name}{{"))


def start_router(flags: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """A vllm-router with `flags` on a free port, once healthy (its /health answers 200 once a worker is)."""
    router = f"http://127.0.0.1:{free_port()}"
    with open(log_path, "w") as log:
        front = subprocess.Popen([str(ROUTER), *flags, "--port", router.rsplit(":", 1)[1], "--prometheus-port",
                                  str(free_port())], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + DEADLINE
    while not is_healthy(router):
        if front.poll() is not None or time.monotonic() > deadline:
            front.kill()
            raise AssertionError(log_path.read_text()[-2000:])
        time.sleep(0.2)
    return front, router


def check_intra_node_data_parallel(http: httpx.Client, url: str, model: str, tmp_path: Path) -> None:
    """vllm-router's DP-aware mode over a `--data-parallel-size 2` worker: its `X-data-parallel-rank` header
    places requests on both replicas, round robin."""
    front, router = start_router(["--worker-urls", url, "--intra-node-data-parallel-size", "2", "--api-key", "k",
                                  "--policy", "round_robin"], tmp_path / "dp_router.log")
    try:
        served = [metric(http, url, f'request_success_total{{finished_reason="length",model_name="{model}",'
                                    f'replica="{replica}"') for replica in (0, 1)]
        for offset in range(4):
            answer = http.post(router + "/v1/completions", json={"model": model, "prompt": [9 + offset] * 5,
                                                                 "max_tokens": 2, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
        assert [metric(http, url, f'request_success_total{{finished_reason="length",model_name="{model}",'
                                  f'replica="{replica}"') - before for replica, before in enumerate(served)] == [2, 2]
    finally:
        front.terminate()
        front.wait(timeout=60)


def check_pd_disaggregation(http: httpx.Client, urls: list[str], model: str, tmp_path: Path) -> None:
    """`urls[0]` prefills and `urls[1]` decodes behind vllm-router's P/D mode; answers equal `urls[1]`'s own."""
    front, router = start_router(["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1],
                                  "--policy", "round_robin"], tmp_path / "pd_router.log")
    try:
        computed = metric(http, urls[1], "prompt_tokens_computed_total")
        bodies = [("/v1/completions", {"prompt": list(range(30, 30 + length))}) for length in (9, 40, 70)]
        bodies.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": "disaggregate me"}]}))
        bodies = [(path, {"model": model, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields})
                  for path, fields in bodies]
        routed = [http.post(router + path, json=body) for path, body in bodies]
        assert all(answer.status_code == 200 for answer in routed), [answer.text for answer in routed]
        # the decode worker computed each prompt's last token and received the rest from the prefill worker
        assert metric(http, urls[1], "prompt_tokens_computed_total") == computed + len(bodies)
        assert metric(http, urls[1], "kv_transfer_tokens_received_total") == sum(
            answer.json()["usage"]["prompt_tokens"] - 1 for answer in routed)
        assert metric(http, urls[0], "kv_transfer_sends_total") == len(bodies)
        for (path, body), answer in zip(bodies, routed):
            assert answer.json()["choices"] == http.post(urls[1] + path, json=body).json()["choices"]
        params = http.post(urls[0] + path, json={**body, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True}}).json()["kv_transfer_params"]
        refused = http.post(urls[1] + path, json={**body, "kv_transfer_params": {**params, "layout": {
            **params["layout"], "page_size": 16}}})
        assert refused.status_code == 400 and "page_size 16 differs from this worker's 8" in refused.text
    finally:
        front.terminate()
        front.wait(timeout=60)


def test_kv_aware_vllm_router_follows_the_workers_kv_events(tiny_llama_dir, tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    events, replays = [free_ports(2), free_port()], [free_ports(2), free_port()]
    logs = [tmp_path / "worker0.log", tmp_path / "worker1.log"]
    workers = [start(["--model", tiny_llama_dir, "--port", url.rsplit(":", 1)[1], *WORKER, *extra,
                      "--kv-events-config", json.dumps({
                          "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
                          "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}),
                      "--kv-transfer-config", '{"kv_role": "kv_both"}'], log)
               for url, port, replay_port, log, extra in zip(urls, events, replays, logs,
                                                             (["--data-parallel-size", "2"], []))]
    front = None
    try:
        for url, process in zip(urls, workers):
            client.wait_for_server(url, 180, process)
        # the data-parallel worker's replicas publish on consecutive ports: one source of two ranks
        sources = [f"{urls[0]}=tcp://127.0.0.1:{events[0]},tcp://127.0.0.1:{events[0] + 1}",
                   f"{urls[1]}=tcp://127.0.0.1:{events[1]}"]
        front, router = start_router(["--worker-urls", *urls, "--policy", "kv_aware", "--kv-event-block-size", "8",
                                      "--kv-event-model", tiny_llama_dir, "--health-check-interval-secs", "1",
                                      *(f"--kv-event-source={s}" for s in sources)], tmp_path / "router.log")
        with httpx.Client(timeout=60) as http:
            # (no return_token_ids: vllm-router 0.1.17 routes such a request without its prefix credit)
            body = {"model": tiny_llama_dir, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            prompts = [list(range(5 + offset, 60 + offset)) for offset in (0, 100)]  # 55 tokens: 6 pages each
            direct = [http.post(url + "/v1/completions", json={**body, "prompt": prompt}).json()
                      for url, prompt in zip(urls, prompts)]  # prompt i is cached on worker i only
            published = [[f"tcp://127.0.0.1:{replays[0]}", f"tcp://127.0.0.1:{replays[0] + 1}"],
                         [f"tcp://127.0.0.1:{replays[1]}"]]
            for index, prompt in enumerate(prompts):
                wait_published(published[index], prompt)  # the router has read them at the same time
                routed = http.post(router + "/v1/completions", json={**body, "prompt": prompt}).json()
                assert routed["choices"][0]["text"] == direct[index]["choices"][0]["text"]
                assert routed["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # its 6 full pages
            chat = http.post(router + "/v1/chat/completions", json={
                "model": tiny_llama_dir, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4})
            assert chat.status_code == 200, chat.text
            check_pd_disaggregation(http, urls, tiny_llama_dir, tmp_path)
            check_intra_node_data_parallel(http, urls[0], tiny_llama_dir, tmp_path)

            workers[1].kill()
            workers[1].wait()
            for offset in range(4):  # each gets an answer from the live worker
                answer = http.post(router + "/v1/completions", json={**body, "prompt": [7 + offset] * 9})
                assert answer.status_code == 200, answer.text
    finally:
        for process in [*workers, *([front] if front else [])]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)

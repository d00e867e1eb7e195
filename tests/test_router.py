"""`jaxserve router`: policy decisions, the prefix tree, and forwarding over real HTTP to small fake workers
(health, ejection, retry, rejoin, a stream broken mid-way, pass-through errors, metrics, bad flags)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.router import router_main, worker_url
from jaxserve.router.app import create_router_app, routing_text
from jaxserve.router.policies import CacheAware, RoundRobin, ShortestQueue, WorkerLoad, make_policy
from jaxserve.router.prefix_tree import PrefixTree
from jaxserve.router.workers import WorkerPool
from jaxserve.server.http_utils import EventStreamResponse, wait_for_disconnect

# -- policies and the tree (no HTTP) -----------------------------------------------------------------------------


def loads(*values: float) -> list[WorkerLoad]:
    return [WorkerLoad(f"http://w{i}", in_flight=int(v)) for i, v in enumerate(values)]


def test_round_robin_and_shortest_queue():
    policy = RoundRobin()
    assert [policy.choose(loads(0, 0, 0), "") for _ in range(4)] == ["http://w0", "http://w1", "http://w2",
                                                                      "http://w0"]
    assert ShortestQueue().choose(loads(3, 1, 1), "") == "http://w1"  # ties: the first listed
    assert ShortestQueue().choose([WorkerLoad("a", 1, 5.0), WorkerLoad("b", 4, 0.0)], "") == "b"  # waiting counts


def test_cache_aware_follows_the_longest_prefix_then_load():
    policy = CacheAware(PrefixTree(), cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = "system: doc A\nuser: hi\n"
    assert policy.choose(loads(2, 0), first) == "http://w1"  # a miss: the least loaded
    assert policy.choose(loads(0, 3), first + "user: x") == "http://w1"  # 23 of 30 characters held by w1
    assert policy.choose(loads(0, 3), first + "assistant: a longer answer here") == "http://w0"  # 23 of 54: a miss
    assert policy.choose(loads(0, 3), "an unrelated prompt") == "http://w0"
    # balance lost (7 - 0 > 4 and 7 > 0 x 1.5): the least loaded, whatever the cache
    assert policy.choose(loads(0, 7), first + "user: y") == "http://w0"
    assert policy.tree.match(first + "user: y") == {"http://w0": 30, "http://w1": 29}


def test_prefix_tree_matches_per_worker_and_splits_edges():
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    tree.insert("help", "a")
    assert tree.match("hello world!") == {"a": 11, "b": 6}
    assert tree.match("hello thermos") == {"a": 6, "b": 10}
    assert tree.match("help me") == {"a": 4, "b": 3}
    assert tree.match("goodbye") == {}
    assert tree.sizes == {"a": len("hello world") + 1, "b": len("hello there")}  # "hel" + "lo" + " world" + "p"


def test_prefix_tree_size_bound_evicts_the_least_recently_used_per_worker():
    tree = PrefixTree(max_chars=30)  # past 30 characters a worker's oldest leaves go, down to 27
    tree.insert("a" * 10 + "first", "w")
    tree.insert("b" * 10 + "second", "w")  # 31: "a...first" (the older) goes
    assert tree.sizes["w"] == 16 and tree.match("aaaaaaaaaafirst") == {}
    tree.insert("a" * 10 + "first", "w")  # 31 again: now "b...second" is the older
    assert tree.sizes["w"] == 15 and tree.match("bbbbbbbbbbsecond") == {}
    tree.insert("c" * 10 + "third", "other")
    tree.insert("d" * 10 + "fourth", "w")
    assert tree.sizes["w"] == 16 and tree.match("ddddddddddfourth") == {"w": 16}
    assert tree.match("aaaaaaaaaafirst") == {} and tree.match("ccccccccccthird") == {"other": 15}
    tree.remove_worker("w")
    assert "w" not in tree.sizes and tree.match("ddddddddddfourth") == {} and tree.sizes == {"other": 15}
    assert len(tree.root.children) == 1  # the nodes nobody holds are gone


def test_routing_text_of_chats_and_completions():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
                                                                                             "text": "U"}]}]}
    assert routing_text(chat) == "system\nS\nuser\nU\n"
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["abc", "def"]}) == "abc"
    short, longer = routing_text({"prompt": [1, 2, 3]}), routing_text({"prompt": [1, 2, 3, 4]})
    assert longer.startswith(short)  # token ids share their prefix as text
    assert routing_text({"prompt": 7}) == "" and routing_text({"messages": "x"}) == ""


def test_routing_text_keys_images_by_their_url():
    """An image part routes by a digest of its URL (a data: URL: of the image's bytes), so chats with the same text
    and different images share only the text before the image, and the same image and text route alike."""
    def chat(url: str) -> dict:
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is it?"}]}]}
    a, b = routing_text(chat("data:image/png;base64,AAAA")), routing_text(chat("data:image/png;base64,AAAB"))
    assert a != b and a.startswith("user\nlook") and b.startswith("user\nlook")
    assert a == routing_text(chat("data:image/png;base64,AAAA")) and a.endswith("what is it?\n")
    assert len(routing_text(chat("data:image/png;base64," + "A" * 100_000))) < 100


def test_bad_options_are_errors():
    assert worker_url("http://10.0.0.1:8000/") == "http://10.0.0.1:8000"
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAware(PrefixTree(), cache_threshold=2)
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(0)


@pytest.mark.parametrize("urls, message", [
    (["localhost:8000"], "bad worker URL 'localhost:8000'"),
    (["http://a:99999"], "bad worker URL 'http://a:99999': the port"),
    (["http://a:8000/v1"], "no path"),
    (["http://a:8000", "http://a:8000/"], "lists http://a:8000 more than once"),
    ([], "expected at least one argument"),
])
def test_bad_worker_urls_exit_with_the_url_named(urls, message, capsys):
    with pytest.raises(SystemExit) as exit:
        router_main(["--worker-urls", *urls])
    assert exit.value.code == 2 and message in capsys.readouterr().err


# -- over HTTP ---------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_worker(name: str, state: dict) -> FastAPI:
    """A worker answering with its name; `state["break"]` makes its streams die after two chunks."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response('jaxserve:num_requests_waiting{model_name="m"} 0.0\n')

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": name}]}

    async def generate(request: Request) -> Response:
        body = await request.json()
        state.setdefault("seen", []).append(request.headers.get("authorization"))
        if body.get("max_tokens") == -1:
            return JSONResponse({"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}}, status_code=400)
        if state.get("hang"):  # answers nothing until the caller hangs up, as a long generation
            if body.get("stream"):
                return EventStreamResponse(hang(state))
            await wait_for_disconnect(request.receive)
            state["gone"] = True
            return Response()
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": name}]})

        async def events():
            for index in range(3):
                if index == 2 and state.get("break"):
                    raise RuntimeError("the worker died")
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f'{name}{index}'}]})}\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.post("/v1/completions")(generate)
    app.post("/v1/chat/completions")(generate)
    return app


async def hang(state: dict) -> AsyncIterator[str]:
    """One event, then nothing until the stream is closed."""
    try:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'first'}]})}\n\n"
        await asyncio.Event().wait()
    finally:
        state["gone"] = True


class ThreadServer:
    """A uvicorn server in a thread, on `port`."""

    def __init__(self, app: FastAPI, port: int, lifespan: str = "off"):
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                                    lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the fake worker did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def workers():
    states = [{}, {}]
    ports = [free_port(), free_port()]
    servers = [ThreadServer(fake_worker(f"w{i}", states[i]), port) for i, port in enumerate(ports)]
    yield [f"http://127.0.0.1:{port}" for port in ports], states, servers
    for server in servers:
        server.stop()


def through_router(urls: list[str], policy: str, check, interval: float = 0.05) -> None:
    """Runs the router app (in process) over `urls` around `check(http, pool)`, health checks every `interval`."""

    async def main() -> None:
        client = httpx.AsyncClient(timeout=httpx.Timeout(30.0))
        pool = WorkerPool(urls, client, interval=interval, failure_threshold=2, check_timeout=2.0)
        app = create_router_app(pool, make_policy(policy), client)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=30) as http:
                await check(http, pool)

    asyncio.run(main())


async def until(condition, what: str) -> None:
    """Polls `condition` (the health-check loop runs meanwhile) for up to 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_requests_pass_through_streamed_and_whole(workers):
    urls, states, _ = workers

    async def check(http: httpx.AsyncClient, pool) -> None:
        assert (await http.get("/health")).status_code == 200
        whole = [await http.post(path, json={"model": "m", "prompt": "hi", "messages": [], "max_tokens": 2},
                                 headers={"Authorization": "Bearer k"})
                 for path in ("/v1/completions", "/v1/chat/completions")]
        assert [w.json()["choices"][0]["text"] for w in whole] == ["w0", "w1"]  # round robin
        assert [w.headers["x-jaxserve-worker"] for w in whole] == urls
        streamed = await http.post("/v1/chat/completions", json={"messages": [], "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert sse_data(streamed.text)[-1] == "[DONE]" and json.loads(sse_data(streamed.text)[0])["choices"]
        refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
        malformed = await http.post("/v1/completions", content=b"{not json")
        assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
        assert (await http.post("/v1/completions", json=[1])).status_code == 400
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "m"
        assert states[0]["seen"][0] == "Bearer k"
        metrics = (await http.get("/metrics")).text
        assert f'jaxserve_router:requests_total{{worker="{urls[0]}"}} 2.0' in metrics
        assert f'jaxserve_router:worker_healthy{{worker="{urls[1]}"}} 1.0' in metrics
        assert f'jaxserve_router:requests_in_flight{{worker="{urls[0]}"}} 0.0' in metrics

    through_router(urls, "round_robin", check)


def test_a_dead_worker_is_retried_ejected_and_rejoins(workers):
    urls, states, servers = workers

    async def check(http: httpx.AsyncClient, pool) -> None:
        servers[0].stop()
        # round robin sends the next request to the dead worker: it cannot connect, so the other one answers
        answers = [await http.post("/v1/completions", json={"prompt": "hi"}) for _ in range(4)]
        assert [a.json()["choices"][0]["text"] for a in answers] == ["w1"] * 4
        assert not pool.workers[urls[0]].healthy
        metrics = (await http.get("/metrics")).text
        assert f'jaxserve_router:retries_total{{worker="{urls[0]}"}} 1.0' in metrics
        assert f'jaxserve_router:ejections_total{{worker="{urls[0]}"}} 1.0' in metrics
        servers[0] = ThreadServer(fake_worker("w0 again", states[0]), servers[0].port)
        await pool.check_all()  # the next health check
        assert pool.workers[urls[0]].healthy
        texts = {(await http.post("/v1/completions", json={"prompt": "hi"})).json()["choices"][0]["text"]
                 for _ in range(2)}
        assert texts == {"w0 again", "w1"}

    through_router(urls, "round_robin", check, interval=3600)  # only the checks the test makes


def test_no_healthy_worker_is_a_503(workers):
    urls, _, servers = workers

    async def check(http: httpx.AsyncClient, pool) -> None:
        for server in servers:
            server.stop()
        await until(lambda: not pool.healthy(), "both workers were ejected")
        health = await http.get("/health")
        assert health.status_code == 503 and health.headers["Retry-After"]
        refused = await http.post("/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"

    through_router(urls, "shortest_queue", check)


def test_a_stream_broken_mid_way_ends_with_an_error_event(workers):
    urls, states, _ = workers
    states[0]["break"] = states[1]["break"] = True

    async def check(http: httpx.AsyncClient, pool) -> None:
        streamed = await http.post("/v1/completions", json={"prompt": "hi", "stream": True})
        events = sse_data(streamed.text)
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["w00", "w01"]
        failure = json.loads(events[2])["error"]
        assert failure["code"] == "worker_failed" and urls[0] in failure["message"] and events[3] == "[DONE]"
        assert pool.workers[urls[0]].in_flight == 0

    through_router(urls, "round_robin", check)


def test_cache_aware_keeps_a_conversation_on_one_worker(workers):
    urls, _, _ = workers

    async def check(http: httpx.AsyncClient, pool) -> None:
        served = []
        for conversation in ("doc one " * 20, "doc two " * 20):
            messages = [{"role": "system", "content": conversation}]
            for turn in range(4):
                messages.append({"role": "user", "content": f"question {turn}"})
                answer = await http.post("/v1/chat/completions", json={"messages": messages})
                messages.append({"role": "assistant", "content": answer.json()["choices"][0]["text"]})
                served.append(answer.headers["x-jaxserve-worker"])
        assert served[:4] == [served[0]] * 4 and served[4:] == [served[4]] * 4

    through_router(urls, "cache_aware", check)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_ends_its_request_on_the_worker(workers, stream):
    urls, states, _ = workers
    states[0]["hang"] = True
    client = httpx.AsyncClient(timeout=600)  # longer than the wait below: only the hang-up may end the request
    pool = WorkerPool(urls[:1], client, interval=3600)
    router = ThreadServer(create_router_app(pool, make_policy("round_robin"), client), free_port(), "on")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{router.port}", timeout=30) as http:
            deadline = time.monotonic() + 30
            while http.get("/health").status_code != 200:  # the first health check
                assert time.monotonic() < deadline
                time.sleep(0.02)
        body = json.dumps({"prompt": "hi", "stream": stream}).encode()
        deadline = time.monotonic() + 30
        with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:  # a client that will hang up
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            if stream:
                received = b""
                while b"data: " not in received:  # the first event came through
                    received += sock.recv(4096)
            else:
                while not states[0].get("seen"):  # the worker has it; no answer will come
                    assert time.monotonic() < deadline, "the request did not reach the worker"
                    time.sleep(0.02)
        deadline = time.monotonic() + 30
        while not states[0].get("gone"):
            assert time.monotonic() < deadline, "the worker's request stayed open after the client left"
            time.sleep(0.02)
        while pool.workers[urls[0]].in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        router.stop()

"""The benchmark client's own cost: CPU seconds per streamed chunk and per request, `jaxserve bench serve`'s aiohttp
client (its keep-alive pool, and a connection per request) against an httpx client (the one benchmarks/serving.py
had), all reading the same SSE streams.

A fake OpenAI server in a second process streams `--chunks` completion chunks per request as fast as it can; the
client process measures its own CPU time (time.process_time) while it streams `--requests` requests,
`--concurrency` at a time. The server's CPU is not counted.

    python benchmarks/client_overhead.py --requests 64 --chunks 256 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench import client

NAME = "client-overhead"
SERVER = '''
import json, sys, uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
app, chunks = FastAPI(), int(sys.argv[2])
line = ("data: " + json.dumps({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": " tok",
        "logprobs": None, "finish_reason": None}], "usage": None}) + "\\n\\n").encode()
@app.post("/v1/completions")
async def completions():
    async def stream():
        for _ in range(chunks):
            yield line
        yield b"data: [DONE]\\n\\n"
    return StreamingResponse(stream(), media_type="text/event-stream")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
'''


async def with_httpx(url: str, body: dict[str, Any], requests: int, concurrency: int) -> int:
    """The httpx streaming loop: aiter_lines and json.loads per chunk; returns the chunks read."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def one() -> int:
            count = 0
            async with gate, http.stream("POST", url, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        count += bool(client.chunk_text(json.loads(line[5:]), client.COMPLETIONS))
            return count

        return sum(await asyncio.gather(*(one() for _ in range(requests))))


async def with_aiohttp(url: str, body: dict[str, Any], requests: int, concurrency: int, fresh: bool = False) -> int:
    """jaxserve bench serve's own path (client.run_benchmark; `fresh`: a new connection for every request);
    returns the chunks read."""
    base, endpoint = url.rsplit(client.COMPLETIONS, 1)[0], client.COMPLETIONS
    session = client.open_session(fresh=True) if fresh else None
    try:
        results, _ = await client.run_benchmark(base, endpoint, [body] * requests, [1] * requests, float("inf"),
                                                1.0, concurrency, 0, disable_tqdm=True, session=session)
    finally:
        if session is not None:
            await session.close()
    assert all(r.success for r in results), {r.error for r in results}
    return sum(len(r.itl) + 1 for r in results)


async def with_fresh_connections(url: str, body: dict[str, Any], requests: int, concurrency: int) -> int:
    return await with_aiohttp(url, body, requests, concurrency, fresh=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=256, help="chunks per streamed request")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per client, alternating; the median is kept")
    common.add_common_args(parser)
    argv, args = common.start(parser, argv)
    from benchmarks.run_default_suite import free_port, stop_server

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.chunks)])
    url = f"http://127.0.0.1:{port}"
    body = {"model": "fake", "prompt": [1], "max_tokens": args.chunks, "stream": True}
    try:
        for _ in range(100):
            try:
                asyncio.run(with_aiohttp(url + client.COMPLETIONS, body, 1, 1))
                break
            except (AssertionError, OSError):
                time.sleep(0.1)
        clients = (("httpx", with_httpx), ("aiohttp", with_aiohttp),
                   ("aiohttp, a connection per request", with_fresh_connections))
        runs: dict[str, list[float]] = {name: [] for name, _ in clients}
        for _ in range(args.repeats):
            for name, run in clients:
                cpu = time.process_time()
                chunks = asyncio.run(run(url + client.COMPLETIONS, body, args.requests, args.concurrency))
                cpu = time.process_time() - cpu
                assert chunks == args.requests * args.chunks, (name, chunks)
                runs[name].append(1e6 * cpu / chunks)
    finally:
        stop_server(server)
    median = {name: sorted(values)[len(values) // 2] for name, values in runs.items()}
    print(common.format_table(["client", "CPU us per chunk (median)", "CPU us per request", "runs (us per chunk)"],
                              [[name, median[name], median[name] * args.chunks,
                                " ".join(f"{v:.1f}" for v in runs[name])] for name in runs]))
    fresh = median["aiohttp, a connection per request"] / median["aiohttp"]
    print(f"httpx / aiohttp: {median['httpx'] / median['aiohttp']:.2f}x; a connection per request / the pool: "
          f"{fresh:.2f}x")
    payload = {"requests": args.requests, "chunks": args.chunks, "concurrency": args.concurrency,
               "cpu_us_per_chunk": runs, "median_us_per_chunk": median,
               "ratio_httpx_over_aiohttp": median["httpx"] / median["aiohttp"],
               "ratio_fresh_connections_over_pool": fresh}
    print(f"result: {common.write_result(NAME, payload, args.result_file, argv)}")
    return payload


if __name__ == "__main__":
    main()

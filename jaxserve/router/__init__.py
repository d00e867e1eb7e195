"""`jaxserve router`: one OpenAI-compatible front for several `jaxserve serve` workers, on any hosts.

It routes and forwards; it does not start or supervise the workers (systemd, Kubernetes or a shell does). Files:
`policies` (round_robin, shortest_queue, cache_aware over load snapshots), `prefix_tree` (the approximate radix
tree cache_aware reads), `workers` (health checks, ejection, requests in flight), `app` (the FastAPI forwarding),
`metrics` (Prometheus). Usage and a two-host example: docs/router.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import urllib.parse

UPSTREAM_KEEPALIVE_S = 2.0  # idle connections to the workers live this long (httpx's default, 5 s, is uvicorn's)


def worker_url(value: str) -> str:
    """An http(s)://host[:port] URL, normalized (no trailing slash); argparse errors name the bad value."""
    parsed = urllib.parse.urlsplit(value)
    try:
        port = parsed.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad worker URL {value!r}: the port is not a number in 0-65535") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"bad worker URL {value!r}: expected http://HOST[:PORT] or https://...")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise argparse.ArgumentTypeError(f"bad worker URL {value!r}: no path, query or fragment (the router adds "
                                         "/v1/...)")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{parsed.scheme}://{host}" + (f":{port}" if port is not None else "")


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.router.policies import POLICIES

    parser = argparse.ArgumentParser(prog="jaxserve router", description="Route OpenAI requests over several "
                                     "jaxserve servers.")
    parser.add_argument("--worker-urls", nargs="+", type=worker_url, required=True, metavar="URL",
                        help="the workers, e.g. http://10.0.0.1:8000 http://10.0.0.2:8000")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--health-check-interval", type=float, default=5.0, help="seconds between health checks")
    parser.add_argument("--health-failure-threshold", type=int, default=2,
                        help="failed health checks in a row that eject a worker")
    parser.add_argument("--cache-threshold", type=float, default=0.5,
                        help="cache_aware: the share of a request's text a worker must hold to get it")
    parser.add_argument("--balance-abs-threshold", type=float, default=32,
                        help="cache_aware: load difference (requests) past which balance beats cache")
    parser.add_argument("--balance-rel-threshold", type=float, default=1.5,
                        help="cache_aware: ... and load ratio past which balance beats cache")
    parser.add_argument("--max-tree-size", type=int, default=2**22,
                        help="cache_aware: characters of routed text remembered per worker (LRU beyond)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    return parser


def router_main(argv: list[str] | None = None) -> None:
    """Parses `jaxserve router` options and serves until SIGTERM/SIGINT."""
    import httpx
    import uvicorn

    from jaxserve.router.app import create_router_app
    from jaxserve.router.policies import make_policy
    from jaxserve.router.prefix_tree import PrefixTree
    from jaxserve.router.workers import WorkerPool
    from jaxserve.server.api_server import run_uvicorn

    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    duplicates = sorted({url for url in args.worker_urls if args.worker_urls.count(url) > 1})
    if duplicates:
        parser.error(f"--worker-urls lists {duplicates[0]} more than once")
    if args.health_check_interval <= 0:
        parser.error("--health-check-interval must be > 0")
    try:
        policy = make_policy(args.policy, PrefixTree(args.max_tree_size), cache_threshold=args.cache_threshold,
                             balance_abs_threshold=args.balance_abs_threshold,
                             balance_rel_threshold=args.balance_rel_threshold)
        # streams have no read timeout: a long answer may pause between tokens as long as the worker takes; idle
        # connections are dropped before a worker's own keep-alive timeout (5 s) could close one under a request
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0, write=30.0),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                       keepalive_expiry=UPSTREAM_KEEPALIVE_S))
        pool = WorkerPool(args.worker_urls, client, args.health_check_interval, args.health_failure_threshold)
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_router_app(pool, policy, client, args.max_body_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=30,
                                           log_level="info"))
    status = run_uvicorn(server) or (0 if server.started else 1)
    logging.shutdown()
    if status:
        sys.exit(status)


__all__ = ["router_main"]

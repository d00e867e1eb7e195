"""jaxserve's OpenAI-compatible HTTP server: `jaxserve serve ...` runs `serve_main`.

Files, one idea each: `protocol` (request models), `async_engine` (the engine thread <-> asyncio
bridge, admission control), `output_collector` (bounded per-request output buffers that merge
deltas), `serving_completion` / `serving_chat` (the two generation routes), `serving` (shared route
helpers), `http_utils` (body parsing, SSE, disconnect detection), `middleware` (body limit, API
key), `metrics` (Prometheus + the periodic stats line), `errors` (OpenAI's error JSON), `api_server`
(app factory, routes, uvicorn), `cli_args` (vLLM's options).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def serve_main(argv: list[str]) -> None:
    """Parses `jaxserve serve` options, starts the HTTP server at once and loads the engine in the background."""
    from jaxserve.server.api_server import create_app
    from jaxserve.server.async_engine import AsyncEngine
    from jaxserve.server.cli_args import (build_parser, config_file_args, engine_config, model_argument, multihost,
                                          server_settings)

    parser = build_parser()
    try:
        args = parser.parse_args(config_file_args(argv, parser))
        args.model = model_argument(args)
    except ValueError as err:
        parser.error(str(err))
    if args.max_waiting < 0:
        parser.error("--max-waiting must be >= 0")
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.nnodes > 1:
        parser.error("--data-parallel-size > 1 is not supported with --nnodes > 1 yet (run one server per host "
                     "behind vllm-router)")
    try:
        hosts = multihost(args)
    except ValueError as err:
        parser.error(str(err))
    # vLLM's --gpu-memory-utilization is a fraction of the device: let jax's allocator (0.75 of it by default)
    # reach it; this and jax.distributed must happen before jax starts its backend (the engine resolving its config)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.gpu_memory_utilization))
    if hosts.enabled:
        hosts.initialize()
    try:
        config = engine_config(args)
        settings = server_settings(args)
        if hosts.enabled and config.speculative_config is not None:
            raise ValueError("--speculative-config is not supported with --nnodes > 1 yet")
    except ValueError as err:
        parser.error(str(err))
    if hosts.enabled and not hosts.is_leader:
        _follow(config, hosts)  # never returns
    if args.data_parallel_size > 1:
        try:
            async_engine = _replicas(config, args.data_parallel_size, args.max_waiting, args.load_balance_method)
        except ValueError as err:
            parser.error(str(err))
        _run(create_app(async_engine, settings), async_engine, args)
        return
    leader = None

    def build_engine():
        from jaxserve.engine.llm_engine import LLMEngine

        llm_engine = LLMEngine(config)
        if leader is not None:
            leader.wait_for_followers()
            llm_engine.runner.steps.on_call = leader.send
        return llm_engine

    async_engine = AsyncEngine(build_engine, max_waiting=args.max_waiting)
    if hosts.enabled:
        from jaxserve.distributed.multihost import PlanLeader

        leader = PlanLeader(hosts, on_lost=async_engine.peer_lost)
    _run(create_app(async_engine, settings), async_engine, args, leader)


def _run(app, async_engine, args, leader=None) -> None:
    from jaxserve.server.api_server import run_server

    status = run_server(app, async_engine, args.host, args.port, shutdown_timeout=args.shutdown_timeout)
    if leader is not None:  # the followers exit when told; jax.distributed's shutdown would wait for them
        leader.close(status)
        logging.shutdown()
        os._exit(status)
    if async_engine.thread_alive:  # still loading or compiling: do not wait for it (or crash tearing it down)
        logger.warning("the engine thread is still busy; exiting without it")
        logging.shutdown()
        os._exit(status)
    logging.shutdown()
    if status:
        sys.exit(status)


def _replicas(config, size: int, max_waiting: int, load_balance_method: str):
    """A `DataParallelEngine` of `size` replicas of `config`, replica i on the i-th group of tensor_parallel_size
    devices (each with its own KV-tier folder); ValueError if the devices are too few."""
    import dataclasses
    import functools
    import threading

    import jax

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.async_engine import AsyncEngine
    from jaxserve.server.data_parallel import DataParallelEngine

    needed, visible = size * config.tensor_parallel_size, len(jax.devices())
    if needed > visible:
        raise ValueError(f"--data-parallel-size {size} x --tensor-parallel-size {config.tensor_parallel_size} needs "
                         f"{needed} devices, but only {visible} are visible ({jax.default_backend()})")
    one_at_a_time = threading.Lock()  # the first to load writes the converted-weights cache the others read

    def build(replica_config):
        with one_at_a_time:
            return LLMEngine(replica_config)

    replicas = []
    for rank in range(size):
        kv_dir = config.kv_offloading_dir and os.path.join(config.kv_offloading_dir, f"replica-{rank}")
        replica_config = dataclasses.replace(config, data_parallel_rank=rank, kv_offloading_dir=kv_dir)
        replicas.append(AsyncEngine(functools.partial(build, replica_config), max_waiting=max_waiting, replica=rank))
    return DataParallelEngine(replicas, load_balance_method)


def _follow(config, hosts) -> None:
    """A follower host: builds the same engine as the leader (loading and warm-up run in step with it), then
    runs the calls the leader sends until it stops."""
    from jaxserve.distributed.multihost import follow
    from jaxserve.engine.llm_engine import LLMEngine

    try:
        llm_engine = LLMEngine(config)
    except BaseException:
        logger.exception("follower rank %d failed to build its engine", hosts.node_rank)
        logging.shutdown()
        os._exit(1)
    follow(llm_engine.runner, hosts)


__all__ = ["serve_main"]

"""`jaxserve bench`: the benchmarks a user runs on a GPU or TPU instance, shipped in the package (vLLM's
`vllm bench serve | throughput | latency`, with its flags and result keys). `serve` drives any OpenAI-compatible
server by URL; `throughput` and `latency` build the engine in-process. Datasets are `datasets.py`, the metric
math `metrics.py`, the HTTP client `client.py`."""

from __future__ import annotations

import sys
from typing import Sequence

SUBCOMMANDS = ("serve", "throughput", "latency")


def bench_main(argv: Sequence[str]) -> None:
    argv = list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: jaxserve bench {{{','.join(SUBCOMMANDS)}}} [options]   (jaxserve bench COMMAND --help)")
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from jaxserve.bench.serve import main

        main(rest)
    elif command == "throughput":
        from jaxserve.bench.offline import throughput_main

        throughput_main(rest)
    else:
        from jaxserve.bench.offline import latency_main

        latency_main(rest)

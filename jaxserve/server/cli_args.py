"""`jaxserve serve` options: the engine's (vLLM's names) and the server's."""

from __future__ import annotations

import argparse
import os

from jaxserve.engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve serve", description="Serve a model over an OpenAI-compatible API.")
    parser.add_argument("--model", default=None, help="HF checkpoint dir, .gguf file or converted store (default: "
                                                      "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="decode slots")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's, <= 2048)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="prefill tokens per engine step (padded to their buckets; decodes come on top)")
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    engine.add_argument("--num-kv-pages", type=int, default=None, help="KV-cache pages (default: from memory)")
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    engine.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--attention-backend", choices=("xla", "pallas", "pallas-interpret"), default=None)
    server = parser.add_argument_group("server")
    server.add_argument("--max-waiting", type=int, default=256,
                        help="sequences allowed to wait beyond the running ones; more get 503 + Retry-After")
    server.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXSERVE_API_KEY)")
    server.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model, "
                                                                   "or the default model's name)")
    server.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM before being aborted")
    server.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between throughput log lines (0: off)")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                        num_kv_pages=args.num_kv_pages, enable_prefix_caching=args.enable_prefix_caching,
                        dtype=args.dtype, seed=args.seed, attention_backend=args.attention_backend)

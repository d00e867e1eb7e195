"""`jaxserve serve` options: the engine's and the server's, under vLLM's flag names and meanings, so a vLLM
command line keeps working (`--gpu-memory-utilization`, `--block-size`, `--enable-prefix-caching`,
`--served-model-name`, `--chat-template`, `--scheduling-policy`, `--tokenizer`, `--generation-config`, ...).
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import os

from jaxserve.distributed.multihost import MultiHost
from jaxserve.engine.config import DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, EngineConfig
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS
from jaxserve.layers.attention import ATTENTION_BACKENDS
from jaxserve.loading import DEFAULT_MODEL
from jaxserve.options import LOAD_FORMATS
from jaxserve.server.api_server import ServerSettings
from jaxserve.server.data_parallel import LOAD_BALANCE_METHODS
from jaxserve.server.lora_modules import RUNTIME_UPDATING_ENV, parse_lora_module

JINJA_CHARS = "{}\n"  # a --chat-template value with any of these is a template, not a file name (as vLLM)
ENGINE_DEFAULTS = {field.name: field.default for field in dataclasses.fields(EngineConfig)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve serve", description="Serve a model over an OpenAI-compatible API.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model takes it (vLLM's `vllm serve MODEL`)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="flags from a YAML file of flag names (vLLM's --config); the command line wins")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_engine_args(parser)
    engine = parser.add_argument_group("replicas")
    engine.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine replicas in this server, each over its own tensor_parallel_size devices (so "
                             "data_parallel_size x tensor_parallel_size devices in all), with its own KV cache")
    engine.add_argument("--load-balance-method", choices=LOAD_BALANCE_METHODS, default="cache_aware",
                        help="which replica takes a request: the longest prefix-cache hit (ties by load), in turn, "
                             "or the least loaded")
    hosts = parser.add_argument_group("multi-host (sglang-jax's flags; every host runs the same command)")
    hosts.add_argument("--nnodes", type=int, default=1, help="hosts serving the model together")
    hosts.add_argument("--node-rank", type=int, default=0, help="this host's rank; rank 0 serves HTTP")
    hosts.add_argument("--dist-init-addr", default=None,
                       help="HOST:PORT of rank 0 for jax.distributed (the plan channel uses PORT+1)")
    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the names clients may use; the first is reported in responses (default: --model as "
                             f"given, else {DEFAULT_MODEL})")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters clients choose by `model`: name=path, or JSON {\"name\": ..., \"path\": "
                             "..., \"base_model_name\": ...} (needs --enable-lora; " + RUNTIME_UPDATING_ENV +
                             "=true also serves /v1/load_lora_adapter and /v1/unload_lora_adapter)")
    server.add_argument("--chat-template", type=chat_template, default=None,
                        help="a Jinja chat template, or a file holding one, used instead of the tokenizer's")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto" (needs --tool-call-parser)')
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                        help="the model's tool-call format, for tool_choice \"auto\" (hermes: Qwen2.5/Qwen3/Hermes)")
    server.add_argument("--max-waiting", type=int, default=256,
                        help="sequences allowed to wait beyond the running ones (per replica); more get 503 + Retry-After")
    server.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXSERVE_API_KEY)")
    server.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM before being aborted")
    server.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between throughput log lines (0: off)")
    return parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--model and every engine flag (what `engine_config` reads): `jaxserve serve`'s and the offline benchmarks'."""
    parser.add_argument("--model", default=None,
                        help="a hub id ORG/NAME (ORG/NAME:QUANT for one GGUF file of a repository), a HF checkpoint "
                             f"dir, a .gguf file or a converted store (default: the embedded {DEFAULT_MODEL})")
    hub = parser.add_argument_group("the hub (huggingface_hub's cache and environment: HF_HUB_CACHE, HF_TOKEN, "
                                    "HF_ENDPOINT, HF_HUB_OFFLINE=1)")
    hub.add_argument("--revision", default=None, help="the model's branch, tag or commit (default: main)")
    hub.add_argument("--tokenizer-revision", default=None, help="the tokenizer's branch, tag or commit")
    hub.add_argument("--download-dir", default=None, help="where snapshots go (default: huggingface_hub's cache)")
    hub.add_argument("--gguf-file", default=None, help="which GGUF file of a GGUF repository to serve")
    hub.add_argument("--trust-remote-code", action="store_true",
                     help="vLLM's flag, accepted: jaxserve runs no code from a repository, and refuses by name a "
                          "model that needs its own")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    engine.add_argument("--generation-config", default=ENGINE_DEFAULTS["generation_config"],
                        help="sampling defaults for fields a request leaves unset: 'auto' (the model's "
                             "generation_config.json), 'vllm' (none) or a folder holding generation_config.json")
    engine.add_argument("--load-format", choices=LOAD_FORMATS, default=ENGINE_DEFAULTS["load_format"],
                        help="'auto': the checkpoint's weights; 'dummy': random weights drawn on the devices (the "
                             "model needs only its config.json), for timing a model whose weights are absent")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=ENGINE_DEFAULTS["tensor_parallel_size"],
                        help="devices (over all hosts) the weights, heads and KV pages are split over")
    engine.add_argument("--enable-expert-parallel", action="store_true",
                        help="a mixture-of-experts model's experts split over those devices by expert (each holds "
                             "num_experts / N of them); default: every expert split like the dense MLP")
    engine.add_argument("--max-num-seqs", type=int, default=ENGINE_DEFAULTS["max_num_seqs"], help="decode slots")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's, <= 2048)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS["max_num_batched_tokens"],
                        help="prefill tokens per engine step (padded to their buckets; decodes come on top)")
    engine.add_argument("--block-size", type=int, default=ENGINE_DEFAULTS["page_size"],
                        help="tokens per KV-cache page (block); default: 16, or the attention backend's smallest "
                             "page where that is larger (a TPU's with int8/fp8 pages: 128)")
    engine.add_argument("--num-kv-pages", type=int, default=None, help="KV-cache pages (default: from memory)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=ENGINE_DEFAULTS["gpu_memory_utilization"],
                        help="fraction of accelerator memory for weights, KV cache and activations")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=ENGINE_DEFAULTS["enable_prefix_caching"], help="reuse KV pages of shared prompt "
                                                                                "prefixes")
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="bytes of KV cache per device (default: from --gpu-memory-utilization; on a CPU, "
                             "enough for every slot)")
    engine.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="one KV pool for every layer, even where sliding-window layers could keep only their "
                             "window's pages")
    engine.add_argument("--mamba-block-size", type=int, default=None,
                        help="linear-attention models under prefix caching: tokens between kept states, where a "
                             "prefix hit can end (a multiple of 64 and of the page size; default lcm(256, page size))")
    engine.add_argument("--num-state-checkpoints", type=int, default=None,
                        help="linear-attention models under prefix caching: states kept for prefix hits (default "
                             "2 x --max-num-seqs)")
    engine.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB of host memory for KV pages under the prefix cache (a host tier; default: none)")
    engine.add_argument("--kv-offloading-dir", default=None,
                        help="directory for KV pages on disk, kept across restarts (a disk tier; default: none)")
    engine.add_argument("--kv-offloading-disk-size", type=float, default=ENGINE_DEFAULTS["kv_offloading_disk_size"],
                        help="GiB the disk tier's files may take (least recently used removed first)")
    engine.add_argument("--kv-events-config", default=None,
                        help='prefix-cache events for KV-aware routers, vLLM\'s JSON: '
                             '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
                             '(needs jaxserve[router])')
    engine.add_argument("--kv-transfer-config", default=None,
                        help='prefill/decode disaggregation behind vllm-router --vllm-pd-disaggregation, vLLM\'s JSON: '
                             '\'{"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer"}\' (or kv_consumer, '
                             'kv_both; kv_ip: an address the other workers reach)')
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=ENGINE_DEFAULTS["async_scheduling"],
                        help="dispatch each engine step before reading the previous one's tokens "
                             "(--no-async-scheduling: one step at a time, for debugging)")
    engine.add_argument("--detokenizer-process", action=argparse.BooleanOptionalAction,
                        default=ENGINE_DEFAULTS["detokenizer_process"],
                        help="detokenize and search stop strings in a second process, off the stepping thread")
    engine.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                        default=ENGINE_DEFAULTS["scheduling_policy"],
                        help="'priority': requests' `priority` field orders them (lower first); 'slo': prefill "
                             "work by slack to each request's TTFT target, with decode protection for TPOT targets")
    engine.add_argument("--ttft-slo-ms", type=float, default=None,
                        help="time-to-first-token target of requests that set no ttft_slo_ms (goodput; 'slo' "
                             "schedules by it)")
    engine.add_argument("--tpot-slo-ms", type=float, default=None,
                        help="time-per-output-token target of requests that set no tpot_slo_ms")
    engine.add_argument("--slo-max-wait-ms", type=float, default=ENGINE_DEFAULTS["slo_max_wait_ms"],
                        help="'slo': a request waiting this long goes before every request that waited less")
    engine.add_argument("--long-prefill-token-threshold", type=int,
                        default=ENGINE_DEFAULTS["long_prefill_token_threshold"],
                        help="a prefill chunk has at most this many tokens, and a prompt with more left is long "
                             "(0: no cap; default 4%% of max-model-len when --max-num-partial-prefills > 1; under "
                             "'slo', each step's own from the latency targets and the measured step costs)")
    engine.add_argument("--max-num-partial-prefills", type=int, default=ENGINE_DEFAULTS["max_num_partial_prefills"],
                        help="prefills sharing one step's token budget equally (1: the budget stays whole)")
    engine.add_argument("--max-long-partial-prefills", type=int,
                        default=ENGINE_DEFAULTS["max_long_partial_prefills"],
                        help="long prompts prefilling at once, so shorter ones go past them")
    engine.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto: float32 on a CPU, bfloat16 on an accelerator; half/float16 are served as "
                             "bfloat16; float/float32; bfloat16")
    engine.add_argument("--quantization", "-q", default=None, choices=[q for q in QUANTIZATIONS if q],
                        help="weights: int8 (W8A16, quantized at load), fp8 (FP8 in 128x128 blocks, quantized at "
                             "load; block-scaled FP8 checkpoints such as DeepSeek-V3's load as FP8) or awq (AutoAWQ "
                             "4-bit); AWQ and FP8 checkpoints are detected from config.json when the flag is unset")
    engine.add_argument("--kv-cache-dtype", default=ENGINE_DEFAULTS["kv_cache_dtype"],
                        help="KV pages: auto (the model dtype), int8 or fp8 (e4m3)")
    engine.add_argument("--seed", type=int, default=ENGINE_DEFAULTS["seed"])
    engine.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\' or \'{"model": DRAFT, "num_speculative_tokens": 4}\'')
    engine.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                        help="default: pallas on GPU, pallas-tpu on TPU, xla on CPU")
    images = parser.add_argument_group("images (vLLM's flags)")
    images.add_argument("--limit-mm-per-prompt", type=json_object, default=None,
                        help='the most images one prompt may have, as JSON: \'{"image": 4}\' (default: as many as '
                             "fit --max-model-len)")
    images.add_argument("--mm-processor-kwargs", type=json_object, default=None,
                        help='options for the model\'s image processor, as JSON: \'{"max_pixels": 802816}\' (the '
                             "largest image after resizing; it also bounds the vision tower's compiled shapes)")
    images.add_argument("--allowed-local-media-path", default=None,
                        help="file: image URLs are read only under this folder (default: refused)")
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
    lora.add_argument("--max-loras", type=int, default=ENGINE_DEFAULTS["max_loras"],
                      help="adapters one step can run (their device slots)")
    lora.add_argument("--max-lora-rank", type=int, default=ENGINE_DEFAULTS["max_lora_rank"],
                      help="the largest adapter rank served")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept read in host memory (default: --max-loras)")


def json_object(value: str) -> dict:
    """A flag's JSON object; ArgumentTypeError naming what is wrong."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return parsed


def chat_template(value: str) -> str:
    """A --chat-template value as vLLM reads it: a file's content, or else the template itself (backslash
    escapes such as \\n decoded). Raises ArgumentTypeError for a missing file or a template that does not parse."""
    try:
        with open(value, encoding="utf-8") as file:
            template = file.read()
    except OSError as err:
        if not any(char in value for char in JINJA_CHARS):
            raise argparse.ArgumentTypeError(f"{value!r} looks like a file name, but cannot be read: {err}") from None
        template = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise argparse.ArgumentTypeError(f"not a valid Jinja template: {err}") from None
    return template


def config_file_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with the flags of its `--config FILE` (vLLM's YAML: flag names, dashes or underscores, as keys) put
    first, so the command line's own flags win (its MODEL or --model over the file's `model`); ValueError for a
    file that cannot be read, is no mapping, or names a flag `parser` does not have."""
    import yaml

    if "--config" not in argv and not any(arg.startswith("--config=") for arg in argv):
        return argv
    config_parser = argparse.ArgumentParser(add_help=False)
    config_parser.add_argument("--config")
    known, rest = config_parser.parse_known_args(argv)
    try:
        with open(known.config) as handle:
            values = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--config {known.config}: {err}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {known.config}: expected a mapping of flag names to values")
    positional = rest[:1] if rest and not rest[0].startswith("-") else []  # first: a list flag would take it
    if positional or "--model" in rest:
        values.pop("model", None)
    options = parser._option_string_actions
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in options:
            raise ValueError(f"--config {known.config}: {key!r} is not a flag of {parser.prog}")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags += ["--no-" + flag[2:]] if "--no-" + flag[2:] in options else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return positional + flags + rest[len(positional):]


def model_argument(args: argparse.Namespace) -> str | None:
    """The model from the positional MODEL or --model (both only when equal); ValueError otherwise."""
    tag, flag = getattr(args, "model_tag", None), args.model
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"the model is given twice: {tag!r} and --model {flag!r}")
    return tag or flag


def served_model_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name, else --model as given, else the default model's name: known before loading."""
    return list(args.served_model_name or [args.model or DEFAULT_MODEL])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; ValueError for out-of-range values."""
    return EngineConfig(model=args.model, tokenizer=args.tokenizer, generation_config=args.generation_config,
                        revision=args.revision, tokenizer_revision=args.tokenizer_revision,
                        download_dir=args.download_dir, gguf_file=args.gguf_file,
                        trust_remote_code=args.trust_remote_code,
                        load_format=args.load_format,
                        tensor_parallel_size=args.tensor_parallel_size,
                        enable_expert_parallel=args.enable_expert_parallel,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.block_size,
                        num_kv_pages=args.num_kv_pages, gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
                        ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                        slo_max_wait_ms=args.slo_max_wait_ms,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        max_num_partial_prefills=args.max_num_partial_prefills,
                        max_long_partial_prefills=args.max_long_partial_prefills,
                        kv_offloading_size=args.kv_offloading_size, kv_offloading_dir=args.kv_offloading_dir,
                        kv_offloading_disk_size=args.kv_offloading_disk_size, kv_events_config=args.kv_events_config,
                        kv_transfer_config=args.kv_transfer_config,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                        mamba_block_size=args.mamba_block_size, num_state_checkpoints=args.num_state_checkpoints,
                        dtype=args.dtype, seed=args.seed, attention_backend=args.attention_backend,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        async_scheduling=args.async_scheduling, speculative_config=args.speculative_config,
                        detokenizer_process=args.detokenizer_process, enable_lora=args.enable_lora,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                        limit_mm_per_prompt=args.limit_mm_per_prompt, mm_processor_kwargs=args.mm_processor_kwargs,
                        allowed_local_media_path=args.allowed_local_media_path)


def multihost(args: argparse.Namespace) -> MultiHost:
    """The multi-host flags; ValueError for inconsistent ones."""
    return MultiHost(nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """ValueError if the tool-call flags are inconsistent (vLLM's rule: each needs the other)."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    lora_modules = [parse_lora_module(value) for value in args.lora_modules or []]
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return ServerSettings(served_model_names=served_model_names(args), chat_template=args.chat_template,
                          lora_modules=lora_modules,
                          tool_call_parser=args.tool_call_parser,
                          api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          log_stats_interval=args.log_stats_interval)

"""`EngineConfig`: every engine option (vLLM's names where one exists), frozen. Constructing one checks its values
and nothing else; `resolve()` returns the complete config an engine runs with: the defaults that depend on the
platform and the model filled in, the speculative config parsed, and the quantization checked against the
checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

from jaxserve.engine.buckets import power_of_two_buckets
from jaxserve.engine.kv_connector import KVTransferConfig
from jaxserve.engine.kv_events import KVEventsConfig
from jaxserve.options import KV_CACHE_DTYPES, LOAD_FORMATS
from jaxserve.spec_decode.config import CPU_DISABLE_BY_BATCH_SIZE, SpeculativeConfig

logger = logging.getLogger(__name__)

PREFILL_ROWS = 4  # chunks packed into one prefill call when they share a length bucket
DECODE_BATCH_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256)
# awq: AutoAWQ 4-bit checkpoints (jaxserve/loading/awq.py); fp8: weights in FP8 blocks (jaxserve/layers/fp8.py)
QUANTIZATIONS = (None, "int8", "awq", "fp8")
SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
LONG_PREFILL_FRACTION = 0.04  # vLLM's default long_prefill_token_threshold, of max_model_len
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices


def serving_dtype(requested: str | None, checkpoint: str | None, platform: str) -> tuple[str, str]:
    """The dtype the engine serves in ("float32" or "bfloat16") for `requested` (DTYPES, None for auto), the
    checkpoint's own dtype (config.json's, None when it says none) and `platform`, with why."""
    have = f"the checkpoint is {checkpoint}" if checkpoint else "the checkpoint names no dtype"
    if requested in ("float", "float32"):
        return "float32", "asked for"
    if requested == "bfloat16":
        return "bfloat16", "asked for"
    if requested in ("half", "float16"):
        return "bfloat16", "float16 asked for; jaxserve serves half precision as bfloat16 (its kernels' and KV " \
                           "pages' 16-bit type: the same bytes, float32's range)"
    if platform == "cpu":
        return "float32", f"auto on a CPU ({have}; XLA:CPU runs bfloat16 several times slower than float32)"
    return "bfloat16", f"auto on {platform} ({have}; 16-bit weights read at half float32's bytes)"


def _positive_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf)


def _int_at_least(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def default_cache_dir(name: str) -> str:
    """`name` under jaxserve's cache root: $JAXSERVE_CACHE_ROOT if set (as vLLM's VLLM_CACHE_ROOT), else
    ~/.cache/jaxserve."""
    return os.path.join(os.environ.get("JAXSERVE_CACHE_ROOT") or "~/.cache/jaxserve", name)


def default_compilation_cache_dir() -> str | None:
    """jax's persistent compilation cache under the cache root, or None (off) where $JAXSERVE_DISABLE_COMPILE_CACHE
    is 1 (as vLLM's VLLM_DISABLE_COMPILE_CACHE)."""
    return None if os.environ.get("JAXSERVE_DISABLE_COMPILE_CACHE") == "1" else default_cache_dir("xla")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model; a directory, a .gguf file or a hub id ORG/NAME
    tokenizer: str | None = None  # a tokenizer directory or hub id to use instead of the model's
    # a hub id's branch, tag or commit (vLLM's names; default main), the tokenizer's, and where snapshots go
    # (default: huggingface_hub's cache, $HF_HUB_CACHE); gguf_file: the file of a GGUF repository to serve
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    trust_remote_code: bool = False  # vLLM's flag, accepted; a model whose code lives only in its repo is refused
    generation_config: str = "auto"  # "auto": the model's generation_config.json, "vllm": ignore it, or a folder
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random weights drawn on the devices
    tensor_parallel_size: int = 1  # devices the weights, heads and KV pages are split over (Megatron-style)
    # which replica of a data-parallel server this engine is: it runs on devices [rank * tp, (rank + 1) * tp)
    data_parallel_rank: int = 0
    # a mixture of experts: its experts split over those devices by expert (vLLM's name), else inside each expert
    enable_expert_parallel: bool = False
    max_num_seqs: int = 64  # decode slots
    max_model_len: int | None = None  # default: min(model's max_position_embeddings, 2048)
    page_size: int | None = None  # tokens per KV page; default: the backend's (`PagedAttention.default_page_size`)
    num_kv_pages: int | None = None  # default: from gpu_memory_utilization (accelerators) or enough for all slots (CPU)
    gpu_memory_utilization: float = 0.9  # fraction of the device memory jax may use, for weights + KV + activations
    max_num_batched_tokens: int = 512  # prefill tokens per step, padded to their buckets (decodes come on top)
    enable_prefix_caching: bool = True
    # KV tiers under the prefix cache (engine/kv_tiers.py), vLLM's names: GiB of host memory for cached pages, and a
    # directory whose files keep them across restarts (at most kv_offloading_disk_size GiB)
    kv_offloading_size: float | None = None
    kv_offloading_dir: str | None = None
    kv_offloading_disk_size: float = 64.0
    # vLLM's kv_events_config (`engine/kv_events.py`): prefix-cache events over ZMQ for KV-aware routers
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    # vLLM's kv_transfer_config (`engine/kv_connector.py`): prefill/decode disaggregation, this worker's role
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    # bytes each device gives the KV pools (vLLM's kv_cache_memory_bytes); default: from gpu_memory_utilization on
    # an accelerator, enough for every slot on a CPU
    kv_cache_memory_bytes: int | None = None
    # vLLM's: one pool for every layer even where sliding-window layers could keep only their window's pages
    disable_hybrid_kv_cache_manager: bool = False
    # prefix caching for models with linear-attention layers (`engine/state_checkpoints.py`): their state is kept
    # every mamba_block_size tokens (vLLM's name; a multiple of 64 and of page_size; default lcm(256, page_size))
    # in num_state_checkpoints rows (default 2 * max_num_seqs)
    mamba_block_size: int | None = None
    num_state_checkpoints: int | None = None
    # vLLM's choices (DTYPES); "auto"/None: float32 on a CPU, bfloat16 on an accelerator (`serving_dtype`)
    dtype: str | None = None
    # weights: None (the serving dtype), "int8" (W8A16, per output channel), "awq", "fp8" (W8A16 in 128x128 blocks)
    quantization: str | None = None
    # (an AutoAWQ checkpoint's 4-bit weights; set from the checkpoint's config.json when left None)
    kv_cache_dtype: str = "auto"  # KV pages: "auto" (the serving dtype), "int8" (per-token scales) or "fp8" (e4m3)
    attention_backend: str | None = None  # "xla" | "pallas" | "pallas-interpret" | "pallas-tpu" |
    # "pallas-tpu-interpret"; default pallas on GPU, pallas-tpu on TPU, xla on CPU
    seed: int = 0
    # "fcfs", "priority" (lower value first, aged so nothing starves) or "slo" (by slack to each request's latency
    # targets, `engine/slo.py`)
    scheduling_policy: str = "fcfs"
    priority_aging_seconds: float = 10.0  # waiting this long counts as one priority level
    # latency targets of requests that set none (SamplingParams.ttft_slo_ms / tpot_slo_ms): measured for goodput
    # under every policy, scheduled by under "slo"
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    slo_max_wait_ms: float = 10_000.0  # "slo": a sequence waiting this long goes before all that waited less
    # vLLM's chunked-prefill limits (any policy): a chunk has at most long_prefill_token_threshold tokens (0: no
    # cap; default 4% of max_model_len when max_num_partial_prefills > 1; under "slo", each step's own from the
    # targets and the measured step costs, `engine/slo.py`) and a prompt with more left is "long";
    # with max_num_partial_prefills > 1, that many prefills share a step's budget, at most max_long_partial_prefills
    # of them long
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    decode_batch_buckets: tuple[int, ...] | None = None  # default: 1, 4, 8, 16, 32, 64, 128, 256 up to max_num_seqs
    # the smallest prefill chunk bucket (then twice as many tokens, up to max_num_batched_tokens); default 16 on a
    # CPU, 64 on an accelerator, where a forward of 64 tokens or fewer is bound by reading the weights and costs
    # what one of 16 does, and each bucket is two shapes more to compile at start-up
    smallest_prefill_bucket: int | None = None
    async_scheduling: bool = True  # dispatch step t+1 before reading step t's tokens (False: one step at a time)
    # vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 2} or {"model": DRAFT, "num_speculative_tokens": K} (see spec_decode/config.py)
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # detokenize and search stop strings in a second process, off the stepping thread (off by default: on a CPU the
    # loop shares its cores with XLA's threads and gains nothing; not yet measured on a GPU; benchmarks/RESULTS.md)
    detokenizer_process: bool = False
    # LoRA adapters (vLLM's names): requests may run with an adapter (`LoRARequest`); max_loras of them share a
    # step (the device stack's slots), each of rank <= max_lora_rank, and max_cpu_loras (default: max_loras) stay
    # read in host memory
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # images (vLLM's names): at most `limit_mm_per_prompt["image"]` images in one prompt (None: as many as fit
    # max_model_len); `mm_processor_kwargs` go to the model's image processor (e.g. {"max_pixels": 802816}: the
    # largest image after resizing, which also bounds the vision tower's compiled shapes); file: image URLs are read
    # only under `allowed_local_media_path`
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    allowed_local_media_path: str | None = None
    warmup: bool = True  # compile every shape at start-up
    # jax's persistent compilation cache (None disables it); default: $JAXSERVE_CACHE_ROOT/xla, ~/.cache/jaxserve/xla
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)

    def __post_init__(self) -> None:
        checks = [
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "must be >= 1"),
            ("data_parallel_rank", _int_at_least(self.data_parallel_rank, 0), "must be an integer >= 0"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("page_size", self.page_size is None or (_int_at_least(self.page_size, 1)
                                                     and self.page_size & (self.page_size - 1) == 0),
             "must be a power of two"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 16, "must be >= 16"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            ("dtype", self.dtype is None or self.dtype in DTYPES, f"must be one of {DTYPES}"),
            ("scheduling_policy", self.scheduling_policy in SCHEDULING_POLICIES,
             f"must be one of {SCHEDULING_POLICIES}"),
            ("ttft_slo_ms", _positive_or_none(self.ttft_slo_ms), "must be a number > 0 (milliseconds)"),
            ("tpot_slo_ms", _positive_or_none(self.tpot_slo_ms), "must be a number > 0 (milliseconds)"),
            ("slo_max_wait_ms", _positive_or_none(self.slo_max_wait_ms) and self.slo_max_wait_ms is not None,
             "must be a number > 0 (milliseconds)"),
            ("long_prefill_token_threshold", _int_at_least(self.long_prefill_token_threshold, 0),
             "must be an integer >= 0"),
            ("max_num_partial_prefills", _int_at_least(self.max_num_partial_prefills, 1), "must be an integer >= 1"),
            ("max_long_partial_prefills", _int_at_least(self.max_long_partial_prefills, 1)
             and self.max_long_partial_prefills <= self.max_num_partial_prefills,
             f"must be an integer >= 1 and <= max_num_partial_prefills ({self.max_num_partial_prefills})"),
            ("quantization", self.quantization in QUANTIZATIONS, f"must be one of {QUANTIZATIONS}"),
            ("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"must be one of {KV_CACHE_DTYPES}"),
            ("load_format", self.load_format in LOAD_FORMATS, f"must be one of {LOAD_FORMATS}"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2, "must be >= 2"),
            ("kv_offloading_size", self.kv_offloading_size is None or self.kv_offloading_size >= 0, "must be >= 0"),
            ("kv_offloading_disk_size", self.kv_offloading_disk_size > 0, "must be > 0"),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "must be > 0"),
            ("enable_prefix_caching", self.enable_prefix_caching or not self.kv_tiers,
             "must be on for the KV tiers (kv_offloading_size / kv_offloading_dir)"),
            ("mamba_block_size", self.mamba_block_size is None or (
                _int_at_least(self.mamba_block_size, 64) and self.mamba_block_size % 64 == 0
                and self.mamba_block_size % (self.page_size or 1) == 0),
             f"must be a multiple of 64 and of page_size ({self.page_size})"),
            ("num_state_checkpoints", self.num_state_checkpoints is None or _int_at_least(self.num_state_checkpoints, 1),
             "must be an integer >= 1"),
            ("max_loras", _int_at_least(self.max_loras, 1), "must be an integer >= 1"),
            ("max_lora_rank", _int_at_least(self.max_lora_rank, 1), "must be an integer >= 1"),
            ("max_cpu_loras", self.max_cpu_loras is None or (_int_at_least(self.max_cpu_loras, 1)
                                                             and self.max_cpu_loras >= self.max_loras),
             f"must be an integer >= max_loras ({self.max_loras})"),
            ("smallest_prefill_bucket", self.smallest_prefill_bucket is None
             or (_int_at_least(self.smallest_prefill_bucket, 1)
                 and self.smallest_prefill_bucket & (self.smallest_prefill_bucket - 1) == 0),
             "must be a power of two"),
            ("decode_batch_buckets", self.decode_batch_buckets is None or max(self.decode_batch_buckets, default=0)
             >= self.max_num_seqs, f"must reach max_num_seqs ({self.max_num_seqs})"),
        ]
        for field, ok, message in checks:
            if not ok:
                raise ValueError(f"{field} {message}, got {getattr(self, field)!r}")
        SpeculativeConfig.parse(self.speculative_config)  # its checks; resolve() parses it with the platform's defaults
        if self.kv_events is not None and not self.enable_prefix_caching:
            raise ValueError("kv_events_config needs prefix caching (its events are the prefix cache's)")
        _ = self.kv_transfer  # its checks
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            if modality != "image":
                raise ValueError(f"limit_mm_per_prompt: modality {modality!r} is not supported (jaxserve takes images)")
            if not _int_at_least(limit, 0):
                raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {limit!r}")
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict, got {self.mm_processor_kwargs!r}")

    def localized(self, what: str = "model") -> "EngineConfig":
        """This config with a hub id's model and tokenizer replaced by their snapshots in the hub cache, fetched if
        need be (`loading/hub.py`; `what`: "model", or only its "config" for `jaxserve compile`)."""
        from jaxserve.loading import hub

        model, tokenizer = self.model, self.tokenizer
        if hub.is_hub_id(model):
            found = hub.snapshot(model, self.revision, self.download_dir, what, self.gguf_file)
            model = str(found.path / found.gguf_file if found.gguf_file else found.path)
        if hub.is_hub_id(tokenizer):
            tokenizer = str(hub.snapshot(tokenizer, self.tokenizer_revision, self.download_dir, "tokenizer").path)
        speculative = self.speculative_config
        parsed = SpeculativeConfig.parse(speculative)
        if parsed is not None and hub.is_hub_id(parsed.model):  # a draft model's or an EAGLE-3 head's repository
            found = hub.snapshot(parsed.model, parsed.revision, self.download_dir, what)
            local = {"model": str(found.path / found.gguf_file if found.gguf_file else found.path), "revision": None}
            speculative = (dataclasses.replace(speculative, **local) if isinstance(speculative, SpeculativeConfig)
                           else {**(json.loads(speculative) if isinstance(speculative, str) else speculative),
                                 **local})  # unparsed, so resolve() still sets the platform's defaults
        return dataclasses.replace(self, model=model, tokenizer=tokenizer, speculative_config=speculative)

    def resolve(self, model_max_len: int, platform: str | None = None) -> "EngineConfig":
        """The complete config for a model of context `model_max_len` on `platform` (default: jax's backend):
        dtype and attention backend defaults, max_model_len, decode buckets, the parsed speculative config (which
        turns async scheduling off), and the quantization an AWQ checkpoint sets. Resolving twice changes nothing."""
        import jax
        import jax.numpy as jnp

        from jaxserve.layers.attention import make_attention_backend
        from jaxserve.loading.awq import check_quantization
        from jaxserve.loading.hf_files import checkpoint_dtype

        platform = platform or jax.default_backend()
        dtype = self.dtype
        if dtype not in ("float32", "bfloat16"):
            dtype, why = serving_dtype(dtype, checkpoint_dtype(self.model), platform)
            logger.info("serving in %s: %s", dtype, why)
        if dtype == "bfloat16" and platform == "cpu":
            logger.warning("dtype=bfloat16 on a CPU: XLA:CPU runs bfloat16 elementwise work and one-row matmuls "
                           "slowly (measured about 7x slower offline, 30x single-stream); float32 is the CPU dtype")
        speculative = SpeculativeConfig.parse(self.speculative_config,
                                              CPU_DISABLE_BY_BATCH_SIZE if platform == "cpu" else None)
        if self.kv_tiers and speculative is not None and speculative.has_pool:
            raise ValueError(f"kv_offloading_size / kv_offloading_dir do not work with speculative method "
                             f"{speculative.method!r} yet (its own KV pool is not copied to the tiers); n-gram "
                             "speculation works with them")
        async_scheduling = self.async_scheduling
        if speculative is not None and async_scheduling:
            # as vLLM for n-gram proposals: a step's drafts need the previous step's tokens on the host
            logger.info("speculative decoding runs its steps synchronously: async scheduling is off")
            async_scheduling = False
        max_model_len = self.max_model_len or min(model_max_len, 2048)
        threshold = self.long_prefill_token_threshold
        if self.max_num_partial_prefills > 1 and threshold == 0:
            threshold = int(max_model_len * LONG_PREFILL_FRACTION)
        if threshold > max_model_len:  # vLLM's rule
            raise ValueError(f"long_prefill_token_threshold ({threshold}) cannot be greater than max_model_len "
                             f"({max_model_len})")
        # a step costs about its bucket's rows, while each bucket adds one forward to compile at start-up
        # (benchmarks/RESULTS.md has the measurements behind this list)
        buckets = self.decode_batch_buckets or tuple(sorted({min(b, self.max_num_seqs) for b in DECODE_BATCH_BUCKETS}
                                                            | {self.max_num_seqs}))
        backend = self.attention_backend or {"gpu": "pallas", "tpu": "pallas-tpu"}.get(platform, "xla")
        page_size = self.page_size or make_attention_backend(backend, None, self.kv_cache_dtype).default_page_size(
            jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
        return dataclasses.replace(
            self, dtype=dtype, attention_backend=backend, page_size=page_size,
            speculative_config=speculative, async_scheduling=async_scheduling,
            max_model_len=max_model_len, decode_batch_buckets=buckets, long_prefill_token_threshold=threshold,
            smallest_prefill_bucket=self.smallest_prefill_bucket or (16 if platform == "cpu" else 64),
            # as vLLM: an AWQ checkpoint sets "awq"; a mismatch with the checkpoint is an error before any load
            quantization=check_quantization(self.model, self.quantization, self.tensor_parallel_size))

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The parsed `kv_transfer_config` (None: no prefill/decode disaggregation)."""
        config = self.kv_transfer_config
        return config if config is None or isinstance(config, KVTransferConfig) else KVTransferConfig.parse(config)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed `kv_events_config` when its events are enabled."""
        config = self.kv_events_config
        if config is not None and not isinstance(config, KVEventsConfig):
            config = KVEventsConfig.parse(config)
        return config if config is not None and config.enable_kv_cache_events else None

    @property
    def state_checkpoint_interval(self) -> int:
        """Tokens between a linear-attention model's state checkpoints (`mamba_block_size`, or its default)."""
        return self.mamba_block_size or math.lcm(256, self.page_size)

    @property
    def state_checkpoints(self) -> int:
        """Rows of a linear-attention model's state checkpoints (`num_state_checkpoints`, or its default)."""
        return self.num_state_checkpoints or 2 * self.max_num_seqs

    @property
    def kv_tiers(self) -> bool:
        """Whether cached pages are kept off the device too (host memory, disk)."""
        return self.kv_offloading_size is not None or self.kv_offloading_dir is not None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    @property
    def jax_dtype(self):
        import jax.numpy as jnp

        return jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        smallest = min(self.smallest_prefill_bucket or 16, self.max_num_batched_tokens)
        return power_of_two_buckets(smallest, self.max_num_batched_tokens)

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, tokens) of the compiled prefill steps: one chunk of any bucket, or PREFILL_ROWS short ones.

        Packing several prompts' chunks into one call multiplies the matmuls' rows, and short matmuls run
        far below the rate of long ones (figures in benchmarks/RESULTS.md).
        """
        packed = tuple((PREFILL_ROWS, tokens) for tokens in self.prefill_buckets
                       if PREFILL_ROWS * tokens <= self.max_num_batched_tokens)
        return tuple((1, tokens) for tokens in self.prefill_buckets) + packed

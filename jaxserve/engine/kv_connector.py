"""Prefill/decode disaggregation (vLLM's `--kv-transfer-config`), the host side: the configuration, and the
`kv_transfer_params` a request carries from the prefill worker to the decode worker, checked.

vLLM's NixlConnector protocol, which `vllm-router --vllm-pd-disaggregation` drives: the router sends the request to
a prefill worker (kv_producer) with max_tokens=1 and `kv_transfer_params: {"do_remote_decode": true}`; that worker
computes the prompt's KV, leaves the pages for pulling, and its response's `kv_transfer_params` say where
(`do_remote_prefill`, `remote_host`, `remote_port`, `remote_engine_id`, `remote_block_ids`; ours: the transfer id,
the tokens and pages sent, the prompt's digest and the KV layout). The router hands them, with the original
request, to a decode worker (kv_consumer), which pulls the pages straight into its pool and computes the last
prompt token itself, as vLLM's decode workers do, so sampling, logprobs and grammars apply unchanged there. The
pull itself is `jax_transfer_connector.py`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NamedTuple

import numpy as np

from jaxserve.engine.kv_events import config_from_json

CONNECTORS = ("JaxTransferConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
EXTRA_CONFIG = {"abort_timeout_s": 480.0, "pull_timeout_s": 60.0}  # vLLM's abort timeout for unpulled pages


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `KVTransferConfig`: the connector, this worker's role, where its transfer server listens (port 0: any
    free port; the address travels in `kv_transfer_params`, so it must be one the decode workers reach), the bytes of
    each device's memory the KV plan leaves for pages in transit (`kv_buffer_size`, vLLM's field and default; at
    least one longest prompt's pages), and in `kv_connector_extra_config` how long unpulled pages are kept
    (`abort_timeout_s`) and how long a decode worker waits for a pull before computing the prompt itself
    (`pull_timeout_s`)."""

    kv_connector: str = "JaxTransferConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    engine_id: str | None = None
    kv_buffer_size: float = 1e9
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector must be one of {list(CONNECTORS)}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config kv_role must be one of {list(ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config kv_port must be a port number, got {self.kv_port!r}")
        if isinstance(self.kv_buffer_size, bool) or not isinstance(self.kv_buffer_size, (int, float)) \
                or not self.kv_buffer_size >= 0:
            raise ValueError(f"kv_transfer_config kv_buffer_size must be a number of bytes >= 0, "
                             f"got {self.kv_buffer_size!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config kv_ip must be a host address, got {self.kv_ip!r}")
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_CONFIG)) if isinstance(extra, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config takes {sorted(EXTRA_CONFIG)}, "
                             f"got {extra!r}")
        for name in EXTRA_CONFIG:
            value = extra.get(name, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"kv_transfer_config {name} must be a number of seconds > 0, got {value!r}")

    @classmethod
    def parse(cls, text: str | dict) -> KVTransferConfig:
        return config_from_json(cls, text, "--kv-transfer-config")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def seconds(self, name: str) -> float:
        return float(self.kv_connector_extra_config.get(name, EXTRA_CONFIG[name]))


class RemotePrefill(NamedTuple):
    """Where a decode worker pulls a request's pages from, and what it pulls: `num_pages` pages (padded to
    `bucket` rows) holding the KV of the prompt's first `num_tokens` tokens."""

    host: str
    port: int
    engine_id: str
    transfer_id: int
    num_tokens: int
    num_pages: int
    bucket: int


class ReceivedKV(NamedTuple):
    """A decode worker's pulled pages: the KV of the prompt's first `num_tokens` tokens in the first `num_pages`
    rows of one device array per kind of the pool's leaves (`[bucket, 2 * layers, heads, page_size(, head_dim)]`)."""

    num_tokens: int
    num_pages: int
    arrays: tuple


class Receive(NamedTuple):
    """A step's write of received pages into the pool: per row of `received`'s arrays, the page it goes to (the
    scratch page for a row the sequence's device prefix-cache hit already holds, and for padding)."""

    received: ReceivedKV
    pages: tuple[int, ...]


def receive_into(received: ReceivedKV, page_table: list[int], first_page: int) -> Receive:
    """The write of `received` into a newly admitted sequence's `page_table` from `first_page` on (the pages before
    it hold its prefix-cache hit and keep their contents; rows not written go to the scratch page 0)."""
    pages = [0] * len(received.arrays[0])
    pages[first_page:received.num_pages] = page_table[first_page:received.num_pages]
    return Receive(received, tuple(pages))


def adapter_key(seq: Any) -> str | None:
    """A sequence's LoRA adapter by its weights' key (None: the base model)."""
    return seq.lora.key.hex() if seq.lora is not None else None


def prompt_digest(token_ids: list[int], adapter: str | None) -> str:
    """What both workers must agree on for the KV to be the same: the prompt's tokens and the adapter."""
    digest = hashlib.sha256(np.asarray(token_ids, np.int64).tobytes())
    digest.update((adapter or "").encode())
    return digest.hexdigest()


def transfer_kind(params: dict[str, Any] | None, config: KVTransferConfig | None) -> str | None:
    """What a request's `kv_transfer_params` ask of this worker: "send" (prefill for a remote decode), "pull"
    (decode after a remote prefill) or None; ValueError when this worker's role cannot do it."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    kind = "send" if params.get("do_remote_decode") else "pull" if params.get("do_remote_prefill") else None
    if kind is None:
        return None
    if config is None:
        raise ValueError("kv_transfer_params ask for a KV transfer, but this server runs without "
                         "--kv-transfer-config")
    if kind == "send" and not config.is_producer or kind == "pull" and not config.is_consumer:
        raise ValueError(f"kv_transfer_params ask this worker to {'prefill for' if kind == 'send' else 'decode after'}"
                         f" another, but its kv_role is {config.kv_role!r}")
    return kind


def producer_params(address: str, engine_id: str, transfer_id: int, pages: list[int], num_tokens: int,
                    bucket: int, digest: str, layout: dict[str, Any]) -> dict[str, Any]:
    """The prefill response's `kv_transfer_params`: vLLM's fields and ours."""
    host, port = address.rsplit(":", 1)
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": int(port), "remote_block_ids": list(pages),
            "tp_size": layout["tensor_parallel_size"], "transfer_id": transfer_id, "num_tokens": num_tokens,
            "bucket": bucket, "prompt_digest": digest, "layout": layout}


def remote_prefill(params: dict[str, Any], layout: dict[str, Any], buckets: tuple[int, ...],
                   prompt_token_ids: list[int], adapter: str | None, page_size: int) -> RemotePrefill:
    """The pull a decode request's `kv_transfer_params` describe, checked against this worker: ValueError naming a
    missing or bad field, a layout (model, page size, dtypes, parallelism) unlike this worker's, or a prompt unlike
    the one the prefill worker computed."""
    def field(name: str, kind: type) -> Any:
        value = params.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params {name} must be a {kind.__name__}, got {value!r}")
        return value

    theirs = field("layout", dict)
    for name, mine in layout.items():
        if theirs.get(name) != mine:
            raise ValueError(f"kv_transfer_params: the prefill worker's {name} {theirs.get(name)!r} differs from this "
                             f"worker's {mine!r} (both must serve the same model with the same KV layout)")
    if field("prompt_digest", str) != prompt_digest(prompt_token_ids, adapter):
        raise ValueError("kv_transfer_params: the prefill worker computed a different prompt or adapter than this "
                         "request's (do both workers apply the same chat template and tokenizer?)")
    num_tokens, bucket = field("num_tokens", int), field("bucket", int)
    if num_tokens != len(prompt_token_ids) - 1:
        raise ValueError(f"kv_transfer_params num_tokens must be the prompt's length - 1 "
                         f"({len(prompt_token_ids) - 1}), got {num_tokens}")
    num_pages = -(-num_tokens // page_size)
    if bucket not in buckets or bucket < num_pages:
        raise ValueError(f"kv_transfer_params bucket {bucket} is not one of this worker's transfer sizes {buckets} "
                         f"holding {num_pages} pages")
    port = field("remote_port", int)
    if not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params remote_port must be a port number, got {port}")
    transfer_id = field("transfer_id", int)
    if not 0 <= transfer_id < 2**63:
        raise ValueError(f"kv_transfer_params transfer_id must be a 63-bit id, got {transfer_id}")
    return RemotePrefill(field("remote_host", str), port, str(params.get("remote_engine_id")), transfer_id,
                         num_tokens, num_pages, bucket)

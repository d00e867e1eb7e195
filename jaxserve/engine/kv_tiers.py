"""The KV tiers under the device prefix cache: a host-memory pool of pages (`HostTier`, LRU by bytes) and, below it,
an optional disk tier (`engine/kv_disk.py`), with the lookups that continue a device prefix match into them and the
per-tier counters (`KVTiers`). Host bookkeeping only; the copies between the device pool and host memory are
`engine/kv_tier_copies.py`'s.

Policy: write-through. Every page the device prefix cache registers is copied to the host tier (and from there to
the disk tier) within a step of being computed, so a page evicted from the device needs no copy at that moment and
an engine that dies loses at most the pages of its last moments; the host tier is inclusive of the device's cached
pages, so it pays when it is larger than the device pool.

Exactness does not rest on the hash: each tier page carries every token id of the sequence up to its end (`prefix`),
and a lookup takes it only if they equal the sequence's. Its chain key (`page_manager.page_key`) only finds it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Protocol

import numpy as np

logger = logging.getLogger(__name__)

TIERS = ("host", "disk")


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype for a jax dtype name (bfloat16 and float8_e4m3fn through ml_dtypes, which jax brings)."""
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name, name))


@dataclasses.dataclass(frozen=True, eq=False)
class TierPage:
    """One page's K/V for every layer, off the device: `arrays` one per group of the pool's leaves (the values of
    every layer's K and V `[2 * layers, heads, page_size, head_dim]`, and a quantized pool's scales
    `[2 * layers, heads, page_size]`), under its chain key, with the token ids from the sequence's start to the
    page's end as the prefix cache keys them (`Sequence.key_tokens`: an image's placeholders as keys of the image)."""

    key: bytes
    prefix: np.ndarray  # int64 [tokens up to the page's end]: token ids, or an image placeholder's (negative) key
    arrays: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return self.prefix.nbytes + sum(array.nbytes for array in self.arrays)

    def holds(self, token_ids: np.ndarray) -> bool:
        """Whether this page holds the K/V of `token_ids`' first `len(prefix)` tokens (exactly: every token equal)."""
        return len(token_ids) >= len(self.prefix) and np.array_equal(token_ids[:len(self.prefix)], self.prefix)


class LowerTier(Protocol):
    """A tier below the host's (the disk's, `engine/kv_disk.py`): pages by key, checked, and its own counters."""

    def read(self, key: bytes) -> TierPage | None: ...
    def submit(self, page: TierPage, since: float) -> None: ...
    def usage(self) -> tuple[int, int]: ...  # (bytes used, capacity bytes)
    def transfers(self) -> tuple[tuple[str, int, int, float], ...]: ...  # as SchedulerStats.kv_transfers


def run_jobs(jobs: queue.Queue, owner: weakref.ref, handle: Callable[[Any, Any], None], failure: str) -> None:
    """A tier thread's loop: `handle(owner, job)` for each job until a None, holding the owner only while handling
    (so an owner nobody else holds is collected, and its finalizer's None stops the loop); a failed job is logged
    (`failure`), never fatal."""
    while (job := jobs.get()) is not None:
        target = owner()
        try:
            if target is not None:
                handle(target, job)
        except Exception:  # a lost tier copy, never a stopped engine
            logger.exception(failure)
        finally:
            target = job = None
            jobs.task_done()
    jobs.task_done()


@dataclasses.dataclass(frozen=True)
class PageToStore:
    """A page the device prefix cache just registered, to be copied to the tiers once its step has run."""

    page: int
    key: bytes
    prefix: np.ndarray


class HostTier:
    """Pages in host memory by chain key, least recently used first, at most `capacity_bytes` in all. Filled by the
    transfer thread, read by the scheduling thread: every access takes the lock."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._pages: OrderedDict[bytes, TierPage] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pages

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._pages)

    def get(self, key: bytes) -> TierPage | None:
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
            return page

    def put(self, page: TierPage) -> None:
        """Keeps `page` (most recently used), evicting the least recently used pages past the byte bound; a page
        larger than the whole tier is not kept."""
        with self._lock:
            old = self._pages.pop(page.key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            if page.nbytes > self.capacity_bytes:
                return
            self._pages[page.key] = page
            self.used_bytes += page.nbytes
            while self.used_bytes > self.capacity_bytes:
                _, evicted = self._pages.popitem(last=False)
                self.used_bytes -= evicted.nbytes


@dataclasses.dataclass
class TierCounters:
    """One tier's running totals: prompt tokens looked up in it (those the tiers above missed) and found."""

    queries: int = 0
    hits: int = 0


class KVTiers:
    """The host tier, the disk tier (or None) and what the device prefix cache hands them: the pages registered
    since the transfer thread last took them (`pending`), and the lookups continuing a device match."""

    def __init__(self, host: HostTier, disk: LowerTier | None, page_size: int,
                 hash_fn: Callable[[bytes, tuple[int, ...]], bytes]):
        self.host = host
        self.disk = disk
        self.page_size = page_size
        self.hash_fn = hash_fn
        self.pending: list[PageToStore] = []
        self.counters = {tier: TierCounters() for tier in TIERS}

    def note_registered(self, page: int, key: bytes, token_ids: list[int], end: int) -> None:
        """A page holding `token_ids[:end]`'s last page was registered on the device: copy it unless held already."""
        if key not in self.host:
            self.pending.append(PageToStore(page, key, np.asarray(token_ids[:end], np.int64)))

    def take_pending(self) -> list[PageToStore]:
        pending, self.pending = self.pending, []
        return pending

    def lookup(self, token_ids: list[int], first_page: int, parent_key: bytes,
               max_pages: int) -> list[tuple[TierPage, str]]:
        """The tier pages holding `token_ids`' pages `first_page`, `first_page + 1`, ... (at most `max_pages`), each
        with the tier it was read from, following the chain from `parent_key` (the key of the page before, b"" for
        none); stops at the first miss. A disk hit is promoted to the host tier."""
        if max_pages <= 0:
            return []
        tokens = np.asarray(token_ids, np.int64)
        found: list[tuple[TierPage, str]] = []
        size = self.page_size
        for index in range(first_page, first_page + max_pages):
            key = self.hash_fn(parent_key, tuple(token_ids[index * size:(index + 1) * size]))
            page, tier = self.host.get(key), "host"
            if page is None and self.disk is not None:
                page, tier = self.disk.read(key), "disk"
                if page is not None and page.holds(tokens):
                    self.host.put(page)
            if page is None or not page.holds(tokens):
                break
            found.append((page, tier))
            parent_key = key
        return found

    def count(self, num_queried: int, found: list[tuple[TierPage, str]]) -> None:
        """One admitted sequence's lookup: `num_queried` prompt tokens past its device hit, and the pages `lookup`
        found for them. A tier is queried for the tokens the tiers above it missed."""
        hits = {tier: self.page_size * sum(origin == tier for _, origin in found) for tier in TIERS}
        self.counters["host"].queries += num_queried
        self.counters["host"].hits += hits["host"]
        if self.disk is not None:
            self.counters["disk"].queries += num_queried - hits["host"]
            self.counters["disk"].hits += hits["disk"]

    def stats(self, transfers) -> dict:
        """The tiers' fields of a `SchedulerStats` snapshot (`transfers`: the runner's `TierCopies`)."""
        tiers = TIERS if self.disk is not None else TIERS[:1]
        usage = [("host", self.host.used_bytes, self.host.capacity_bytes)]
        moved = [("device_to_host", transfers.num_stores, transfers.bytes_to_host, transfers.store_seconds),
                 ("host_to_device", transfers.num_restores, transfers.bytes_to_device, transfers.restore_seconds)]
        if self.disk is not None:
            usage.append(("disk", *self.disk.usage()))
            moved += self.disk.transfers()
        return dict(external_prefix_cache=tuple((tier, self.counters[tier].queries, self.counters[tier].hits)
                                                for tier in tiers),
                    kv_tier_usage=tuple(usage), kv_transfers=tuple(moved))

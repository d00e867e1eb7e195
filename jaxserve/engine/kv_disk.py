"""`DiskTier`: KV pages as files under `kv_offloading_dir`, so a new engine over the same directory serves a
repeated prefix without recomputing it.

Files live in `<dir>/<fingerprint>/`, one per page, named by its chain key. The fingerprint (`kv_fingerprint`)
covers everything that makes K/V valid: the model's weights (their files' paths, sizes and modification times),
its config, the serving and KV cache dtypes, the page size and the tensor-parallel layout of the pool's heads. A
file is `MAGIC`, a JSON header's length (4 bytes, little-endian) and the header (the fingerprint, the key, the
arrays' dtypes and shapes, the payload's length and sha256), then the payload (the page's token prefix, then its
arrays). Nothing read is trusted: a file that fails any check (truncated, corrupted, another fingerprint or key,
other shapes) is a miss and is removed.

Writes happen on the tier's own thread, in the order pages are handed to it (`submit`: write-through, as each
page reaches host memory, within a step of being computed), each to a temporary name then renamed, so engines sharing a directory never read a half-written file. The files' total size stays under
`capacity_bytes`, least recently used (by modification time; a hit touches its file) removed first; each engine
keeps the bound over the files it knows of (those there when it started, and its own). `flush` waits
for the queued writes (a clean shutdown calls it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from jaxserve.engine.kv_tiers import TierPage, numpy_dtype, run_jobs

logger = logging.getLogger(__name__)

MAGIC = b"JAXSERVE-KV-2\n"  # 2: the prefix as int64 (image keys)
SUFFIX = ".kv"


def kv_fingerprint(**identity) -> str:
    """sha256 over `identity` (JSON-serializable values: what must be equal for two engines' K/V to be)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def weights_identity(path: str | os.PathLike) -> list:
    """A checkpoint's files (or one file) as (path, size, modification time in ns): a changed file changes it."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


class DiskTier:
    def __init__(self, directory: str, fingerprint: str, capacity_bytes: int,
                 array_specs: tuple[tuple[str, tuple[int, ...]], ...]):
        self.directory = Path(directory).expanduser() / fingerprint[:32]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.array_specs = [[dtype, list(shape)] for dtype, shape in array_specs]  # each page's, as in the header
        self.num_written = self.num_read = self.num_removed = self.bytes_written = self.bytes_read = 0
        self.write_seconds = self.read_seconds = 0.0
        self.max_write_lag = 0.0  # the longest a page took from leaving the device to its file (seconds)
        self._closed = False
        self._sizes: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._lock = threading.Lock()
        existing = sorted((p for p in self.directory.glob("*" + SUFFIX)), key=_mtime)
        for file in existing:
            self._sizes[file.name] = _size(file)
        self.used_bytes = sum(self._sizes.values())
        self._queue: queue.Queue = queue.Queue()
        # the writer holds the tier weakly, and stops when it is collected (or closed)
        threading.Thread(target=run_jobs, args=(self._queue, weakref.ref(self), lambda tier, job: tier._write(*job),
                                                "KV disk tier: could not write a page"),
                         name="kv-disk-writer", daemon=True).start()
        weakref.finalize(self, self._queue.put, None)

    # -- the scheduling thread ---------------------------------------------------------------------------------

    def read(self, key: bytes) -> TierPage | None:
        """The page stored under `key`, checked whole (None: no file, or one that failed a check, now removed)."""
        file = self.directory / (key.hex() + SUFFIX)
        started = time.perf_counter()
        try:
            data = file.read_bytes()
        except OSError:
            return None
        page = self._decode(data, key)
        self.read_seconds += time.perf_counter() - started
        if page is None:
            logger.warning("KV disk tier: %s failed its checks; removed", file.name)
            self._remove(file)
            return None
        self.bytes_read += len(data)
        self.num_read += 1
        try:
            os.utime(file)
        except OSError:
            pass
        with self._lock:
            self._sizes[file.name] = len(data)
            self._sizes.move_to_end(file.name)
        return page

    def submit(self, page: TierPage, since: float) -> None:
        """Queues `page` to be written (from any thread); `since`: when its copy off the device was issued
        (`time.perf_counter()`), for `max_write_lag`."""
        if self._closed:
            raise RuntimeError("the KV disk tier is closed")
        self._queue.put((page, since))

    def flush(self) -> None:
        """Waits until every page submitted so far is written."""
        self._queue.join()

    def close(self) -> None:
        """Flushes, then stops the writer (again: nothing)."""
        if not self._closed:
            self._closed = True
            self.flush()
            self._queue.put(None)

    def usage(self) -> tuple[int, int]:
        return self.used_bytes, self.capacity_bytes

    def transfers(self) -> tuple[tuple[str, int, int, float], ...]:
        return (("host_to_disk", self.num_written, self.bytes_written, self.write_seconds),
                ("disk_to_host", self.num_read, self.bytes_read, self.read_seconds))

    # -- the writer thread -------------------------------------------------------------------------------------

    def _write(self, page: TierPage, since: float) -> None:
        name = page.key.hex() + SUFFIX
        final = self.directory / name
        if final.exists():
            return
        started = time.perf_counter()
        data = self._encode(page)
        temporary = self.directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        temporary.write_bytes(data)
        os.replace(temporary, final)
        self.num_written += 1
        self.bytes_written += len(data)
        self.write_seconds += time.perf_counter() - started
        self.max_write_lag = max(self.max_write_lag, time.perf_counter() - since)
        with self._lock:
            self._sizes[name] = len(data)
            self.used_bytes += len(data)
            victims = []
            while self.used_bytes > self.capacity_bytes and self._sizes:
                victim, size = self._sizes.popitem(last=False)
                self.used_bytes -= size
                victims.append(victim)
        for victim in victims:
            self._unlink(self.directory / victim)

    # -- the format --------------------------------------------------------------------------------------------

    def _encode(self, page: TierPage) -> bytes:
        payload = b"".join([page.prefix.astype("<i8").tobytes()] + [np.ascontiguousarray(a).tobytes()
                                                                      for a in page.arrays])
        header = json.dumps({"fingerprint": self.fingerprint, "key": page.key.hex(), "tokens": len(page.prefix),
                             "arrays": [[a.dtype.name, list(a.shape)] for a in page.arrays],
                             "payload_bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        return MAGIC + len(header).to_bytes(4, "little") + header + payload

    def _decode(self, data: bytes, key: bytes) -> TierPage | None:
        start = len(MAGIC) + 4
        if not data.startswith(MAGIC) or len(data) < start:
            return None
        header_end = start + int.from_bytes(data[len(MAGIC):start], "little")
        try:
            header = json.loads(data[start:header_end])
            ok = (header["fingerprint"] == self.fingerprint and header["key"] == key.hex()
                  and header["arrays"] == self.array_specs and header["payload_bytes"] == len(data) - header_end
                  and isinstance(header["tokens"], int) and header["tokens"] > 0)
        except (ValueError, KeyError, TypeError):
            return None
        payload = memoryview(data)[header_end:]
        if not ok or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            return None
        tokens = header["tokens"]
        if 8 * tokens + sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in self.array_specs) != len(payload):
            return None
        prefix = np.frombuffer(payload[:8 * tokens], "<i8").astype(np.int64)
        arrays, offset = [], 8 * tokens
        for dtype, shape in self.array_specs:
            count = int(np.prod(shape))
            arrays.append(np.frombuffer(payload, numpy_dtype(dtype), count, offset).reshape(shape))
            offset += count * arrays[-1].itemsize
        return TierPage(key, prefix, tuple(arrays))

    def _remove(self, file: Path) -> None:
        with self._lock:
            size = self._sizes.pop(file.name, None)
            if size is not None:
                self.used_bytes -= size
        self._unlink(file)

    def _unlink(self, file: Path) -> None:
        try:
            file.unlink()
            self.num_removed += 1
        except FileNotFoundError:  # another engine on the directory removed it first
            pass


def _mtime(file: Path) -> int:
    try:
        return file.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except FileNotFoundError:
        return 0

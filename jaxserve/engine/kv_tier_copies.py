"""`TierCopies`: the device side of the KV tiers (`engine/kv_tiers.py`) — batched copies of pages between the
device pool and host memory, as two steps in the runner's registry, compiled at start-up for each bucket of page
counts (`transfer_buckets`):

* `kv_store` gathers pages out of the pool into one array per kind of the pool's leaves (each page's every layer's
  K and V values `[pages, 2 * layers, heads, page_size, head_dim]`, and a quantized pool's scales), so each page is
  one contiguous block on the host. On an accelerator it lands in jax's `pinned_host` memory (the copy is a DMA
  the device runs); on a CPU the device's memory is host memory already, so it stays there and is read as it is.
  The engine stores the pages the prefix cache registered at the end of each step, after the step's forwards are
  dispatched; the copy is started at once (`copy_to_host_async`) and the transfer thread waits for it, cuts the
  pages out and hands them to the host tier (and the disk tier's writer), so the stepping thread never waits for it.
* `kv_restore` writes pages read from the tiers into newly allocated pool pages (the pool donated): one host-to-device
  copy of the stacked pages (from `pinned_host` on an accelerator) and one scatter, issued by `dispatch` before the
  step's forwards.

A step's pages travel in one call per direction (more than the largest bucket: one call per bucket's worth).
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
import weakref

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.engine.buckets import bucket_for, power_of_two_buckets
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_disk import DiskTier, kv_fingerprint, weights_identity
from jaxserve.engine.kv_plan import kv_cache_shardings
from jaxserve.engine.kv_tiers import HostTier, KVTiers, PageToStore, TierPage, numpy_dtype, run_jobs
from jaxserve.engine.page_manager import page_key
from jaxserve.engine.step_registry import RunnerState, Step, assign
from jaxserve.layers.paged_kv import KV_PAGES
from jaxserve.loading import resolve_model

logger = logging.getLogger(__name__)


@flax.struct.dataclass
class StoreInputs:
    pages: jax.Array  # int32 [bucket]: pool pages to copy out (padding: the scratch page)


@flax.struct.dataclass
class RestoreInputs:
    pages: jax.Array  # int32 [bucket]: pool pages to write (padding: the scratch page)
    arrays: tuple  # per leaf kind, [bucket, 2 * layers, heads, page_size(, head_dim)]


def transfer_buckets(ec: EngineConfig) -> tuple[int, ...]:
    """Page counts of the compiled transfers: 4, 8, 16, ... up to the pages a step registers (its prefill budget's
    and a filled page per decode slot) and one whole sequence's pages (what an admission restores at most)."""
    largest = max(4, -(-ec.max_num_batched_tokens // ec.page_size) + ec.max_num_seqs, ec.pages_per_seq)
    return power_of_two_buckets(4, 1 << (largest - 1).bit_length())


def _leaf_kinds(kv_cache) -> list[list[int]]:
    """The pool's leaves by kind, as indices into `jax.tree.leaves(kv_cache)`: values `[heads, pages, page_size,
    head_dim]` (a float pool's arrays, `QuantizedPages.values`), then a quantized pool's `QuantizedPages.scales`
    `[heads, pages, page_size]`, told apart by name."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(kv_cache)[0]]
    scales = [bool(path) and getattr(path[-1], "name", None) == "scales" for path in paths]
    kinds = ([i for i, scale in enumerate(scales) if not scale], [i for i, scale in enumerate(scales) if scale])
    return [kind for kind in kinds if kind]


def page_specs(kv_cache) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each page's arrays off the device: (dtype name, `[2 * layers, heads, page_size(, head_dim)]`) per leaf kind."""
    leaves = jax.tree.leaves(kv_cache)
    firsts = [(leaves[kind[0]], len(kind)) for kind in _leaf_kinds(kv_cache)]
    return tuple((jnp.dtype(leaf.dtype).name, (count, leaf.shape[0], *leaf.shape[2:])) for leaf, count in firsts)


def store_step(kv_cache, inputs: StoreInputs):
    leaves = jax.tree.leaves(kv_cache)
    return tuple(jnp.stack([jnp.swapaxes(leaves[i][:, inputs.pages], 0, 1) for i in kind], axis=1)
                 for kind in _leaf_kinds(kv_cache)), ()


def restore_step(device_sharding, kv_cache, inputs: RestoreInputs):
    """The pages' arrays (in host memory when `device_sharding` is set) written into the pool; they are moved to
    the device first, so no part of the step is left to the host (which a TPU's compiler refuses)."""
    leaves, treedef = jax.tree.flatten(kv_cache)
    new = list(leaves)
    arrays = inputs.arrays if device_sharding is None else jax.device_put(inputs.arrays, device_sharding)
    for kind, data in zip(_leaf_kinds(kv_cache), arrays):
        for position, i in enumerate(kind):
            new[i] = leaves[i].at[:, inputs.pages].set(jnp.swapaxes(data[:, position], 0, 1))
    return None, (jax.tree.unflatten(treedef, new),)


class TierCopies:
    def __init__(self, runner: RunnerState, tiers: KVTiers):
        self.runner = runner
        self.tiers = tiers
        self.buckets = transfer_buckets(runner.engine_config)
        mesh = runner.mesh
        device = mesh.devices.flat[0]
        kinds = {memory.kind for memory in device.addressable_memories()}
        self.memory_kind = "pinned_host" if "pinned_host" in kinds and device.platform != "cpu" else None
        # pages stacked [pages, leaves, heads, ...], split like the pool: by head, or whole (a latent pool)
        spec = KV_PAGES if runner.model_config.mla is None else REPLICATED
        self.host_sharding = NamedSharding(mesh, spec, memory_kind=self.memory_kind)
        # each page's arrays off the device: (dtype, [2 * layers, heads, page_size(, head_dim)]) per leaf kind
        self.page_specs = page_specs(runner.kv_cache)
        self._zero_pages = [np.zeros(shape, numpy_dtype(dtype)) for dtype, shape in self.page_specs]  # padding
        self.num_stores = self.num_restores = 0  # calls, each one transfer per leaf kind
        self.pages_stored = self.pages_restored = 0
        self.bytes_to_host = self.bytes_to_device = 0
        self.store_seconds = self.restore_seconds = 0.0
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        # the thread holds the transfers weakly, and stops when they are collected (or closed)
        threading.Thread(target=run_jobs, args=(self._queue, weakref.ref(self),
                                                lambda transfers, job: transfers._finish_store(*job),
                                                "KV tiers: a store to host memory failed"),
                         name="kv-transfer", daemon=True).start()
        weakref.finalize(self, self._queue.put, None)
        atexit.register(_flush_at_exit, weakref.ref(self))  # a script that ends normally keeps its pending pages

    def steps(self) -> list[Step]:
        runner = self.runner
        replicated = NamedSharding(runner.mesh, REPLICATED)
        kv_in = kv_cache_shardings(runner.backend, runner.model_config)
        kinds = (self.host_sharding,) * len(self.page_specs)
        store = jax.jit(store_step, in_shardings=(kv_in, replicated), out_shardings=(kinds, ()))
        on_device = None if self.memory_kind is None else NamedSharding(runner.mesh, self.host_sharding.spec,
                                                                         memory_kind="device")
        restore = jax.jit(functools.partial(restore_step, on_device),
                          in_shardings=(kv_in, RestoreInputs(replicated, kinds)),
                          out_shardings=(None, (kv_in,)), donate_argnums=(0,))
        state = lambda: (runner.kv_cache,)  # noqa: E731
        return [Step("kv_store", store, state, assign(runner), self._store_examples),
                Step("kv_restore", restore, state, assign(runner, "kv_cache"), self._restore_examples)]

    def _store_examples(self):
        for bucket in self.buckets:
            yield StoreInputs(np.zeros(bucket, np.int32))

    def _restore_examples(self):
        for bucket in self.buckets:
            yield self._restore_inputs([], bucket)

    # -- the stepping thread -----------------------------------------------------------------------------------

    def store(self, pages: list[PageToStore]) -> None:
        """Starts copying `pages` (whose steps are dispatched) to host memory; the transfer thread finishes it."""
        if self._closed:
            raise RuntimeError("the KV tiers are shut down")
        largest = self.buckets[-1]
        for start in range(0, len(pages), largest):
            part = pages[start:start + largest]
            indices = np.zeros(bucket_for(len(part), self.buckets), np.int32)
            indices[:len(part)] = [store.page for store in part]
            arrays = self.runner.steps.run("kv_store", StoreInputs(indices))
            for array in arrays:
                array.copy_to_host_async()
            self.num_stores += 1
            self._queue.put((arrays, part, time.perf_counter()))

    def restore(self, restores: list[tuple[int, TierPage]]) -> None:
        """Writes tier pages into their newly allocated pool pages, before anything else of the step runs."""
        started = time.perf_counter()
        largest = self.buckets[-1]
        for start in range(0, len(restores), largest):
            part = restores[start:start + largest]
            inputs = self._restore_inputs(part, bucket_for(len(part), self.buckets))
            self.runner.steps.run("kv_restore", inputs)
            self.num_restores += 1
            self.pages_restored += len(part)
            self.bytes_to_device += sum(page.nbytes - page.prefix.nbytes for _, page in part)
        self.restore_seconds += time.perf_counter() - started

    def _restore_inputs(self, part: list[tuple[int, TierPage]], bucket: int) -> RestoreInputs:
        indices = np.zeros(bucket, np.int32)
        indices[:len(part)] = [page for page, _ in part]
        arrays = []
        for kind, zeros in enumerate(self._zero_pages):  # padding rows are written to the scratch page
            arrays.append(np.stack([page.arrays[kind] for _, page in part] + [zeros] * (bucket - len(part))))
        return RestoreInputs(indices, tuple(self.runner.allocator.put(arrays, self.host_sharding)))

    def flush(self) -> None:
        """Waits until every store started so far has reached the host tier and the disk tier's files."""
        self._queue.join()
        if self.tiers.disk is not None:
            self.tiers.disk.flush()

    def close(self) -> None:
        """Flushes, then stops the transfer thread and the disk tier's writer (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._queue.put(None)
        if self.tiers.disk is not None:
            self.tiers.disk.close()

    # -- the transfer thread -----------------------------------------------------------------------------------

    def _finish_store(self, arrays, part: list[PageToStore], started: float) -> None:
        host = [np.asarray(array) for array in arrays]  # waits for the copy
        for index, store in enumerate(part):
            page = TierPage(store.key, store.prefix, tuple(kind[index].copy() for kind in host))
            self.tiers.host.put(page)
            if self.tiers.disk is not None:
                self.tiers.disk.submit(page, started)
            self.bytes_to_host += page.nbytes - page.prefix.nbytes
        self.pages_stored += len(part)
        self.store_seconds += time.perf_counter() - started


def _flush_at_exit(transfers: "weakref.ref[TierCopies]") -> None:
    owner = transfers()
    if owner is not None and not owner._closed:
        owner.flush()


def attach_kv_tiers(config: EngineConfig, runner: RunnerState) -> KVTiers | None:
    """The KV tiers the config asks for, attached to the runner (None: none). The disk tier's fingerprint covers the
    weights' files, the model's config, the dtypes, the page size and the pool's layout over the devices."""
    if not config.kv_tiers:
        return None
    if jax.process_count() > 1:
        raise ValueError("kv_offloading_size / kv_offloading_dir do not work across several hosts yet")
    tiers = KVTiers(HostTier(int((config.kv_offloading_size or 0) * 2**30)), None, config.page_size, page_key)
    runner.attach_tiers(tiers)
    if config.kv_offloading_dir:
        specs = runner.transfers.page_specs
        weights = (["dummy", config.seed] if config.load_format == "dummy"
                   else weights_identity(resolve_model(config.model).weights))
        fingerprint = kv_fingerprint(
            format=2, model=repr(runner.model_config), weights=weights, dtype=config.dtype,
            kv_cache_dtype=config.kv_cache_dtype, storage_dtype=runner.kv_storage_dtype,
            quantization=config.quantization, page_size=config.page_size, tensor_parallel_size=runner.tp.size,
            expert_parallel=config.enable_expert_parallel, pool_heads=runner.tp.pool_heads(runner.model_config),
            pages=specs)
        tiers.disk = DiskTier(config.kv_offloading_dir, fingerprint, int(config.kv_offloading_disk_size * 2**30),
                              specs)
    logger.info("KV tiers: host %.2f GiB%s", config.kv_offloading_size or 0,
                f", disk {config.kv_offloading_disk_size:g} GiB at {tiers.disk.directory}" if tiers.disk else "")
    return tiers

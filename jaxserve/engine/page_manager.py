"""`PageManager`: the host's view of the full-attention KV cache group — its page tables and automatic prefix
caching — over a `PagePool` (reference counts, the scratch page, the LRU free list).

A full page is keyed by sha256 over its parent page's key and its token ids. Every hit is exact, whatever the hash
does: a lookup follows the chain page by page and takes a cached page only if its token ids equal the sequence's
and it was registered as the child of the very page matched one step before (each registration has a serial
number that is never reused). A colliding key is a miss, never a wrong page. Freed pages keep their contents and
stay findable until they are reallocated; the free list is LRU ordered and a sequence frees its pages tail first,
so the longest prefixes' tails are evicted first.

A LoRA sequence's chain starts from its adapter's key (`Sequence.prefix_root`), so no page is shared between two
adapters or an adapter and the base model, in the device cache or the KV tiers.

A sequence whose tokens rotate by a length rather than by their positions alone (`Sequence.rope_by_length`: a
LongRoPE or dynamic-NTK model past its threshold, `layers/rotary.py`) neither looks up nor registers pages: equal
tokens at equal positions hold equal K/V only when rotated by position.

With KV tiers (`engine/kv_tiers.py`) a lookup that ends on the device continues in the host and disk tiers: the pages
found there get newly allocated device pages, registered like computed ones, and the runner copies them in before
the step's forwards (`restore`); every page newly registered from a computation is noted for the tiers to copy.

This manager's pages are the full-attention KV cache group's (the first group of the KV plan, `engine/kv_plan.py`;
its page indices name every group's). Each sliding-window group has its own manager (`windows`,
`engine/window_manager.py`) by the same indices: allocation takes from every group (short in one is short),
freeing and trimming release in all, a full page registers in all, and a prefix hit is only as long as every window
group still holds what its next token's window reads.

A hybrid model's state-keeping layers hit only where a state is kept (`states`, `engine/state_checkpoints.py`):
a hit is cut to the deepest checkpoint position, the admitted sequence starts from that state, and every page
registered at a checkpoint position makes the state saved there findable.

The manager owns the page table and the prefix-cache chain (the key and registration serial of each full page) of
every sequence holding pages; it writes nothing into a `Sequence`. Token counters are the scheduler's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Callable, Iterable, Iterator

import numpy as np

from jaxserve.engine.kv_events import KVEventLog
from jaxserve.engine.kv_tiers import KVTiers, TierPage
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.state_checkpoints import StateCheckpoints
from jaxserve.engine.window_manager import WindowManager

PageHash = Callable[[bytes, tuple[int, ...]], bytes]


def page_key(parent_key: bytes, token_ids: tuple[int, ...]) -> bytes:
    """sha256 over the parent page's key (b"" for the first page) and the page's token ids."""
    digest = hashlib.sha256(parent_key)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


def key_chain(token_ids: list[int], page_size: int, hash_fn: PageHash = page_key,
              max_pages: int | None = None, root: bytes = b"") -> Iterator[tuple[bytes, tuple[int, ...]]]:
    """The (key, token ids) of each full page of `token_ids` in order (the first `max_pages`), computed lazily;
    `root`: the first page's parent key (`Sequence.prefix_root`: b"" for the base model, its adapter's else)."""
    parent_key = root
    num_pages = len(token_ids) // page_size if max_pages is None else min(max_pages, len(token_ids) // page_size)
    for start in range(0, num_pages * page_size, page_size):
        tokens = tuple(token_ids[start:start + page_size])
        parent_key = hash_fn(parent_key, tokens)
        yield parent_key, tokens


@dataclasses.dataclass(frozen=True)
class CachedPage:
    """What the prefix cache knows of one registered page."""

    key: bytes
    token_ids: tuple[int, ...]
    serial: int  # unique per registration
    parent_serial: int | None  # the registration of the page before it (None: first page)


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 hash_fn: PageHash = page_key, tiers: KVTiers | None = None, windows: tuple[WindowManager, ...] = (),
                 states: StateCheckpoints | None = None, events: KVEventLog | None = None):
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.tiers = tiers
        self.windows = windows  # the sliding-window groups' managers (none: every layer reads this group's pages)
        self.states = states  # the state-keeping layers' checkpoints (a hybrid model under prefix caching)
        self.events = events  # KV cache events: pages registered and dropped (`kv_events.py`)
        self.cached: dict[int, CachedPage] = {}  # page -> its registration
        self.page_of_key: dict[bytes, int] = {}
        self._serials = itertools.count()
        self._tables: dict[int, list[int]] = {}  # seq_id -> its pages, in order
        self._chains: dict[int, tuple[list[bytes], list[int | None]]] = {}  # seq_id -> its pages' keys, serials
        self.num_prefix_queries = 0  # prompt tokens looked up by admitted sequences
        self.num_prefix_hits = 0  # of those, tokens found in the cache

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    @property
    def num_usable_pages(self) -> int:
        return self.pool.num_usable_pages

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by running sequences (cached-but-free pages count as free)."""
        return self.pool.usage

    def page_table(self, seq_id: int) -> list[int]:
        """The pages of sequence `seq_id` in order (empty when it holds none); the manager's own list, to read."""
        return self._tables.get(seq_id, [])

    def tables(self, seq: Sequence, new: bool) -> tuple[list[int], tuple]:
        """`seq`'s page table and its window groups' changes (`window_changes`), what the runner is sent."""
        return self.page_table(seq.seq_id), self.window_changes(seq, new)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs so that its first `num_tokens` tokens have a slot."""
        return max(0, -(-num_tokens // self.page_size) - len(self.page_table(seq.seq_id)))

    def caches(self, seq: Sequence) -> bool:
        """Whether `seq` looks up and registers prefix pages."""
        return self.enable_prefix_caching and not seq.rope_by_length

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached pages holding the longest prefix of `seq` (exactly), leaving >= 1 token to compute."""
        if not self.caches(seq):
            return []
        max_pages = (len(seq.token_ids) - 1) // self.page_size
        pages = self._matching_pages(key_chain(seq.key_token_ids, self.page_size, self.hash_fn, max_pages,
                                               seq.prefix_root))
        for window in self.windows:  # as far as the window groups still hold the pages the next token reads
            pages = pages[:window.usable_hit([self.cached[page].serial for page in pages])]
        if self.states is not None:  # as far as a state is kept where the hit ends
            pages = pages[:self.states.usable_hit([self.cached[page].serial for page in pages])]
        return pages

    def num_cached_tokens(self, chain: Iterable[tuple[bytes, tuple[int, ...]]]) -> int:
        """Leading tokens of a prompt with the page-key `chain` (`key_chain`) that this device cache holds. Only
        reads the cache, so another thread may ask (a data-parallel server routing a request); a step may change
        the answer right after."""
        return len(self._matching_pages(chain)) * self.page_size if self.enable_prefix_caching else 0

    def _matching_pages(self, chain: Iterable[tuple[bytes, tuple[int, ...]]]) -> list[int]:
        pages: list[int] = []
        parent_serial = None
        for key, tokens in chain:
            page = self.page_of_key.get(key)
            entry = self.cached.get(page) if page is not None else None
            if entry is None or entry.token_ids != tokens or entry.parent_serial != parent_serial:
                break
            pages.append(page)
            parent_serial = entry.serial
        return pages

    def match_tiers(self, seq: Sequence, cached_pages: list[int]) -> list[tuple[TierPage, str]]:
        """The tier pages (and their tiers) continuing `seq`'s device match `cached_pages`, leaving >= 1 token to
        compute (none without tiers)."""
        if self.tiers is None or not self.caches(seq):
            return []
        parent_key = self.cached[cached_pages[-1]].key if cached_pages else seq.prefix_root
        max_pages = (len(seq.token_ids) - 1) // self.page_size - len(cached_pages)
        return self.tiers.lookup(seq.key_token_ids, len(cached_pages), parent_key, max_pages)

    def admit(self, seq: Sequence, cached_pages: list[int]) -> int:
        """Gives `seq` the cached prefix pages, taking a reference on each; returns the tokens they hold."""
        for page in cached_pages:
            self.pool.take(page)
        self._tables[seq.seq_id] = list(cached_pages)
        for window in self.windows:
            window.admit(seq.seq_id, [self.cached[page].serial for page in cached_pages])
        self._chains[seq.seq_id] = ([self.cached[page].key for page in cached_pages],
                                    [self.cached[page].serial for page in cached_pages])
        if self.states is not None:
            self.states.admit(seq.seq_id, self._chains[seq.seq_id][1])
        return len(cached_pages) * self.page_size

    def state_io(self, seq: Sequence, start: int, num_tokens: int) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Where a step computing `seq`'s tokens `[start, start + num_tokens)` reads its starting state (a
        checkpoint row, -1: its slot's) and saves the states at checkpoint positions ((position, row) pairs)."""
        if self.states is None or not self.caches(seq):
            return -1, ()
        return self.states.take_source(seq.seq_id), self.states.saves(seq.seq_id, start, num_tokens)

    def assign_states(self, chunks: list, decodes: tuple, seqs: dict[int, Sequence]) -> tuple:
        """A step's state checkpoints: where each `PrefillChunk` starts from and saves (set on it), and the decodes
        (`ScheduledDecode`s) with the row each saves into (unchanged without `states`)."""
        if self.states is None:
            return decodes
        for chunk in chunks:
            chunk.state_source, chunk.state_saves = self.state_io(chunk.seq, chunk.start, chunk.num_tokens)
        decodes = tuple(decode._replace(state_save=next(
            (row for _, row in self.state_io(seqs[decode.seq_id], decode.position, 1)[1]), -1)) for decode in decodes)
        self.states.end_step()
        return decodes

    def restore(self, seq: Sequence, found: list[tuple[TierPage, str]]) -> list[tuple[int, TierPage]]:
        """Registers the pages allocated to `seq` past its device match for the tier pages `found` (whose K/V the
        runner copies into them before the step's forwards); returns (device page, tier page) pairs."""
        keys, serials = self._chains.setdefault(seq.seq_id, ([], []))
        restores = []
        for tier_page, _ in found:
            index = len(keys)
            tokens = seq.key_tokens(index * self.page_size, (index + 1) * self.page_size)
            page = self._tables[seq.seq_id][index]
            serials.append(self._register(page, tier_page.key, tokens, index, serials[-1] if serials else None))
            if self._newly_cached(page, serials[-1]):
                self._note_stored(seq, index, tier_page.key, keys[-1] if keys else None)
            keys.append(tier_page.key)
            restores.append((page, tier_page))
        return restores

    def record_lookup(self, seq: Sequence, num_device_tokens: int, found: list[tuple[TierPage, str]]) -> None:
        """Counts an admitted sequence's prefix lookup (once it has its pages, so failed admissions do not count):
        `num_device_tokens` found on the device, then the pages `found` in the tiers."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += len(seq.token_ids)
            self.num_prefix_hits += num_device_tokens
            if self.tiers is not None:
                self.tiers.count(len(seq.token_ids) - num_device_tokens, found)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Adds pages so `seq` can hold `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        for window in self.windows:
            window.release_behind(seq.seq_id, seq.num_computed_tokens)
        table = self._tables.setdefault(seq.seq_id, [])
        if num_tokens <= len(table) * self.page_size:  # most decode steps: the last page has room
            return True
        if any(window.pages_needed(seq.seq_id, num_tokens) > window.pool.num_free_pages for window in self.windows):
            return False
        needed = self.pages_needed(seq, num_tokens)
        if needed > self.pool.num_free_pages:
            return False
        for _ in range(needed):
            page = self.pool.next_free()
            self._forget(page)
            self.pool.take(page)
            table.append(page)
        for window in self.windows:
            window.allocate(seq.seq_id, num_tokens)
        return True

    def commit_full_pages(self, seq: Sequence) -> None:
        """Registers the pages `seq` has completely computed since the last call in the prefix cache."""
        if not self.caches(seq):
            return
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.page_size  # token ids known to the host
        keys, serials = self._chains.setdefault(seq.seq_id, ([], []))
        for index in range(len(keys), num_full):
            tokens = seq.key_tokens(index * self.page_size, (index + 1) * self.page_size)
            key = self.hash_fn(keys[-1] if keys else seq.prefix_root, tokens)
            parent_serial = serials[-1] if serials else None
            keys.append(key)
            page = self._tables[seq.seq_id][index]
            serials.append(self._register(page, key, tokens, index, parent_serial))
            if self._newly_cached(page, serials[-1]):
                self._note_stored(seq, index, key, keys[-2] if index else None)
                if self.tiers is not None:
                    end = (index + 1) * self.page_size
                    self.tiers.note_registered(page, key, seq.key_tokens(0, end), end)
            for window in self.windows:
                window.register(seq.seq_id, index, serials[-1])
            if self.states is not None:
                self.states.register(seq.seq_id, index, serials[-1])

    def _register(self, page: int, key: bytes, tokens: tuple[int, ...], index: int,
                  parent_serial: int | None) -> int | None:
        """Caches `page` unless an identical page is cached already; the serial of the registration that now
        holds this prefix exactly (None if there is none: a broken chain or a colliding key)."""
        if index and parent_serial is None:
            return None
        same = self.cached.get(self.page_of_key.get(key, -1))
        if same is not None:
            exact = same.token_ids == tokens and same.parent_serial == parent_serial
            return same.serial if exact else None
        if page in self.cached:
            return None
        entry = CachedPage(key, tokens, next(self._serials), parent_serial)
        self.page_of_key[key] = page
        self.cached[page] = entry
        return entry.serial

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first; pages nobody holds return to the free list."""
        for page in reversed(self._tables.pop(seq.seq_id, [])):
            self._release(page)
        self._chains.pop(seq.seq_id, None)
        for window in self.windows:
            window.free(seq.seq_id)
        if self.states is not None:
            self.states.free(seq.seq_id)

    def trim(self, seq: Sequence) -> None:
        """Releases the pages past those holding `seq`'s tokens (the room a speculative step made for drafts that
        were rejected); a released page holds no cached prefix, so it is the next to be handed out."""
        keep = -(-len(seq.token_ids) // self.page_size)
        table = self.page_table(seq.seq_id)
        while len(table) > keep:
            self._release(table.pop())
        for window in self.windows:
            window.trim(seq.seq_id, keep)

    def window_changes(self, seq: Sequence, new: bool) -> tuple[tuple[int, tuple[int, ...]] | None, ...]:
        """Each window group's table of `seq` for the runner: from the first index that changed since it was last
        sent (first 0: all of it, for a `new` admission)."""
        return tuple(window.take_changes(seq.seq_id, whole=new) for window in self.windows)

    def _release(self, page: int) -> None:
        self.pool.release(page, cached=page in self.cached)

    def _newly_cached(self, page: int, serial: int | None) -> bool:
        """Whether registration `serial` cached `page` itself (not found cached already elsewhere)."""
        return serial is not None and page in self.cached and self.cached[page].serial == serial

    def _note_stored(self, seq: Sequence, index: int, key: bytes, parent_key: bytes | None) -> None:
        if self.events is not None:
            size = self.page_size
            self.events.stored(key, parent_key, tuple(seq.token_ids[index * size:(index + 1) * size]), seq.lora)

    def reset_prefix_cache(self) -> None:
        if self.events is not None:
            self.events.cleared()
        self.cached.clear()
        self.page_of_key.clear()
        for window in self.windows:
            window.reset()
        if self.states is not None:
            self.states.reset()

    def _forget(self, page: int) -> None:
        entry = self.cached.pop(page, None)
        if entry is not None:
            del self.page_of_key[entry.key]
            if self.events is not None:
                self.events.removed(entry.key)
            if self.states is not None:
                self.states.forget(entry.serial)

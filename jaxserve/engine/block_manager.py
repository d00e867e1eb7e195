"""`BlockManager`: the host's view of the KV page pool — free list, reference counts, page tables,
and automatic prefix caching.

Page 0 is the scratch page: padded tokens write there and unused page-table entries point there,
so it is never handed out. A full page is keyed by a hash chained over (parent hash, its token ids);
a new sequence reuses the longest chain of cached pages whose token ids match exactly. Freed pages
keep their contents and stay findable until they are reallocated; the free list is LRU ordered and
a sequence frees its pages tail first, so the longest prefixes' tails are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.engine.sequence import Sequence

SCRATCH_PAGE = 0


def page_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        # free pages, least recently freed first; dict used as an ordered set
        self.free_pages: OrderedDict[int, None] = OrderedDict((page, None) for page in range(1, num_pages))
        self.hash_of_page: dict[int, int] = {}
        self.page_of_hash: dict[int, int] = {}
        self.tokens_of_page: dict[int, tuple[int, ...]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of those, tokens found in the cache

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by running sequences (cached-but-free pages count as free)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs so that its first `num_tokens` tokens have a slot."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.page_table))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached pages holding the longest prefix of `seq` (tokens verified), leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        pages: list[int] = []
        parent = None
        max_cached_tokens = len(seq.token_ids) - 1
        for start in range(0, max_cached_tokens - self.page_size + 1, self.page_size):
            tokens = tuple(seq.token_ids[start:start + self.page_size])
            key = page_hash(parent, tokens)
            page = self.page_of_hash.get(key)
            if page is None or self.tokens_of_page.get(page) != tokens:
                break
            pages.append(page)
            parent = key
        return pages

    def admit(self, seq: Sequence, cached_pages: list[int]) -> None:
        """Gives `seq` the cached prefix pages (taking a reference on each) and counts the lookup."""
        for page in cached_pages:
            self._take(page)
        seq.page_table = list(cached_pages)
        seq.page_hashes = [self.hash_of_page[page] for page in cached_pages]
        seq.num_computed_tokens = len(cached_pages) * self.page_size
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.num_prefix_queries += len(seq.token_ids)
            self.num_prefix_hits += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Adds pages so `seq` can hold `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        needed = self.pages_needed(seq, num_tokens)
        if needed > len(self.free_pages):
            return False
        for _ in range(needed):
            page = next(iter(self.free_pages))
            self._forget_hash(page)
            self._take(page)
            seq.page_table.append(page)
        return True

    def commit_full_pages(self, seq: Sequence) -> None:
        """Registers the pages `seq` has completely computed since the last call in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.page_size
        for index in range(len(seq.page_hashes), num_full):
            tokens = tuple(seq.token_ids[index * self.page_size:(index + 1) * self.page_size])
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            key = page_hash(parent, tokens)
            seq.page_hashes.append(key)
            page = seq.page_table[index]
            if key not in self.page_of_hash and page not in self.hash_of_page:
                self.page_of_hash[key] = page
                self.hash_of_page[page] = key
                self.tokens_of_page[page] = tokens

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first; pages nobody holds return to the free list."""
        for page in reversed(seq.page_table):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages[page] = None
                if page not in self.hash_of_page:  # nothing to reuse: hand it out before cached pages
                    self.free_pages.move_to_end(page, last=False)
        seq.page_table = []
        seq.page_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        self.hash_of_page.clear()
        self.page_of_hash.clear()
        self.tokens_of_page.clear()

    def _take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def _forget_hash(self, page: int) -> None:
        key = self.hash_of_page.pop(page, None)
        if key is not None:
            del self.page_of_hash[key]
            del self.tokens_of_page[page]

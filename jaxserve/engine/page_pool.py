"""`PagePool`: the host's count of one KV cache group's pages — reference counts, the scratch page, and the free
list in LRU order. Every group's manager (`engine/page_manager.py`, `engine/window_manager.py`) keeps its pages in
one; what a page holds for the prefix cache is the manager's.

Page 0 is the scratch page: padded tokens write there and unused page-table entries point there, so it is never
handed out. A page nobody holds is free; the free list hands out first the pages that hold nothing reusable
(released `cached=False`), then the least recently freed, so the pages a prefix cache could still hit wait longest.
"""

from __future__ import annotations

from collections import OrderedDict

SCRATCH_PAGE = 0


class PagePool:
    def __init__(self, num_pages: int, what: str = "num_kv_pages"):
        if num_pages < 2:
            raise ValueError(f"{what} must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        # free pages, next to hand out first; dict used as an ordered set
        self.free_pages: OrderedDict[int, None] = OrderedDict((page, None) for page in range(1, num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def usage(self) -> float:
        """Fraction of usable pages held (pages only a prefix cache remembers count as free)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def next_free(self) -> int:
        """The page `take` should get next (the caller forgets what it held first)."""
        return next(iter(self.free_pages))

    def take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def release(self, page: int, cached: bool) -> None:
        """Drops one reference; a page nobody holds is free again, handed out first unless it is `cached`."""
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None
            if not cached:
                self.free_pages.move_to_end(page, last=False)

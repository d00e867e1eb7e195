"""`WindowPages`: the page pool of the sliding-window layers under the hybrid KV cache (vLLM's hybrid KV cache
manager): a sequence holds pages there only for its last `window` positions, so a Mistral, Gemma 2/3 or gpt-oss
sequence keeps window-sized K/V in those layers whatever its length. The full-attention layers keep every page
in the `PageManager`'s own pool.

A window page has the same logical index as the full pages (page j holds positions j * page_size ...), in its own
pool and page table (`Sequence.window_pages`, held from `window_start` on). Pages behind the window are released
as the sequence's computed tokens move past them; the device's page table keeps their stale entries, which the
window mask never reads (a released page may hold another sequence's K/V by then: finite, masked).

Prefix caching stays exact: a full window page is registered under the full pool's registration serial of the
same index (the full pool's chain makes that serial exact), and a prefix hit of `m` full pages is taken only as far
as the window pool still holds the pages its next token's window reads; otherwise the hit is shorter.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.engine.sequence import Sequence

SCRATCH_PAGE = 0


class WindowPages:
    def __init__(self, num_pages: int, page_size: int, window: int):
        if num_pages < 2:
            raise ValueError(f"the window layers' pool needs >= 2 pages (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.window = window
        self.ref_counts = [0] * num_pages
        self.free_pages: OrderedDict[int, None] = OrderedDict((page, None) for page in range(1, num_pages))
        self.serial_of: dict[int, int] = {}  # cached page -> the full pool's registration serial of its index
        self.page_of: dict[int, int] = {}  # that serial -> the page

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / (self.num_pages - 1)

    def first_needed(self, num_tokens: int) -> int:
        """The first page the window of a query at position `num_tokens` reads."""
        return max(0, num_tokens - self.window + 1) // self.page_size

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.window_pages))

    # -- prefix hits ---------------------------------------------------------------------------------------------

    def usable_hit(self, serials: list[int]) -> int:
        """How many of a full prefix hit's pages (their registration serials, in order) can be taken: the largest
        m whose next token's window pages (`first_needed(m * page_size)` .. m - 1) are all cached here."""
        for m in range(len(serials), 0, -1):
            if all(serials[j] in self.page_of for j in range(self.first_needed(m * self.page_size), m)):
                return m
        return 0

    def admit(self, seq: Sequence, serials: list[int]) -> None:
        """Gives `seq` the cached window pages of its hit (`usable_hit` pages, by their serials)."""
        start = self.first_needed(len(serials) * self.page_size)
        seq.window_pages = [SCRATCH_PAGE] * start
        seq.window_start = start
        for serial in serials[start:]:
            page = self.page_of[serial]
            self._take(page)
            seq.window_pages.append(page)

    def register(self, seq: Sequence, index: int, serial: int | None) -> None:
        """Caches `seq`'s full window page `index` under its full page's registration serial, if still held."""
        if serial is None or index < seq.window_start or index >= len(seq.window_pages) or serial in self.page_of:
            return
        page = seq.window_pages[index]
        if page in self.serial_of:
            return
        self.serial_of[page] = serial
        self.page_of[serial] = page

    # -- allocation ----------------------------------------------------------------------------------------------

    def release_behind(self, seq: Sequence) -> None:
        """Releases the pages behind the window of `seq`'s next computed token."""
        end = min(self.first_needed(seq.num_computed_tokens), len(seq.window_pages))
        for index in range(seq.window_start, end):
            self._release(seq.window_pages[index])
        seq.window_start = max(seq.window_start, end)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Adds the pages for `seq`'s first `num_tokens` tokens (the caller checked `pages_needed` fit)."""
        for _ in range(self.pages_needed(seq, num_tokens)):
            page = next(iter(self.free_pages))
            self._forget(page)
            self._take(page)
            seq.window_pages.append(page)

    def free(self, seq: Sequence) -> None:
        for index in range(len(seq.window_pages) - 1, seq.window_start - 1, -1):
            self._release(seq.window_pages[index])
        seq.window_pages, seq.window_start = [], 0

    def trim(self, seq: Sequence, keep: int) -> None:
        """Releases the pages past the first `keep` (the room rejected drafts had)."""
        while len(seq.window_pages) > max(keep, seq.window_start):
            self._release(seq.window_pages.pop())
        seq.num_kept_window_pages = min(seq.num_kept_window_pages, len(seq.window_pages))

    def _take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None
            if page not in self.serial_of:
                self.free_pages.move_to_end(page, last=False)

    def _forget(self, page: int) -> None:
        serial = self.serial_of.pop(page, None)
        if serial is not None:
            del self.page_of[serial]

    def reset(self) -> None:
        self.serial_of.clear()
        self.page_of.clear()

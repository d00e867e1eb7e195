"""`WindowManager`: the pages of one sliding-window KV cache group (vLLM's hybrid KV cache manager): a sequence
holds pages there only for its last `window` positions, so a Mistral, Gemma 2/3 or gpt-oss sequence keeps
window-sized K/V in those layers whatever its length. The full-attention group (`PageManager`, which calls this one)
keeps every page.

A window page has the same index as the full group's pages (page j holds positions j * page_size ...), in its own
pool (`PagePool`) and its own page table per sequence (`WindowTable`, which this manager owns). Pages behind the
window are released as the sequence's computed tokens move past them; the device's page table keeps their stale
entries, which the window mask never reads (a released page may hold another sequence's K/V by then: finite,
masked).

Prefix caching stays exact: a full window page is registered under the full group's registration serial of the
same index (the full group's chain makes that serial exact), and a prefix hit of `m` full pages is taken only as far
as this group still holds the pages its next token's window reads; otherwise the hit is shorter.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.page_pool import SCRATCH_PAGE, PagePool


@dataclasses.dataclass
class WindowTable:
    """One sequence's pages in a window group, by page index: entries before `start` are released (the scratch
    page, or pages since handed to others). `changed_from`: the first index that changed since the runner was last
    sent the table (None: none did)."""

    pages: list[int]
    start: int = 0
    changed_from: int | None = None

    def changed(self, index: int) -> None:
        self.changed_from = index if self.changed_from is None else min(self.changed_from, index)


class WindowManager:
    def __init__(self, num_pages: int, page_size: int, window: int, group: int = 1):
        self.pool = PagePool(num_pages, f"KV cache group {group} (sliding window {window})'s pool")
        self.page_size = page_size
        self.window = window
        self.tables: dict[int, WindowTable] = {}  # seq id -> its table, while it holds pages here
        self.serial_of: dict[int, int] = {}  # cached page -> the full group's registration serial of its index
        self.page_of: dict[int, int] = {}  # that serial -> the page

    def first_needed(self, num_tokens: int) -> int:
        """The first page the window of a query at position `num_tokens` reads."""
        return max(0, num_tokens - self.window + 1) // self.page_size

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        held = len(self.tables[seq_id].pages) if seq_id in self.tables else 0
        return max(0, -(-num_tokens // self.page_size) - held)

    # -- prefix hits ---------------------------------------------------------------------------------------------

    def usable_hit(self, serials: list[int]) -> int:
        """How many of a full prefix hit's pages (their registration serials, in order) can be taken: the largest
        m whose next token's window pages (`first_needed(m * page_size)` .. m - 1) are all cached here."""
        for m in range(len(serials), 0, -1):
            if all(serials[j] in self.page_of for j in range(self.first_needed(m * self.page_size), m)):
                return m
        return 0

    def admit(self, seq_id: int, serials: list[int]) -> None:
        """Gives the sequence the cached window pages of its hit (`usable_hit` pages, by their serials)."""
        start = self.first_needed(len(serials) * self.page_size)
        table = self.tables[seq_id] = WindowTable([SCRATCH_PAGE] * start, start, 0)
        for serial in serials[start:]:
            page = self.page_of[serial]
            self.pool.take(page)
            table.pages.append(page)

    def register(self, seq_id: int, index: int, serial: int | None) -> None:
        """Caches the sequence's full window page `index` under its full page's registration serial, if held."""
        table = self.tables.get(seq_id)
        if (serial is None or table is None or index < table.start or index >= len(table.pages)
                or serial in self.page_of):
            return
        page = table.pages[index]
        if page in self.serial_of:
            return
        self.serial_of[page] = serial
        self.page_of[serial] = page

    # -- allocation ----------------------------------------------------------------------------------------------

    def release_behind(self, seq_id: int, num_computed_tokens: int) -> None:
        """Releases the pages behind the window of the sequence's next computed token."""
        table = self.tables[seq_id]  # (every admitted sequence has one: `admit`)
        end = min(self.first_needed(num_computed_tokens), len(table.pages))
        for index in range(table.start, end):
            self._release(table.pages[index])
        table.start = max(table.start, end)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Adds the pages for the sequence's first `num_tokens` tokens (the caller checked `pages_needed` fit)."""
        table = self.tables[seq_id]
        needed = self.pages_needed(seq_id, num_tokens)
        if needed:
            table.changed(len(table.pages))
        for _ in range(needed):
            page = self.pool.next_free()
            self._forget(page)
            self.pool.take(page)
            table.pages.append(page)

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table is not None:
            for index in range(len(table.pages) - 1, table.start - 1, -1):
                self._release(table.pages[index])

    def trim(self, seq_id: int, keep: int) -> None:
        """Releases the pages past the first `keep` (the room rejected drafts had)."""
        table = self.tables.get(seq_id)
        if table is None or len(table.pages) <= max(keep, table.start):
            return
        while len(table.pages) > max(keep, table.start):
            self._release(table.pages.pop())
        table.changed(len(table.pages))

    def take_changes(self, seq_id: int, whole: bool = False) -> tuple[int, tuple[int, ...]] | None:
        """The sequence's table from the first index that changed since the last call (None: nothing did), or all of
        it when `whole` (a new admission)."""
        table = self.tables.get(seq_id)
        if table is None or (table.changed_from is None and not whole):
            return None
        first, table.changed_from = (0 if whole else table.changed_from), None
        return first, tuple(table.pages[first:])

    def _release(self, page: int) -> None:
        self.pool.release(page, cached=page in self.serial_of)

    def _forget(self, page: int) -> None:
        serial = self.serial_of.pop(page, None)
        if serial is not None:
            del self.page_of[serial]

    def reset(self) -> None:
        self.serial_of.clear()
        self.page_of.clear()

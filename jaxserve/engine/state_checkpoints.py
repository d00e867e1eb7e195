"""`StateCheckpoints`: prefix caching for models whose layers keep a per-sequence state (Gated DeltaNet's,
`layers/state_slots.py`). A prefix hit must start the state-keeping layers from the state the prefix left, so the
steps save states at every `interval`-th position a sequence's tokens pass (a multiple of the chunked form's 64
tokens and of the page size) into a pool of `capacity` checkpoint rows, and a hit is cut to the deepest such
position whose state is kept.

The host side of that pool: which row holds the state at the end of which cached page. A row is claimed for a save
when the step is scheduled (`save_row`), becomes findable when the prefix cache registers the page ending there
(`register`, keyed by that registration's serial: exact, as the pages are), and is evicted least recently used
first. Rows a scheduled step reads (`sources`) or will write (`pending`) are never evicted; the device runs steps
in order, so a row freed and claimed again is written after every earlier step read it.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, capacity: int, interval: int, page_size: int):
        self.capacity = capacity
        self.interval = interval
        self.page_size = page_size
        self.free_rows = list(range(capacity - 1, -1, -1))
        self.kept: OrderedDict[int, int] = OrderedDict()  # page registration serial -> row, least recent first
        self.pending: dict[tuple[int, int], int] = {}  # (seq id, position) -> the row its state is saved into
        self.sources: dict[int, int] = {}  # seq id -> the row its next chunk starts from (its prefix hit's)
        self.released: list[int] = []  # rows read by the step being scheduled and kept no longer: free after it
        self.num_saved = 0  # states saved by steps and registered (what tests read)

    def usable_hit(self, serials: list[int | None]) -> int:
        """How many of a prefix hit's pages (their registration serials, in order) the state allows: up to the
        deepest page ending at a checkpoint position whose state is kept."""
        for pages in range(len(serials), 0, -1):
            if pages * self.page_size % self.interval == 0 and serials[pages - 1] in self.kept:
                return pages
        return 0

    def admit(self, seq_id: int, serials: list[int | None]) -> None:
        """A sequence admitted with the prefix hit `serials` (`usable_hit`'s length): its first chunk reads the
        state kept at the hit's end."""
        if serials:
            row = self.kept[serials[-1]]
            self.kept.move_to_end(serials[-1])
            self.sources[seq_id] = row

    def take_source(self, seq_id: int) -> int:
        """The row a sequence's chunk starts from (-1: its slot's state, or zeros at position 0)."""
        row = self.sources.pop(seq_id, -1)
        if row >= 0 and row not in self.kept.values():  # evicted from the cache meanwhile: free once read
            self.released.append(row)
        return row

    def end_step(self) -> None:
        """The step's saves and sources are assigned: rows only it reads may be claimed from the next step on."""
        self.free_rows += self.released
        self.released.clear()

    def saves(self, seq_id: int, start: int, num_tokens: int) -> tuple[tuple[int, int], ...]:
        """(position, row) for each checkpoint position in `(start, start + num_tokens]`: the rows a step computing
        those tokens saves the states there into (none when every row is busy)."""
        first = start // self.interval + 1
        last = (start + num_tokens) // self.interval
        claimed = []
        for position in range(first * self.interval, last * self.interval + 1, self.interval):
            row = self._claim()
            if row is None:
                break
            self.pending[(seq_id, position)] = row
            claimed.append((position, row))
        return tuple(claimed)

    def _claim(self) -> int | None:
        if self.free_rows:
            return self.free_rows.pop()
        busy = set(self.sources.values())
        for serial, row in self.kept.items():  # least recently used first
            if row not in busy:
                del self.kept[serial]
                return row
        return None

    def register(self, seq_id: int, page_index: int, serial: int | None) -> None:
        """The prefix cache registered a sequence's page `page_index` as `serial` (None: not cached): the state
        saved at its end, if any, becomes findable (or its row is freed)."""
        row = self.pending.pop((seq_id, (page_index + 1) * self.page_size), None)
        if row is None:
            return
        if serial is None or serial in self.kept:
            self.free_rows.append(row)
            return
        self.kept[serial] = row
        self.num_saved += 1

    def forget(self, serial: int) -> None:
        """The page registered as `serial` left the prefix cache: no hit can end there any more."""
        row = self.kept.pop(serial, None)
        if row is not None and row not in self.sources.values():  # else freed once its reader's step is built
            self.free_rows.append(row)

    def free(self, seq_id: int) -> None:
        """A sequence left its slot: the states it was to save are dropped, and the hit it was to start from."""
        row = self.sources.pop(seq_id, -1)
        if row >= 0 and row not in self.kept.values() and row not in self.sources.values():
            self.free_rows.append(row)
        for key in [key for key in self.pending if key[0] == seq_id]:
            self.free_rows.append(self.pending.pop(key))

    def reset(self) -> None:
        """Nothing is findable any more (rows a scheduled chunk is to read are freed once it is built)."""
        busy = set(self.sources.values())
        self.free_rows += [row for row in self.kept.values() if row not in busy]
        self.kept.clear()

"""Prompt lookup decoding: propose the tokens that followed the latest earlier occurrence of a sequence's last n
tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), on the host, from the sequence's own tokens.

`NgramDrafter` keeps an `NgramIndex` per sequence: for every n, the n-grams of its tokens mapped to where they last
ended. A proposal indexes only the tokens appended since the previous one, so per-step host work is O(new tokens),
not O(sequence length).
"""

from __future__ import annotations


class NgramIndex:
    """The n-grams (min_n <= n <= max_n) of a growing token list, each mapped to the position it last ended at.

    Only n-grams ending before the last token are indexed, so a match of the sequence's own suffix always has at
    least one known token after it."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix found (or none)."""
        length = len(token_ids)
        for end in range(self.indexed, length - 1):
            for n, table in self.last_end.items():
                if end + 1 >= n:
                    table[tuple(token_ids[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in self.sizes:
            if length <= n:
                continue
            end = self.last_end[n].get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + k]
        return []


class NgramDrafter:
    """The n-gram proposer of the scheduler's sequences: one `NgramIndex` per sequence id, built on its first
    proposal and dropped when the sequence finishes (`forget`)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> tuple[int, ...]:
        """Up to `k` drafts for sequence `seq_id`, whose tokens are `token_ids` (the list it keeps growing)."""
        index = self.indexes.get(seq_id)
        if index is None:
            index = self.indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        return tuple(index.propose(token_ids, k)[:k])

    def forget(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)

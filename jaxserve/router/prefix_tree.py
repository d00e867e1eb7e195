"""`PrefixTree`: the router's approximate picture of what each worker's prefix cache holds (sglang-router's method).

One radix tree over request texts (characters, not tokens: the router does not tokenize), whose nodes list the
workers ("tenants") a request with that prefix was routed to, each with when it last was. `match(text)` gives, per
worker, how many leading characters of `text` were routed there; `insert(text, worker)` records a routing. It is
approximate by nature: a worker may have evicted what the tree remembers, or hold what another router sent it.

Size is bounded per worker (`max_chars`, characters it is tenant of): past it, the worker's least recently used
leaves are dropped (down to 90%, so eviction runs once per many inserts), and nodes no worker holds are removed.
"""

from __future__ import annotations

import itertools

EVICT_TO = 0.9  # of max_chars, once a worker's size passes max_chars


class _Node:
    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: _Node | None):
        self.text = text  # the edge label from the parent
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by first character
        self.tenants: dict[str, int] = {}  # worker -> tick of its last routing through this node


class PrefixTree:
    def __init__(self, max_chars: int = 2**22):
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}  # worker -> characters of the nodes it is tenant of
        self._ticks = itertools.count(1)

    def match(self, text: str) -> dict[str, int]:
        """Per worker, the length of the longest prefix of `text` routed to it (workers with none are absent)."""
        matched: dict[str, int] = {}
        node, depth = self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                break
            common = _common_length(child.text, text, depth)
            for worker in child.tenants:
                matched[worker] = depth + common
            if common < len(child.text):
                break
            node, depth = child, depth + common
        return matched

    def insert(self, text: str, worker: str) -> None:
        """Records that `text` was routed to `worker` (the whole path becomes its, as most recently used)."""
        tick = next(self._ticks)
        node, depth = self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                child = _Node(text[depth:], node)
                node.children[text[depth]] = child
            else:
                common = _common_length(child.text, text, depth)
                if common < len(child.text):
                    child = self._split(child, common)
            if worker not in child.tenants:
                self.sizes[worker] = self.sizes.get(worker, 0) + len(child.text)
            child.tenants[worker] = tick
            node, depth = child, depth + len(child.text)
        if self.sizes.get(worker, 0) > self.max_chars:
            self._evict(worker, int(self.max_chars * EVICT_TO))

    def remove_worker(self, worker: str) -> None:
        """Forgets everything routed to `worker` (it restarted, or left)."""
        self._evict(worker, 0)
        self.sizes.pop(worker, None)

    def _split(self, child: _Node, at: int) -> _Node:
        """Splits `child`'s edge after `at` characters; returns the new upper node (same tenants)."""
        upper = _Node(child.text[:at], child.parent)
        upper.tenants = dict(child.tenants)
        child.parent.children[upper.text[0]] = upper
        child.text = child.text[at:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def _evict(self, worker: str, target: int) -> None:
        """Drops `worker`'s least recently used leaves until its size is at most `target`."""
        while self.sizes.get(worker, 0) > target:
            leaves = [node for node in self._nodes() if worker in node.tenants
                      and not any(worker in c.tenants for c in node.children.values())]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda node: node.tenants[worker]):
                if self.sizes[worker] <= target:
                    break
                del leaf.tenants[worker]
                self.sizes[worker] -= len(leaf.text)
                self._prune(leaf)

    def _prune(self, node: _Node) -> None:
        while node is not self.root and not node.tenants and not node.children:
            del node.parent.children[node.text[0]]
            node = node.parent

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_length(edge: str, text: str, start: int) -> int:
    limit = min(len(edge), len(text) - start)
    count = 0
    while count < limit and edge[count] == text[start + count]:
        count += 1
    return count


__all__ = ["PrefixTree"]

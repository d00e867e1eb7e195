"""Which worker takes a request: `round_robin`, `shortest_queue`, `cache_aware` (sglang-router's names).

A policy sees only `WorkerLoad` snapshots of the healthy workers (no HTTP), so its decisions are unit-tested as
they are. Load is the requests this router has in flight on a worker plus the waiting sequences the worker last
reported (`jaxserve:num_requests_waiting` from its /metrics), so a worker other routers fill counts too.

`cache_aware`: when the load is balanced, the worker whose `PrefixTree` share of the request's text is longest,
if that share is at least `cache_threshold` of the text; otherwise (a miss, or balance lost) the least loaded.
Balance is lost, as in sglang-router, when max load - min load > `balance_abs_threshold` and
max load > min load x `balance_rel_threshold`. Every choice is recorded in the tree.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol

from jaxserve.router.prefix_tree import PrefixTree

POLICIES = ("cache_aware", "round_robin", "shortest_queue")


@dataclasses.dataclass(frozen=True)
class WorkerLoad:
    url: str
    in_flight: int = 0  # requests this router has open on it
    waiting: float = 0.0  # sequences it reported waiting

    @property
    def load(self) -> float:
        return self.in_flight + self.waiting


class Policy(Protocol):
    def choose(self, workers: list[WorkerLoad], text: str) -> str:
        """The url of the worker (one of `workers`, never empty) that takes a request for `text`."""


def least_loaded(workers: list[WorkerLoad]) -> WorkerLoad:
    """Fewest load; ties by the order given (the order of --worker-urls)."""
    return min(workers, key=lambda worker: worker.load)


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, workers: list[WorkerLoad], text: str) -> str:
        return workers[next(self._turn) % len(workers)].url


class ShortestQueue:
    def choose(self, workers: list[WorkerLoad], text: str) -> str:
        return least_loaded(workers).url


class CacheAware:
    def __init__(self, tree: PrefixTree, cache_threshold: float = 0.5, balance_abs_threshold: float = 32,
                 balance_rel_threshold: float = 1.5):
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.tree = tree
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(self, workers: list[WorkerLoad], text: str) -> str:
        idlest = least_loaded(workers)
        busiest = max(worker.load for worker in workers)
        balanced = not (busiest - idlest.load > self.balance_abs_threshold
                        and busiest > idlest.load * self.balance_rel_threshold)
        chosen = idlest.url
        if balanced and text:
            matched = self.tree.match(text)
            best = max(workers, key=lambda worker: (matched.get(worker.url, 0), -worker.load))
            if matched.get(best.url, 0) >= self.cache_threshold * len(text):
                chosen = best.url
        self.tree.insert(text, chosen)
        return chosen


def make_policy(name: str, tree: PrefixTree | None = None, **cache_aware: float) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "cache_aware":
        return CacheAware(tree if tree is not None else PrefixTree(), **cache_aware)
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")


__all__ = ["POLICIES", "CacheAware", "Policy", "RoundRobin", "ShortestQueue", "WorkerLoad", "least_loaded",
           "make_policy"]

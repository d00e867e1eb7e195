"""`WorkerPool`: the router's workers, their health, and the requests it has open on each.

A background loop asks every worker's `/health` each `interval` seconds and reads the waiting sequences from its
`/metrics`. The first check decides a worker's start; later, `failure_threshold` failed checks in a row (no
answer, a timeout or a status other than 200) eject a healthy worker, and one good check brings it back. A request
that could not connect ejects its worker at once (`connect_failed`). Ejected workers get no new requests; what
they already have runs on. Counters (ejections per worker) are read by `RouterMetrics`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

import httpx

from jaxserve.router.policies import WorkerLoad

logger = logging.getLogger(__name__)
WAITING_GAUGE = "jaxserve:num_requests_waiting"


@dataclasses.dataclass
class Worker:
    url: str
    healthy: bool = False
    checked: bool = False  # whether any health check answered or failed yet
    failures: int = 0  # failed checks in a row
    in_flight: int = 0
    waiting: float = 0.0
    ejections: int = 0

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.url, self.in_flight, self.waiting)


class WorkerPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, interval: float = 5.0,
                 failure_threshold: int = 2, check_timeout: float = 5.0):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.workers = {url: Worker(url) for url in urls}
        self._client = client
        self.interval = interval
        self.failure_threshold = failure_threshold
        self.check_timeout = check_timeout

    def healthy(self, exclude: frozenset[str] = frozenset()) -> list[Worker]:
        """The workers that take new requests, in --worker-urls order."""
        return [worker for worker in self.workers.values() if worker.healthy and worker.url not in exclude]

    def connect_failed(self, url: str) -> None:
        """A request could not reach `url`: it is ejected now (the health checks bring it back)."""
        worker = self.workers[url]
        worker.failures = max(worker.failures, self.failure_threshold)
        self._eject(worker, "a request could not connect")

    async def run(self) -> None:
        """Checks every worker each `interval` seconds, forever (cancel to stop)."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(worker) for worker in self.workers.values()))

    async def _check(self, worker: Worker) -> None:
        try:
            answer = await self._client.get(worker.url + "/health", timeout=self.check_timeout)
            ok = answer.status_code == 200
            reason = f"/health answered {answer.status_code}"
        except httpx.HTTPError as err:
            ok, reason = False, f"/health failed: {type(err).__name__}"
        first = not worker.checked
        worker.checked = True
        if ok:
            if not worker.healthy:
                logger.info("worker %s is healthy%s", worker.url, "" if first else " again: it rejoins")
            worker.healthy, worker.failures = True, 0
            await self._read_waiting(worker)
            return
        worker.failures += 1
        if first:
            logger.warning("worker %s is not healthy yet (%s)", worker.url, reason)
        elif worker.failures >= self.failure_threshold:
            self._eject(worker, reason)

    def _eject(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            worker.healthy = False
            worker.ejections += 1
            logger.warning("worker %s ejected: %s", worker.url, reason)

    async def _read_waiting(self, worker: Worker) -> None:
        try:
            answer = await self._client.get(worker.url + "/metrics", timeout=self.check_timeout)
        except httpx.HTTPError:
            return
        if answer.status_code != 200:
            return
        waiting = 0.0
        for line in answer.text.splitlines():
            if line.startswith(WAITING_GAUGE + "{") or line.startswith(WAITING_GAUGE + " "):
                try:
                    value = float(line.rsplit(" ", 1)[1])
                except ValueError:
                    continue  # not ours to trust: a malformed line counts as nothing
                if math.isfinite(value) and value >= 0:
                    waiting += value
        worker.waiting = waiting


__all__ = ["Worker", "WorkerPool"]

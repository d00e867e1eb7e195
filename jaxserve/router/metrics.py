"""The router's Prometheus metrics, in a private registry: requests routed, retries and ejections per worker,
and each worker's health and requests in flight (read from the `WorkerPool` at scrape time)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.router.workers import WorkerPool

PREFIX = "jaxserve_router:"


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool):
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy", "1 while a worker takes new requests, else 0.",
                                    labels=["worker"])
        in_flight = GaugeMetricFamily(PREFIX + "requests_in_flight", "Requests this router has open on a worker.",
                                      labels=["worker"])
        ejections = CounterMetricFamily(PREFIX + "ejections", "Times a worker was ejected (failed health checks "
                                        "or a request that could not connect).", labels=["worker"])
        for worker in self._pool.workers.values():
            healthy.add_metric([worker.url], float(worker.healthy))
            in_flight.add_metric([worker.url], worker.in_flight)
            ejections.add_metric([worker.url], worker.ejections)
        yield from (healthy, in_flight, ejections)


class RouterMetrics:
    def __init__(self, pool: WorkerPool):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_PoolCollector(pool))
        self.requests = Counter(PREFIX + "requests", "Requests routed to a worker (that it accepted).",
                                labelnames=["worker"], registry=self.registry)
        self.retries = Counter(PREFIX + "retries", "Requests that could not connect to a worker and were retried "
                               "on another.", labelnames=["worker"], registry=self.registry)
        for url in pool.workers:  # every worker's series exists from the start, at 0
            self.requests.labels(url)
            self.retries.labels(url)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["RouterMetrics"]

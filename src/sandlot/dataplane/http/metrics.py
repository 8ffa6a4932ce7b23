"""Prometheus metrics of the dataplane.

Families (``route`` is the route's template, e.g. ``/execs/{exec_id}``, or ``unmatched``):

- ``sandlot_dataplane_requests_total{method, route, status}``: HTTP requests answered;
- ``sandlot_dataplane_request_duration_seconds{method, route}``: their time, from the
  request to the end of the answer (a histogram);
- ``sandlot_dataplane_websockets{route}``: WebSockets open now;
- ``sandlot_dataplane_websockets_refused_total{limit}``: sockets closed with 4429
  (``token``, ``sandbox``, ``unauthenticated``);
- ``sandlot_dataplane_sandboxes``, ``sandlot_dataplane_execs_running``,
  ``sandlot_dataplane_shells``: what the host serves now;
- ``sandlot_errors_total{code}``: error envelopes and error closes by wire code. In
  ``sandlot serve`` this is the broker's own counter (:meth:`DataplaneMetrics.attach`),
  so one family counts the errors of both; a standalone dataplane has its own.

Requests are counted in plain dictionaries on the event loop (a dictionary update and
a bisection, well under a microsecond, where a ``prometheus_client`` histogram takes a
lock and a label lookup) and turned into metric families when scraped. Errors are
read from the envelope the answer carries, so whichever code wrote it, it is counted.
``prometheus_client`` itself is imported on the first scrape (or when the broker attaches
its registry): a dataplane in a container starts without it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from sandlot.protocol.errors import exception_for

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

    from sandlot.dataplane.services.sandbox import SandboxEntry
    from sandlot.dataplane.services.socketlimits import SocketLimits

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNMATCHED = "unmatched"


def errors_counter(registry: CollectorRegistry | None) -> Counter:
    """``sandlot_errors_total``, as the broker defines it."""
    from prometheus_client import Counter

    return Counter("sandlot_errors_total", "Error responses by code", ["code"], registry=registry)


class DataplaneMetrics:
    """The figures of one dataplane host: its requests, sockets and sandboxes."""

    def __init__(self, sockets: SocketLimits, entries: Callable[[], list[SandboxEntry]]) -> None:
        self.sockets = sockets
        self.entries = entries
        #: (method, route, status) → requests.
        self.requests: dict[tuple[str, str, int], int] = {}
        #: (method, route) → requests per bucket (not cumulative; the last one is +Inf),
        #: then the sum of their seconds.
        self.durations: dict[tuple[str, str], list[float]] = {}
        #: Errors by code, until the broker's counter takes over (:meth:`attach`).
        self.error_counts: dict[str, int] = {}
        self.errors: Counter | None = None
        self._error_children: dict[str, Any] = {}
        self._registry: CollectorRegistry | None = None

    # --- counting (on the event loop) ---------------------------------------------------

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.durations.get((method, route))
        if hist is None:
            hist = self.durations[(method, route)] = [0.0] * (len(BUCKETS) + 2)
        hist[bisect.bisect_left(BUCKETS, seconds)] += 1
        hist[-1] += seconds

    def error(self, code: str) -> None:
        if self.errors is None:
            self.error_counts[code] = self.error_counts.get(code, 0) + 1
            return
        child = self._error_children.get(code)
        if child is None:
            child = self._error_children[code] = self.errors.labels(code)
        child.inc()

    def error_answer(self, status: int, body: bytes) -> None:
        """An answer with an error status: count the code of its envelope."""
        code = None
        if body:
            try:
                code = json.loads(body)["error"]["code"]
            except (ValueError, LookupError, TypeError):
                code = None
        if not isinstance(code, str):
            code = exception_for("", status).code  # no envelope (a HEAD answer)
        self.error(code)

    # --- where they are served ----------------------------------------------------------

    def attach(self, registry: CollectorRegistry, errors: Counter) -> None:
        """Serve these figures from ``registry`` (the broker's), errors counted in ``errors``
        (those counted before are carried over)."""
        self.errors = errors
        self._error_children = {}
        for code, count in self.error_counts.items():
            errors.labels(code).inc(count)
        self.error_counts = {}
        registry.register(self.collector())

    def collector(self) -> Collector:
        """These figures as a ``prometheus_client`` collector."""
        from prometheus_client.registry import Collector

        figures = self

        class Figures(Collector):
            def collect(self) -> Iterator[Metric]:
                return figures.collect()

        return Figures()

    def render(self) -> bytes:
        """The Prometheus text of a dataplane that has no broker beside it."""
        from prometheus_client import CollectorRegistry, generate_latest

        if self._registry is None:
            registry = CollectorRegistry()
            registry.register(self.collector())
            self._registry = registry
        return generate_latest(self._registry)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        # May run in a thread (the broker renders off the loop): every container is
        # copied in one step before it is read.
        requests = CounterMetricFamily(
            "sandlot_dataplane_requests",
            "HTTP requests answered by the dataplane",
            labels=["method", "route", "status"],
        )
        for (method, route, status), count in list(self.requests.items()):
            requests.add_metric([method, route, str(status)], count)
        yield requests
        durations = HistogramMetricFamily(
            "sandlot_dataplane_request_duration_seconds",
            "Time to answer a dataplane HTTP request",
            labels=["method", "route"],
        )
        for (method, route), hist in list(self.durations.items()):
            counts = list(hist)
            buckets: list[tuple[str, float]] = []
            total = 0.0
            for bound, n in zip((*BUCKETS, float("inf")), counts, strict=False):
                total += n
                buckets.append((_bound(bound), total))
            durations.add_metric([method, route], buckets, counts[-1])
        yield durations
        limits = self.sockets
        sockets = GaugeMetricFamily(
            "sandlot_dataplane_websockets", "WebSockets open", labels=["route"]
        )
        for route in ("/exec/ws", "/execute/ws", "/shell/ws", "/events/ws", "/events"):
            sockets.add_metric([route], limits.by_route.get(route, 0))
        yield sockets
        refused = CounterMetricFamily(
            "sandlot_dataplane_websockets_refused",
            "WebSockets closed with 4429 (too many), by the limit reached",
            labels=["limit"],
        )
        for limit in ("token", "sandbox", "unauthenticated"):
            refused.add_metric([limit], limits.refused.get(limit, 0))
        yield refused
        entries = self.entries()
        yield GaugeMetricFamily(
            "sandlot_dataplane_sandboxes", "Sandboxes the dataplane serves", len(entries)
        )
        yield GaugeMetricFamily(
            "sandlot_dataplane_execs_running",
            "Commands running",
            sum(e.execs.running for e in entries),
        )
        yield GaugeMetricFamily(
            "sandlot_dataplane_shells", "Shells open", sum(len(e.shells.all()) for e in entries)
        )
        if self.errors is None:  # a dataplane without a broker: its own errors_total
            errors = CounterMetricFamily(
                "sandlot_errors", "Error responses by code", labels=["code"]
            )
            for code, count in list(self.error_counts.items()):
                errors.add_metric([code], count)
            yield errors


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)

"""Prometheus metrics of the web server: its gateway's, and its own.

The gateway's families (``outcome`` is the answer's HTTP status, or why there was none:
``unreachable``, ``timeout``, ``connection_lost``, ``dns``, ``busy``):

- ``sandlot_gateway_requests_total{upstream, method, outcome}``: exchanges with upstreams;
- ``sandlot_gateway_request_seconds{upstream}``: their time to the answer's head;
- ``sandlot_gateway_retries_total{upstream}``: calls sent again;
- ``sandlot_gateway_body_failures_total{upstream, reason}``: bodies that broke while
  they streamed (``connection_lost``, ``length_mismatch``, ``timeout``);
- ``sandlot_gateway_refusals_total{reason}``: calls refused (``host``, ``path``,
  ``redirect``, ``dns_changed``…);
- ``sandlot_gateway_breaker_state{upstream, state}``: 1 for each breaker's state now.

The web server's own (:class:`WebMetrics`; ``channel`` is ``pty`` for ``/ws/pty``,
``chat`` for ``/ws/claude-stream``):

- ``sandlot_web_attach_failures_total{channel, reason}``: accepted sockets that ended
  before they were attached to a shell or an agent: ``rate_limited`` (a connect limit;
  a handshake refused for its origin or sign-in is not accepted, nor counted here),
  ``unknown_provider``,
  ``session_not_found``, ``upstream`` (the workspace could not be reached or did not
  open it: retryable), ``refused`` (a request refused: bad parameters, a template's
  values, the dataplane's refusal), ``internal``, ``other`` (closed before, the server
  shutting down);
- ``sandlot_web_socket_disconnects_total{channel, side}``: accepted sockets closed, by
  who ended them: ``browser`` (it left), ``upstream`` (the shell or agent exited, or the
  dataplane went), ``server`` (a refusal or failure of the server's), ``limit`` (a
  connect limit, or a queue that overflowed);
- ``sandlot_web_sockets_open{channel}``: sockets open now;
- ``sandlot_web_route_limited_total{route}``: requests refused by a route's rate limit
  (``/api/tree``, ``/api/search``, ``/api/v1/grep``);
- ``sandlot_web_ready``: 1 when ``/api/readyz`` would answer ready, else 0 (the same
  dependency states: the workspaces', the gateway's breakers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandlot.web.breaker import BreakerState

#: The browser's live sockets, each in ``sandlot_web_sockets_open`` from the start.
CHANNELS = ("pty", "chat")
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class GatewayMetrics:
    """The gateway's figures, in ``registry``; ``states`` gives each breaker's state."""

    def __init__(self, registry: CollectorRegistry, states: Callable[[], dict[str, str]]) -> None:
        self.exchanges = Counter(
            "sandlot_gateway_requests_total",
            "Upstream exchanges by upstream, method and outcome (HTTP status or failure)",
            ["upstream", "method", "outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "sandlot_gateway_request_seconds",
            "Time from a call to its upstream's answer head",
            ["upstream"],
            registry=registry,
            buckets=BUCKETS,
        )
        self.retries = Counter(
            "sandlot_gateway_retries_total", "Calls sent again", ["upstream"], registry=registry
        )
        self.body_failures = Counter(
            "sandlot_gateway_body_failures_total",
            "Answers whose body broke while it streamed",
            ["upstream", "reason"],
            registry=registry,
        )
        self.refusals = Counter(
            "sandlot_gateway_refusals_total", "Calls refused", ["reason"], registry=registry
        )
        registry.register(_BreakerStates(states))

    def exchange(self, upstream: str, method: str, outcome: str, seconds: float) -> None:
        self.exchanges.labels(upstream, method, outcome).inc()
        self.seconds.labels(upstream).observe(seconds)


class _BreakerStates(Collector):
    def __init__(self, states: Callable[[], dict[str, str]]) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "sandlot_gateway_breaker_state",
            "1 for the state each upstream's breaker is in",
            labels=["upstream", "state"],
        )
        for name, now in self.states().items():
            for state in BreakerState:
                family.add_metric([name, state.value], 1.0 if now == state.value else 0.0)
        yield family


class WebMetrics:
    """The web server's own figures, in ``registry``: one set per registry (:meth:`of`),
    which takes each name once, however many parts of the server count into it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.attach_failures = Counter(
            "sandlot_web_attach_failures_total",
            "Terminal and chat sockets that ended before they were attached, by reason",
            ["channel", "reason"],
            registry=registry,
        )
        self.disconnects = Counter(
            "sandlot_web_socket_disconnects_total",
            "Terminal and chat sockets closed, by the side that ended them",
            ["channel", "side"],
            registry=registry,
        )
        self.sockets_open = Gauge(
            "sandlot_web_sockets_open",
            "Terminal and chat sockets open now",
            ["channel"],
            registry=registry,
        )
        for channel in CHANNELS:
            self.sockets_open.labels(channel)
        self.route_limited = Counter(
            "sandlot_web_route_limited_total",
            "Requests refused by a route's rate limit",
            ["route"],
            registry=registry,
        )
        self._readiness = _Readiness()
        registry.register(self._readiness)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> WebMetrics:
        """The set in ``registry``, made at the first call."""
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = cls(registry)
        return metrics

    def watch_readiness(self, ready: Callable[[], bool]) -> None:
        """Export ``sandlot_web_ready`` as ``ready()`` says at each scrape."""
        self._readiness.ready = ready

    def socket_opened(self, channel: str) -> None:
        self.sockets_open.labels(channel).inc()

    def socket_closed(self, channel: str, side: str, failure: str | None) -> None:
        """An accepted socket closed; ``failure``: why it was never attached, if it was not."""
        self.sockets_open.labels(channel).dec()
        self.disconnects.labels(channel, side).inc()
        if failure is not None:
            self.attach_failures.labels(channel, failure).inc()


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, WebMetrics] = weakref.WeakKeyDictionary()


class _Readiness(Collector):
    NAME = "sandlot_web_ready"
    HELP = "1 when /api/readyz answers ready (its dependencies are), else 0"

    def __init__(self) -> None:
        self.ready: Callable[[], bool] | None = None

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[Metric]:
        if self.ready is not None:
            yield GaugeMetricFamily(self.NAME, self.HELP, value=1.0 if self.ready() else 0.0)

"""Prometheus metrics of the gateway.

Families (``outcome`` is the answer's HTTP status, or why there was none:
``unreachable``, ``timeout``, ``connection_lost``, ``dns``, ``busy``):

- ``sandlot_gateway_requests_total{upstream, method, outcome}``: exchanges with upstreams;
- ``sandlot_gateway_request_seconds{upstream}``: their time to the answer's head;
- ``sandlot_gateway_retries_total{upstream}``: calls sent again;
- ``sandlot_gateway_body_failures_total{upstream, reason}``: bodies that broke while
  they streamed (``connection_lost``, ``length_mismatch``, ``timeout``);
- ``sandlot_gateway_refusals_total{reason}``: calls refused (``host``, ``path``,
  ``redirect``, ``dns_changed``…);
- ``sandlot_gateway_breaker_state{upstream, state}``: 1 for each breaker's state now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandlot.web.breaker import BreakerState

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

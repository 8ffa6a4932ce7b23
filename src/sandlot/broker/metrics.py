"""Prometheus metrics of the broker (``GET /metrics``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from sandlot.broker.core import Broker


class Metrics:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.registry = CollectorRegistry()
        self.negotiations = Histogram(
            "sandlot_negotiation_seconds",
            "Time to answer a session negotiation",
            ["mode"],
            registry=self.registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.sandboxes = Gauge(
            "sandlot_sandboxes", "Sandboxes by state", ["state"], registry=self.registry
        )
        self.errors = Counter(
            "sandlot_errors_total", "Error responses by code", ["code"], registry=self.registry
        )

    def error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def negotiation(self, mode: str, seconds: float) -> None:
        self.negotiations.labels(mode).observe(seconds)

    def render(self) -> bytes:
        counts: dict[str, int] = {}
        for row in self.broker.sandboxes.list_live():
            counts[row.state.value] = counts.get(row.state.value, 0) + 1
        for state in ("provisioning", "active", "idle", "suspended"):
            self.sandboxes.labels(state).set(counts.get(state, 0))
        return generate_latest(self.registry)

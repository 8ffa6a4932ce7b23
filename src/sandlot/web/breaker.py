"""A circuit breaker per upstream: ``closed``, ``open``, ``half-open``.

``closed``: calls go through; ``failures`` failures in a row open it. ``open``: calls
are refused at once (retryable, with the seconds left as ``Retry-After``) for
``cool_down`` seconds; then ``half-open``: one call, the trial, goes through while the
others are refused as if it were open. The trial's success closes the breaker, its
failure opens it again for another cool-down.

Each call takes a :class:`Ticket` from :meth:`CircuitBreaker.admit` and reports how it
went with :meth:`CircuitBreaker.record`. A ticket is of one *generation* of the
breaker (every change of state starts a new one): the outcome of a call admitted
before the last change is ignored, so a slow call admitted while closed cannot close
a breaker that opened since, nor reopen one a trial has just closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from sandlot.protocol.errors import ProviderUnavailable
from sandlot.protocol.states import IllegalTransition

log = logging.getLogger("sandlot.web")


class BreakerState(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half-open"
    OPEN = "open"


_MOVES: dict[BreakerState, frozenset[BreakerState]] = {
    BreakerState.CLOSED: frozenset({BreakerState.OPEN}),
    BreakerState.OPEN: frozenset({BreakerState.HALF_OPEN}),
    BreakerState.HALF_OPEN: frozenset({BreakerState.CLOSED, BreakerState.OPEN}),
}


@dataclass(frozen=True)
class Ticket:
    """One admitted call: the breaker's generation then, and whether it is the trial."""

    generation: int
    trial: bool


class CircuitBreaker:
    """The breaker of one upstream (``name`` is for log lines and errors).

    ``openings`` counts the times it opened (the gateway checks an upstream's version
    again after each); ``clock`` is :func:`time.monotonic` unless a test drives time.
    """

    def __init__(
        self,
        name: str,
        *,
        failures: int = 5,
        cool_down: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or cool_down <= 0:
            raise ValueError("a breaker needs failures >= 1 and cool_down > 0")
        self.name = name
        self.failures = failures
        self.cool_down = cool_down
        self._clock = clock
        self.openings = 0
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._consecutive = 0
        self._opened_at = 0.0
        self._trial_out = False

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose cool-down has passed is half-open)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cool_down:
            self._move(BreakerState.HALF_OPEN)
        return self._state

    def admit(self) -> Ticket:
        """A ticket for one call, or :class:`ProviderUnavailable` while open (or while
        the half-open trial is out), with the seconds to wait as ``retry_after``."""
        state = self.state
        if state is BreakerState.CLOSED:
            return Ticket(self._generation, trial=False)
        if state is BreakerState.HALF_OPEN and not self._trial_out:
            self._trial_out = True
            return Ticket(self._generation, trial=True)
        left = max(self.cool_down - (self._clock() - self._opened_at), 0.0)
        raise ProviderUnavailable(
            "the sandbox host is failing; calls are paused",
            metadata={"reason": "circuit_open", "upstream": self.name},
            retry_after=left if state is BreakerState.OPEN else self.cool_down,
        )

    def record(self, ticket: Ticket, ok: bool) -> None:
        """Report how an admitted call went (the answer came, or it failed)."""
        if ticket.generation != self._generation:
            return
        if self._state is BreakerState.HALF_OPEN:
            if ticket.trial:
                self._move(BreakerState.CLOSED if ok else BreakerState.OPEN)
            return
        if ok:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._consecutive >= self.failures:
            self._move(BreakerState.OPEN)

    def abandon(self, ticket: Ticket) -> None:
        """A call ended with no outcome (its caller went away): free the trial slot."""
        if ticket.trial and ticket.generation == self._generation:
            self._trial_out = False

    def _move(self, target: BreakerState) -> None:
        if target not in _MOVES[self._state]:
            raise IllegalTransition(f"breaker: {self._state} → {target} is not allowed")
        old, self._state = self._state, target
        self._generation += 1
        self._consecutive = 0
        self._trial_out = False
        if target is BreakerState.OPEN:
            self._opened_at = self._clock()
            self.openings += 1
        level = logging.WARNING if target is BreakerState.OPEN else logging.INFO
        log.log(level, "gateway: upstream %s breaker %s → %s", self.name, old, target)

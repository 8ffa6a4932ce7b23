"""What every call of the SDK shares: a whole HTTP answer, a deadline, a retry budget."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sandlot.protocol.errors import InvalidRequest, RequestTimeout


@dataclass(frozen=True)
class Response:
    """A whole HTTP answer: status, headers (names in lower case) and body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` if it is not)."""
        return json.loads(self.content)


class Deadline:
    """A client-side deadline shared by every step of one call.

    ``idle`` bounds each step on its own (a connection opened, a piece of a body
    sent or received): a transfer of any length goes on while bytes keep moving,
    and fails once none moved for that long.
    """

    def __init__(self, seconds: float | None, *, idle: float | None = None) -> None:
        self.seconds = seconds
        self.idle = idle
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds the next step may take (``None``: no limit); raises ``TimeoutError``
        once the deadline is past."""
        if self.at is None:
            return self.idle
        left = self.at - time.monotonic()
        if left <= 0:
            raise RequestTimeout(f"deadline of {self.seconds} s exceeded")
        return left if self.idle is None else min(left, self.idle)


class RetryBudget:
    """When to stop reconnecting a stream whose connection broke.

    Given up after ``attempts`` consecutive failures; once the server has
    acknowledged the stream (a command's ``ready``, an event), only when those
    failures also span ``window`` seconds: a running command outlives a network
    outage of that long, while a server that never answered fails fast. Every
    acknowledgement starts a new budget.
    """

    def __init__(self, attempts: int = 5, window: float = 30.0) -> None:
        self.attempts = attempts
        self.window = window
        self.failures = 0
        self.acknowledged = False
        self._since: float | None = None

    def acknowledge(self) -> None:
        """The server acknowledged the stream: a new budget."""
        self.failures = 0
        self.acknowledged = True
        self._since = None

    def fail(self) -> bool:
        """Count one failure; whether to try again (after :meth:`backoff` seconds)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self.failures += 1
        if self.failures <= self.attempts:
            return True
        return self.acknowledged and now - self._since < self.window

    def backoff(self) -> float:
        """Seconds to wait before the next attempt (doubling, at most 2 s)."""
        return min(0.05 * (1 << min(self.failures, 8)), 2.0)


#: What a value UTF-8 cannot carry (a lone surrogate, as a model's JSON may hold) raises
#: when it would go into a URL: the protocol's error, not a ``UnicodeEncodeError`` out of
#: the caller's tool (an MCP tool call answered an internal error).
NOT_UTF8 = "path is not valid UTF-8: a lone surrogate cannot be sent"


def seg(value: str) -> str:
    """``value`` as one segment of a URL's path: an id a caller passes (a session id from
    a model's tool call, say) can add no segment, query or fragment (``x?terminate=true``
    ended a session whose release asked to keep it)."""
    if not value:
        # An empty id adds no segment: the request would reach the collection's route.
        raise InvalidRequest("an id cannot be empty")
    try:
        return quote(value, safe="")
    except UnicodeEncodeError:
        raise InvalidRequest(NOT_UTF8) from None

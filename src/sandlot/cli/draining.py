"""Graceful shutdown of ``sandlot serve``: every request in flight gets an answer.

On SIGTERM uvicorn stops accepting connections, lets the requests in flight run for
``timeout_graceful_shutdown`` seconds, then cancels them, and answers each one that had
not started its answer with a plain-text ``500 Internal Server Error`` of its own.
:class:`Drain` sits in front of the whole app and gets there first: once shutdown has
begun, a request still unanswered after :data:`DRAIN_GRACE_SECONDS` (an upload that is
still arriving, a long command) is cancelled (an upload's temporary file is removed as
on any other failure) and answered with the error envelope, 503 PROVIDER_UNAVAILABLE,
``retryable``, with ``Retry-After`` and ``Connection: close``: a client retries it
against the next server. An answer already started (a download, an event stream) is
left to finish until uvicorn's deadline; past it the connection is closed and the client
sees the answer cut short (an incomplete body), never a wrong one.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.dataplane.http.web import error_response, request_id_of
from sandlot.protocol.errors import ProviderUnavailable

#: How long uvicorn lets requests in flight run after SIGTERM before it cancels them.
GRACEFUL_SHUTDOWN_SECONDS = 5.0
#: How long :class:`Drain` lets them run before it answers 503 (leaving time to send it).
DRAIN_GRACE_SECONDS = 3.5


class _InFlight:
    __slots__ = ("send", "started", "task")

    def __init__(self, task: asyncio.Task[Any] | None, send: Send) -> None:
        self.task = task
        self.send = send
        self.started = False

    async def tracked(self, message: Message) -> None:
        self.started = True
        await self.send(message)


class Drain:
    """ASGI wrapper: after :meth:`begin`, unanswered requests end as 503 envelopes."""

    def __init__(self, app: ASGIApp, grace: float = DRAIN_GRACE_SECONDS) -> None:
        self.app = app
        self.grace = grace
        self.draining = False
        self._in_flight: set[_InFlight] = set()
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = _InFlight(asyncio.current_task(), send)
        self._in_flight.add(request)
        try:
            await self.app(scope, receive, request.tracked)
        except asyncio.CancelledError:
            # Cancelled by us (or, past its deadline, by uvicorn) while shutting down.
            if not self.draining or request.started:
                raise
            if request.task is not None:
                request.task.uncancel()
            await _unavailable(scope, receive, send)
        finally:
            self._in_flight.discard(request)

    def begin(self) -> None:
        """Shutdown has begun: requests unanswered ``grace`` seconds from now are cut."""
        self.draining = True
        self._timer = asyncio.get_running_loop().call_later(self.grace, self._cut)

    def end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _cut(self) -> None:
        for request in list(self._in_flight):
            if not request.started and request.task is not None:
                request.task.cancel()


async def _unavailable(scope: Scope, receive: Receive, send: Send) -> None:
    rid = request_id_of(Headers(scope=scope))
    response = error_response(
        ProviderUnavailable("the server is shutting down", retry_after=1), rid
    )
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that starts its :class:`Drain` when it starts shutting down."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.begin()
        try:
            await super().shutdown(sockets=sockets)
        finally:
            self.drain.end()

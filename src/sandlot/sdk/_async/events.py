"""Ordered event logs as iterators that resume where they left off.

Used for a sandbox's log (``/events``, SSE or WebSocket, PROTOCOL.md 3.7) and
for a binding's log on the broker (2.6). A dropped connection is reopened
with ``after`` = the last sequence seen, so no event is lost or repeated.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from sandlot.protocol.errors import SandlotError, SocketClosed, Unauthenticated, error_from_wire
from sandlot.sdk import _aio
from sandlot.sdk._async._http import KEEPALIVE, AsyncHTTP, open_timeout
from sandlot.sdk.transport import Deadline, RetryBudget
from sandlot.sdk.types import Event

#: Consecutive failed reconnections before giving up (reset by every event)...
RECONNECT_ATTEMPTS = 5
#: ...and, once an event came, seconds they must also span.
RECONNECT_WINDOW = 30.0


class AsyncEventStream:
    """An async iterator of :class:`~sandlot.sdk.types.Event`, resuming after drops.

    Use it as ``async with sandbox.events(after=n) as events: async for ev in events``
    (or call :meth:`aclose`). ``last_sequence`` is the cursor to resume from later.
    """

    def __init__(
        self,
        http: AsyncHTTP,
        path: str,
        *,
        after: int | None,
        timeout: float | None,
        transport: str = "sse",
        ws_url: Callable[[int], str] | None = None,
        keepalive: float | None = KEEPALIVE,
    ) -> None:
        if transport not in ("sse", "ws"):
            raise ValueError("transport is 'sse' or 'ws'")
        self._http = http
        self._path = path
        self.last_sequence = after or 0
        self._deadline = Deadline(timeout)
        self._transport = transport
        self._ws_url = ws_url
        self._keepalive = keepalive
        self._gen = self._run()

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> Event:
        return await self._gen.__anext__()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading and close the connection."""
        await self._gen.aclose()

    async def _run(self) -> AsyncGenerator[Event, None]:
        budget = RetryBudget(RECONNECT_ATTEMPTS, RECONNECT_WINDOW)
        while True:
            try:
                source = self._sse() if self._transport == "sse" else self._ws()
                try:
                    async for body in source:
                        event = Event.from_wire(body)
                        if event.sequence <= self.last_sequence:
                            continue
                        self.last_sequence = event.sequence
                        budget.acknowledge()
                        yield event
                finally:
                    # Close the connection now, not when the generator is collected.
                    await source.aclose()
                return
            except TimeoutError:
                # A deadline, not a broken connection (TimeoutError is an OSError).
                raise
            except OSError:  # SocketClosed included
                if not budget.fail():
                    raise
                await _aio.sleep(budget.backoff())

    def _sse(self) -> AsyncGenerator[dict[str, Any], None]:
        return self._http.sse(
            self._path, deadline=self._deadline, params={"after": self.last_sequence}
        )

    async def _ws(self) -> AsyncGenerator[dict[str, Any], None]:
        assert self._ws_url is not None
        ws = await _aio.ws_connect(
            self._ws_url(self.last_sequence),
            self._http.auth(),
            open_timeout(self._deadline, self._keepalive),
            self._keepalive,
        )
        try:
            while True:
                try:
                    raw = await _aio.ws_recv(ws, self._deadline.remaining())
                except SocketClosed:
                    code = _aio.ws_close_code(ws)
                    if code == 4401:
                        raise Unauthenticated("event socket closed: credential refused") from None
                    if code is not None and code >= 4000:
                        raise SandlotError(f"event socket closed with {code}") from None
                    raise
                body = json.loads(raw)
                if body.get("type") == "error":
                    raise error_from_wire({"error": body}, 400)
                if "sequence" in body:
                    yield body
        finally:
            await _aio.ws_close(ws)


async def wait_for_state(
    stream: AsyncEventStream, done: Callable[[Event], bool], failed: Callable[[Event], bool]
) -> Event:
    """Read ``stream`` until ``done(event)``; raise if ``failed(event)`` or it ends first."""
    try:
        async for event in stream:
            if failed(event):
                raise SandlotError(f"{event.event_type}: {event.details}")
            if done(event):
                return event
    finally:
        await stream.aclose()
    raise SandlotError("event stream ended before the awaited state")

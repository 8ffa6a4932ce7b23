"""Relaying a WebSocket: frames both ways between a browser and an upstream.

:func:`relay` pumps an accepted browser socket (a Starlette ``WebSocket``, or anything
with its ASGI ``receive``/``send``) and an upstream one opened by
:meth:`sandlot.web.gateway.Gateway.websocket`, through a bounded queue each way, until
either side closes; the other is then closed with the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed


class BrowserSocket(Protocol):
    """The browser's side of a relay: an accepted Starlette ``WebSocket`` (ASGI messages)."""

    async def receive(self) -> MutableMapping[str, Any]: ...

    async def send(self, message: MutableMapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class RelayEnd:
    """How a relay ended: which side closed first, with what code and reason."""

    closed_by: Literal["browser", "upstream"]
    code: int | None
    reason: str


@dataclass(frozen=True)
class _Closed:
    """The source of a pump closed (with this code and reason)."""

    code: int | None
    reason: str


@dataclass(frozen=True)
class _SinkGone:
    """The side a pump writes to failed: that side is gone."""


Frame = str | bytes
#: Close codes one side may send on behalf of the other as they are.
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})
#: The upstream went away without a close frame: the browser may try again later.
TRY_AGAIN_LATER = 1013


def _passable(code: int | None, default: int) -> int:
    if code is not None and (code in _SENDABLE or 3000 <= code < 5000):
        return code
    return default


async def relay(
    browser: BrowserSocket, upstream: ClientConnection, *, queue_frames: int = 64
) -> RelayEnd:
    """Pump frames both ways between an accepted browser WebSocket and an upstream one
    (from :meth:`Gateway.websocket`) until either side closes; then close the other
    with the same code (an upstream lost without one: 1013, try again later).

    Each direction has a queue of at most ``queue_frames`` frames: a side that does not
    read holds up the other's reading, and so, through TCP, its sender. Frames already
    queued are delivered before the close is passed on.
    """

    async def from_browser() -> Frame | _Closed:
        message = await browser.receive()
        if message["type"] == "websocket.disconnect":
            return _Closed(message.get("code"), str(message.get("reason") or ""))
        text = message.get("text")
        data = message.get("bytes")
        return text if text is not None else (data if data is not None else b"")

    async def from_upstream() -> Frame | _Closed:
        try:
            return await upstream.recv()
        except ConnectionClosed as exc:
            rcvd = exc.rcvd
            return _Closed(rcvd.code, rcvd.reason) if rcvd else _Closed(None, "")

    async def to_browser(frame: Frame) -> None:
        key = "text" if isinstance(frame, str) else "bytes"
        await browser.send({"type": "websocket.send", key: frame})

    up = asyncio.create_task(_pump(from_browser, upstream.send, queue_frames))
    down = asyncio.create_task(_pump(from_upstream, to_browser, queue_frames))
    end: RelayEnd | None = None
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        first = down if down in done else up
        result = first.result() if first.exception() is None else _Closed(None, "")
        if isinstance(result, _SinkGone):
            if first is up:
                code, reason = upstream.close_code, upstream.close_reason or ""
                end = RelayEnd("upstream", code, reason)
            else:
                end = RelayEnd("browser", None, "")
        else:
            end = RelayEnd("upstream" if first is down else "browser", result.code, result.reason)
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
        reason = (end.reason if end else "").encode()[:120].decode(errors="ignore")
        if end is None or end.closed_by == "upstream":
            code = TRY_AGAIN_LATER if end is None else end.code
            code = 1000 if code == 1005 else _passable(code, TRY_AGAIN_LATER)
            with contextlib.suppress(Exception):
                await browser.send({"type": "websocket.close", "code": code, "reason": reason})
        with contextlib.suppress(Exception):
            code = 1001 if end is None else _passable(end.code, 1000)
            await upstream.close(code, reason)
    return end


async def _pump(
    receive: Callable[[], Awaitable[Frame | _Closed]],
    send: Callable[[Frame], Awaitable[None]],
    queue_frames: int,
) -> _Closed | _SinkGone:
    """Copy frames from ``receive`` to ``send`` through a bounded queue, until the source
    closes (its :class:`_Closed`, after every frame queued before it) or ``send`` fails."""
    queue: asyncio.Queue[Frame | _Closed] = asyncio.Queue(queue_frames)

    async def read() -> None:
        while True:
            try:
                item = await receive()
            except Exception:
                item = _Closed(None, "")
            await queue.put(item)
            if isinstance(item, _Closed):
                return

    reader = asyncio.create_task(read())
    try:
        while True:
            item = await queue.get()
            if isinstance(item, _Closed):
                return item
            try:
                await send(item)
            except Exception:
                return _SinkGone()
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader

"""The async side of the concurrency shim: what differs between the clients.

``scripts/unasync.py`` turns every ``sandlot.sdk._aio`` import of the async
sources into ``sandlot.sdk._syncio``, which offers the same names for threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from sandlot.protocol.errors import ConnectError, RequestTimeout, SocketClosed

if TYPE_CHECKING:  # the WebSocket library is imported on the first connection only
    from websockets.asyncio.client import ClientConnection

#: Seconds a closing handshake may take (less when pings are more frequent).
CLOSE_TIMEOUT = 10.0

#: Bytes asked of the socket per read (a large download arrives in few reads).
READ_SIZE = 1 << 18


async def sleep(seconds: float) -> None:
    """Sleep without blocking the event loop."""
    await asyncio.sleep(seconds)


class Lock(asyncio.Lock):
    """A lock for the async client."""


class Stopper:
    """A stop flag a background loop can wait on with a timeout."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        """Ask the loop to stop."""
        self._event.set()

    def is_set(self) -> bool:
        """Whether stop was asked."""
        return self._event.is_set()

    async def wait(self, timeout: float) -> bool:
        """Wait until stopped or ``timeout``; True when stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        return self._event.is_set()


class Background:
    """A background loop (an asyncio task here, a daemon thread in the sync client)."""

    def __init__(self, target: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._task: asyncio.Task[None] = asyncio.get_running_loop().create_task(target(), name=name)

    async def join(self, timeout: float) -> None:
        """Wait for the loop to end (it was asked to stop)."""
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        if not self._task.done():
            self._task.cancel()


#: Statuses of a proxy that could not reach the server behind it.
GATEWAY_STATUSES = (502, 503, 504)


async def ws_connect(
    url: str, headers: dict[str, str], timeout: float, keepalive: float | None
) -> ClientConnection:
    """Open a WebSocket within ``timeout`` seconds, pinged every ``keepalive`` seconds.

    A ping left unanswered for ``keepalive`` seconds closes the connection (its
    ``recv`` raises ``SocketClosed``): a silently dead connection is noticed. A
    connection that breaks during the upgrade raises ``SocketClosed`` too.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

    try:
        return await connect(
            url,
            additional_headers=headers,
            open_timeout=timeout,
            max_size=None,
            compression=None,
            ping_interval=keepalive,
            ping_timeout=keepalive,
            close_timeout=min(keepalive or CLOSE_TIMEOUT, CLOSE_TIMEOUT),
        )
    except (ConnectionClosed, InvalidMessage) as exc:
        raise SocketClosed(f"connection broken during the upgrade ({exc})") from exc
    except InvalidStatus as exc:
        # A load balancer or proxy answering for a server it cannot reach (a replica
        # restarting): the server was not reached, so trying again is safe.
        if exc.response.status_code in GATEWAY_STATUSES:
            raise ConnectError(f"cannot open a WebSocket to {url}: {exc}") from exc
        raise
    except TimeoutError as exc:
        raise RequestTimeout(f"opening a WebSocket to {url}: timed out") from exc
    except OSError as exc:
        raise ConnectError(f"cannot open a WebSocket to {url}: {exc}") from exc


async def ws_recv(ws: ClientConnection, timeout: float | None) -> str | bytes:
    """Receive one frame, giving up after ``timeout`` seconds (``RequestTimeout``)."""
    from websockets.exceptions import ConnectionClosed

    try:
        return await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as exc:
        raise _closed(ws, exc) from exc
    except TimeoutError as exc:
        raise RequestTimeout("no frame came before the deadline") from exc


async def ws_send(ws: ClientConnection, data: str) -> None:
    """Send one text frame."""
    from websockets.exceptions import ConnectionClosed

    try:
        await ws.send(data)
    except ConnectionClosed as exc:
        raise _closed(ws, exc) from exc


async def ws_close(ws: ClientConnection) -> None:
    """Close a WebSocket, ignoring a connection that is already gone."""
    with contextlib.suppress(Exception):
        await ws.close()


def ws_close_code(ws: Any) -> int | None:
    """The close code the server sent, if any (1006 when the connection broke without one)."""
    code = getattr(ws, "close_code", None)
    return int(code) if code is not None else None


def _closed(ws: Any, exc: Exception) -> SocketClosed:
    return SocketClosed(f"socket closed: {exc}", ws_close_code(ws))


class Stream:
    """One TCP (or TLS) connection of the HTTP wire: bytes out, bytes in, with timeouts."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(
        cls, host: str, port: int, tls: ssl.SSLContext | None, timeout: float | None
    ) -> Stream:
        """Connect within ``timeout`` seconds (asyncio sets TCP_NODELAY on TCP sockets)."""
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls else None, limit=READ_SIZE
            )
        return cls(reader, writer)

    async def send(self, data: bytes, timeout: float | None) -> None:
        """Write ``data``; wait (at most ``timeout``) only while the socket's buffer is full."""
        self._writer.write(data)
        transport = self._writer.transport
        if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            async with asyncio.timeout(timeout):
                await self._writer.drain()

    async def receive(self, timeout: float | None) -> bytes:
        """The next bytes that arrive (``b""`` at the end of the stream)."""
        async with asyncio.timeout(timeout):
            return await self._reader.read(READ_SIZE)

    def is_stale(self) -> bool:
        """Whether an idle connection was closed by the other side (not to be reused)."""
        return self._reader.at_eof() or self._writer.is_closing()

    async def close(self) -> None:
        """Close the connection without waiting for the other side."""
        self._writer.close()

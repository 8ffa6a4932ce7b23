"""The SDK's HTTP/1.1 client: a keep-alive connection pool on h11.

Why not httpx: an agent's file operation is one small request, and on two
cores httpx's client and pool layers cost about 0.4 ms of it, more than the
dataplane takes to answer a 4 KiB read (0.3 ms). This client does only what
the SDK needs: one request per connection at a time, each written in one
send, connections kept alive and reused (last used first), request bodies as
bytes or streamed (chunked), answers read whole or streamed, a deadline on
every step, ``http`` and ``https``. It does not follow redirects, decode
compressed bodies (it never asks for them) or read proxy settings: the SDK
connects to the broker and dataplane URLs it is given.

Failures: a deadline raises ``TimeoutError``; a server that cannot be reached
raises :class:`~sandlot.sdk.types.ConnectError`; a connection that breaks or
speaks broken HTTP raises ``ConnectionError``. A request sent
on a reused connection that the server had already closed (its keep-alive
ended while the connection sat idle) is sent once more on a new one, when
its body can be replayed and no byte of an answer came back.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Generator
from urllib.parse import urlsplit

import h11

from sandlot.sdk import _aio
from sandlot.sdk.types import ConnectError, Deadline, Response

#: Idle connections kept per origin.
MAX_IDLE = 16

#: Seconds a connection may take to open, whatever the call's deadline.
CONNECT_TIMEOUT = 10.0

#: Seconds an idle connection stays reusable (below the servers' usual keep-alive).
KEEPALIVE_EXPIRY = 4.0

#: Methods whose request may be sent twice with the effect of once (RFC 9110 9.2.2).
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})

Body = bytes | AsyncIterable[bytes] | None
Origin = tuple[str, str, int]


class AsyncWire:
    """A pool of keep-alive HTTP/1.1 connections, shared by every client made from one another."""

    def __init__(self, *, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._idle: dict[Origin, list[_Connection]] = {}

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: list[tuple[str, str]],
        body: Body = None,
        deadline: Deadline,
    ) -> Response:
        """Send a request and read its whole answer."""
        async with self.stream(
            method, url, headers=headers, body=body, deadline=deadline
        ) as answer:
            content = await answer.aread()
        return Response(answer.status_code, answer.headers, content)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        headers: list[tuple[str, str]],
        body: Body = None,
        deadline: Deadline,
    ) -> AsyncIterator[AsyncStreamedResponse]:
        """Send a request; the answer's body is read as it arrives, within the block."""
        answer = await self._exchange(method, url, headers, body, deadline)
        try:
            yield answer
        finally:
            await answer.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (connections in use close when their answer ends)."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.stream.close()

    async def _exchange(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: Body,
        deadline: Deadline,
    ) -> AsyncStreamedResponse:
        origin, host, target = self._split(url)
        head = [("Host", host), *headers]
        replayable = method in IDEMPOTENT and (body is None or isinstance(body, bytes))
        if isinstance(body, bytes):
            head.append(("Content-Length", str(len(body))))
        elif body is not None:
            head.append(("Transfer-Encoding", "chunked"))
        elif method in ("POST", "PUT", "PATCH"):
            head.append(("Content-Length", "0"))
        request = h11.Request(method=method, target=target, headers=head)
        while True:
            conn, reused = await self._connection(origin, deadline)
            try:
                await conn.send_request(request, body, deadline)
                status, answer_headers = await conn.read_head(deadline)
            except BaseException as exc:
                await conn.stream.close()
                if isinstance(exc, ConnectionError) and reused and replayable and not conn.answered:
                    continue  # the server closed it meanwhile, unread: once more on a new one
                raise
            return AsyncStreamedResponse(self, origin, conn, status, answer_headers, deadline)

    def _split(self, url: str) -> tuple[Origin, str, str]:
        """``(origin, Host header, request target)`` of an absolute URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return (parts.scheme, parts.hostname, port), parts.netloc.rpartition("@")[2], target

    async def _connection(self, origin: Origin, deadline: Deadline) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        while idle:
            try:
                conn = idle.pop()
            except IndexError:  # taken meanwhile by another thread (sync client)
                break
            if time.monotonic() - conn.idle_since < KEEPALIVE_EXPIRY and not conn.stream.is_stale():
                return conn, True
            await conn.stream.close()
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        left = deadline.remaining()
        try:
            stream = await _aio.Stream.open(
                host, port, tls, CONNECT_TIMEOUT if left is None else min(left, CONNECT_TIMEOUT)
            )
        except TimeoutError:
            raise TimeoutError(f"connecting to {host}:{port}: timed out") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return _Connection(stream), False

    def _keep(self, origin: Origin, conn: _Connection) -> bool:
        """Put an idle connection in the pool; ``False`` when the pool is full."""
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= MAX_IDLE:
            return False
        conn.idle_since = time.monotonic()
        idle.append(conn)
        return True


@contextlib.contextmanager
def _broken(doing: str) -> Generator[None, None, None]:
    """Broken HTTP or a lost connection as ``ConnectionError`` (deadlines stay ``TimeoutError``)."""
    try:
        yield
    except h11.ProtocolError as exc:
        raise ConnectionError(f"HTTP: {exc}") from exc
    except TimeoutError:
        raise
    except OSError as exc:
        raise ConnectionError(f"connection lost while {doing}: {exc}") from exc


class _Connection:
    """One connection and its HTTP/1.1 state machine."""

    def __init__(self, stream: _aio.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        #: Whether any byte of an answer to the current request arrived (it is then
        #: not sent again).
        self.answered = False
        self.idle_since = 0.0

    async def send_request(self, request: h11.Request, body: Body, deadline: Deadline) -> None:
        self.answered = False
        with _broken("sending"):
            if body is None or isinstance(body, bytes):
                data = self.h11.send(request) or b""
                if body:
                    data += self.h11.send(h11.Data(data=body)) or b""
                data += self.h11.send(h11.EndOfMessage()) or b""
                await self.stream.send(data, deadline.remaining())
                return
            await self.stream.send(self.h11.send(request) or b"", deadline.remaining())
            async for chunk in body:
                if chunk:
                    for piece in self.h11.send_with_data_passthrough(h11.Data(data=chunk)) or ():
                        await self.stream.send(bytes(piece), deadline.remaining())
            await self.stream.send(self.h11.send(h11.EndOfMessage()) or b"", deadline.remaining())

    async def next_event(self, deadline: Deadline) -> h11.Event | type[h11.PAUSED]:
        with _broken("reading"):
            while True:
                event = self.h11.next_event()
                if event is not h11.NEED_DATA:
                    return event  # type: ignore[return-value]  # NEED_DATA is handled here
                data = await self.stream.receive(deadline.remaining())
                self.answered = self.answered or bool(data)
                self.h11.receive_data(data)

    async def read_head(self, deadline: Deadline) -> tuple[int, dict[str, str]]:
        while True:
            event = await self.next_event(deadline)
            if isinstance(event, h11.Response):
                headers: dict[str, str] = {}
                for name, value in event.headers:
                    key = name.decode("latin-1")  # h11 gives names in lower case
                    text = value.decode("latin-1")
                    headers[key] = f"{headers[key]}, {text}" if key in headers else text
                return event.status_code, headers
            if not isinstance(event, h11.InformationalResponse):
                raise ConnectionError(f"HTTP: unexpected {type(event).__name__}")


class AsyncStreamedResponse:
    """An answer whose body is read as it arrives (``aiter_bytes``, ``aiter_lines``)."""

    def __init__(
        self,
        wire: AsyncWire,
        origin: Origin,
        conn: _Connection,
        status_code: int,
        headers: dict[str, str],
        deadline: Deadline,
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self._wire = wire
        self._origin = origin
        self._conn: _Connection | None = conn
        self._deadline = deadline
        self._done = False

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes, chunk by chunk."""
        conn = self._conn
        while conn is not None and not self._done:
            event = await conn.next_event(self._deadline)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
            else:
                raise ConnectionError(f"HTTP: unexpected {type(event).__name__}")

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines (UTF-8, without their ``\\n`` or ``\\r\\n``)."""
        pending = b""
        async for chunk in self.aiter_bytes():
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line.removesuffix(b"\r").decode("utf-8", "replace")
        if pending:
            yield pending.removesuffix(b"\r").decode("utf-8", "replace")

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        """Give the connection back to the pool if its exchange ended cleanly, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and conn.h11.our_state is conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            if self._wire._keep(self._origin, conn):
                return
        await conn.stream.close()


__all__ = ["AsyncStreamedResponse", "AsyncWire"]

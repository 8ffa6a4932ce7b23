"""The SDK's HTTP/1.1 client: a keep-alive connection pool.

Why not httpx: an agent's file operation is one small request, and on two
cores httpx's client and pool layers cost about 0.4 ms of it, more than the
dataplane takes to answer a 4 KiB read (0.3 ms). This client does only what
the SDK needs: one request per connection at a time, each written in one
send, connections kept alive and reused (last used first), request bodies as
bytes or streamed (chunked), answers read whole or streamed, a deadline on
every step, ``http`` and ``https``. It does not follow redirects, decode
compressed bodies (it never asks for them) or read proxy settings: the SDK
connects to the broker and dataplane URLs it is given.

It writes and parses HTTP/1.1 itself (the request head; the status line,
headers, and a body framed by ``Content-Length``, by chunks or by the end of
the connection): a general state machine such as h11's cost about a fifth of
a small call on the client's side.

Failures (all :class:`~sandlot.protocol.errors.TransportError`): a deadline raises
``RequestTimeout``; a server that cannot be reached raises ``ConnectError``; a
connection that breaks or speaks broken HTTP raises ``ConnectionLost``. A request sent
on a reused connection that the server had already closed (its keep-alive
ended while the connection sat idle) is sent once more on a new one, when
its body can be replayed and no byte of an answer came back.
"""

from __future__ import annotations

import contextlib
import functools
import re
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Generator
from urllib.parse import urlsplit

from sandlot.protocol.errors import ConnectError, ConnectionLost, RequestTimeout, TransportError
from sandlot.sdk import _aio
from sandlot.sdk.transport import Deadline, Response

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
        origin, host, target = _split(url)
        head = [("Host", host), *headers]
        replayable = method in IDEMPOTENT and (body is None or isinstance(body, bytes))
        if isinstance(body, bytes):
            head.append(("Content-Length", str(len(body))))
        elif body is not None:
            head.append(("Transfer-Encoding", "chunked"))
        elif method in ("POST", "PUT", "PATCH"):
            head.append(("Content-Length", "0"))
        request = request_head(method, target, head)
        while True:
            conn, reused = await self._connection(origin, deadline)
            try:
                await conn.send_request(request, body, deadline)
                status, answer_headers = await conn.read_head(deadline, method)
            except BaseException as exc:
                await conn.stream.close()
                if isinstance(exc, ConnectionError) and reused and replayable and not conn.answered:
                    continue  # the server closed it meanwhile, unread: once more on a new one
                raise
            return AsyncStreamedResponse(self, origin, conn, status, answer_headers, deadline)

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
            raise RequestTimeout(f"connecting to {host}:{port}: timed out") from None
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


@functools.lru_cache(maxsize=1024)
def _split(url: str) -> tuple[Origin, str, str]:
    """``(origin, Host header, request target)`` of an absolute URL (kept for the URLs
    called again and again: the same files are read and written many times)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname, port), parts.netloc.rpartition("@")[2], target


@contextlib.contextmanager
def _broken(doing: str) -> Generator[None, None, None]:
    """A lost connection as :class:`ConnectionLost`, a deadline as :class:`RequestTimeout`."""
    try:
        yield
    except TransportError:
        raise
    except TimeoutError as exc:
        raise RequestTimeout(f"deadline passed while {doing}") from exc
    except OSError as exc:
        raise ConnectionLost(f"connection lost while {doing}: {exc}") from exc


def _bad(what: str) -> ConnectionLost:
    return ConnectionLost(f"HTTP: {what}")


#: Bytes an answer's head (status line and headers) may take.
MAX_HEAD = 64 << 10
#: Bytes a chunk-size line (with its extensions) or a trailer line may take.
MAX_LINE = 4 << 10

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def request_head(method: str, target: str, headers: list[tuple[str, str]]) -> bytes:
    """The request line and headers; ``ValueError`` for anything that would break the
    framing (a line break in a value, a name that is not a token, spaces in the target)."""
    if not _TOKEN.fullmatch(method.encode("latin-1")):
        raise ValueError(f"invalid HTTP method {method!r}")
    if not target or _FORBIDDEN.search(target) or " " in target or "\t" in target:
        raise ValueError(f"invalid request target {target!r}")
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers:
        if not _TOKEN.fullmatch(name.encode("latin-1")) or _FORBIDDEN.search(value):
            raise ValueError(f"invalid HTTP header {name!r}")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")


class _Connection:
    """One connection: requests written whole (or chunked), answers parsed as they come.

    An answer's body is framed by ``Content-Length``, by chunks, or by the end of the
    connection; the connection is reusable once an answer framed by length or chunks
    was read to its end, unless the server said ``Connection: close`` (or spoke
    HTTP/1.0) or sent more than it framed.
    """

    def __init__(self, stream: _aio.Stream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        #: Whether any byte of an answer to the current request arrived (it is then
        #: not sent again).
        self.answered = False
        self.idle_since = 0.0
        self.keep_alive = False
        self._framing = ""  # "none" | "length" | "chunked" | "close"
        self._left = 0  # bytes of the body (length) or of the current chunk (chunked) to read
        self._chunk_started = False

    async def send_request(self, head: bytes, body: Body, deadline: Deadline) -> None:
        self.answered = False
        with _broken("sending"):
            if body is None or isinstance(body, bytes):
                await self.stream.send(head + body if body else head, deadline.remaining())
                return
            await self.stream.send(head, deadline.remaining())
            async for chunk in body:
                if chunk:
                    data = b"%x\r\n%s\r\n" % (len(chunk), chunk)
                    await self.stream.send(data, deadline.remaining())
            await self.stream.send(b"0\r\n\r\n", deadline.remaining())

    async def _fill(self, deadline: Deadline) -> bool:
        """Read more into the buffer; ``False`` at the end of the stream."""
        with _broken("reading"):
            data = await self.stream.receive(deadline.remaining())
        if not data:
            return False
        self.answered = True
        self.buffer += data
        return True

    async def _line(self, deadline: Deadline, limit: int) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 2]
                return line
            if len(self.buffer) > limit:
                raise _bad("line too long")
            if not await self._fill(deadline):
                raise ConnectionLost("connection closed in the middle of an answer")

    async def read_head(self, deadline: Deadline, method: str) -> tuple[int, dict[str, str]]:
        """Status and headers (names in lower case) of the answer, informational ones skipped."""
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    raise _bad("answer head too large")
                if not await self._fill(deadline):
                    raise ConnectionLost("connection closed before an answer")
                continue
            head = bytes(self.buffer[:end]).split(b"\r\n")
            del self.buffer[: end + 4]
            version, _, rest = head[0].partition(b" ")
            code = rest[:3]
            well_formed = len(code) == 3 and code.isdigit() and rest[3:4] in (b"", b" ")
            if version not in (b"HTTP/1.1", b"HTTP/1.0") or not well_formed:
                raise _bad(f"not an HTTP/1.x status line: {head[0][:80]!r}")
            status = int(code)
            headers: dict[str, str] = {}
            for line in head[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not _TOKEN.fullmatch(name):
                    raise _bad(f"malformed header line {line[:80]!r}")
                key = name.decode("latin-1").lower()
                text = value.strip(b" \t").decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            if 100 <= status < 200:
                if status == 101:
                    raise _bad("unexpected 101 Switching Protocols")
                continue
            self._frame(version, status, headers, method)
            return status, headers

    def _frame(self, version: bytes, status: int, headers: dict[str, str], method: str) -> None:
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        self.keep_alive = version == b"HTTP/1.1" and "close" not in tokens
        self._chunk_started = False
        if method == "HEAD" or status in (204, 304):
            self._framing, self._left = "none", 0
        elif "transfer-encoding" in headers:
            codings = [c.strip().lower() for c in headers["transfer-encoding"].split(",")]
            if codings != ["chunked"]:
                raise _bad(f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}")
            self._framing, self._left = "chunked", 0
        elif "content-length" in headers:
            values = {v.strip() for v in headers["content-length"].split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise _bad(f"invalid Content-Length {headers['content-length']!r}")
            self._framing, self._left = "length", int(values.pop())
        else:
            self._framing, self._left = "close", 0
            self.keep_alive = False

    async def next_data(self, deadline: Deadline) -> bytes | None:
        """The next piece of the body, ``None`` at its end."""
        framing = self._framing
        if framing == "none":
            return None
        if framing == "length":
            if self._left == 0:
                return None
            if not self.buffer and not await self._fill(deadline):
                raise ConnectionLost("connection closed in the middle of an answer")
            return self._take(self._left)
        if framing == "close":
            if not self.buffer and not await self._fill(deadline):
                self._framing = "none"
                return None
            return self._take(len(self.buffer))
        # chunked
        while self._left == 0:
            if self._chunk_started:
                if await self._line(deadline, MAX_LINE) != b"":
                    raise _bad("chunk not followed by CRLF")
                self._chunk_started = False
            size = (await self._line(deadline, MAX_LINE)).partition(b";")[0].strip()
            try:
                self._left = int(size, 16)
            except ValueError:
                raise _bad(f"invalid chunk size {size[:40]!r}") from None
            if self._left == 0:
                while await self._line(deadline, MAX_LINE):
                    pass  # trailers: ignored
                self._framing = "none"
                return None
            self._chunk_started = True
        if not self.buffer and not await self._fill(deadline):
            raise ConnectionLost("connection closed in the middle of an answer")
        return self._take(self._left)

    def _take(self, most: int) -> bytes:
        n = min(most, len(self.buffer))
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self._framing in ("length", "chunked"):
            self._left -= n
        return data

    def reusable(self) -> bool:
        """Whether the answer was read to its end, framed, and nothing more came."""
        ended = self._framing == "none" or (self._framing == "length" and self._left == 0)
        return ended and self.keep_alive and not self.buffer


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
            data = await conn.next_data(self._deadline)
            if data is None:
                self._done = True
            elif data:
                yield data

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
        if self._done and conn.reusable() and self._wire._keep(self._origin, conn):
            return
        await conn.stream.close()


__all__ = ["AsyncStreamedResponse", "AsyncWire"]

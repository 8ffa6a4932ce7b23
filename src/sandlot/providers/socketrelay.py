"""The broker's ``/dp/{sandbox_id}/v1/…`` relayed to a dataplane on a Unix socket.

A container provider runs the dataplane inside each sandbox, listening on a Unix
socket in a directory bind-mounted from the host; the sandbox itself has no network.
(A cluster provider's dataplane listens on its pod's address instead: a
:class:`TcpUpstream`.) :class:`SocketRelay` is the ASGI app the embedded server mounts
at ``/dp``: it passes each request (streamed both ways) and each WebSocket (frame by frame, through
:func:`sandlot.web.relay.relay`) to that sandbox's socket, unchanged. It checks no
token: the dataplane in the sandbox verifies the broker's tokens itself, so the relay
holds no authority a client could borrow. Only ``/{sandbox_id}/v1/…`` is forwarded.
While a sandbox starts every route answers 423, except its event log, which is held
until the dataplane is up and then served from its start (activation first).

The socket is reached through a descriptor opened once, with ``O_PATH | O_NOFOLLOW``,
on the socket the dataplane bound (:func:`open_socket`), and connected to as
``/proc/self/fd/N``: whatever the sandbox later puts at that path (a symlink to a
socket of the host, say) is never followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

from sandlot.protocol.errors import (
    InvalidRequest,
    NotFound,
    ProviderUnavailable,
    ResourceNotFound,
    SandboxStarting,
    SandlotError,
)
from sandlot.web.relay import relay

#: What a path segment holds unencoded (RFC 3986 pchar, and the separator).
_PATH_SAFE = "/-._~!$&'()*+,;=:@"
_ROUTE = re.compile(r"^/([A-Za-z0-9_.-]{1,128})(/v1(?:/.*)?)$")
#: Headers of one hop only (RFC 9110 7.6.1), never passed on.
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
    }
)
_WS_DROP = _HOP | {
    b"sec-websocket-key",
    b"sec-websocket-version",
    b"sec-websocket-extensions",
    b"sec-websocket-protocol",
}
MAX_FRAME_BYTES = 16 << 20


def open_socket(path: str) -> int | None:
    """A descriptor on the Unix socket at ``path``, or ``None`` while there is none (or
    what is there is not a socket: a symlink is not followed)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def listener_pid(fd: int) -> int:
    """The process that listens on the socket ``fd`` (an ``O_PATH`` descriptor from
    :func:`open_socket`), as this process's pid namespace sees it (0: not visible, or
    nobody listens)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(f"/proc/self/fd/{fd}")
        except OSError:
            return 0
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


@dataclass
class Upstream:
    """One sandbox's dataplane socket and the pooled HTTP client that reaches it."""

    fd: int
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        # Plain HTTP on a Unix socket: no TLS context (loading the CA bundle for one took
        # longer than a sandbox's dataplane takes to answer).
        transport = httpx.AsyncHTTPTransport(uds=self.path, verify=False)
        self.client = httpx.AsyncClient(
            transport=transport,
            base_url="http://dataplane",
            timeout=httpx.Timeout(None, connect=5.0),
        )

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    async def close(self) -> None:
        await self.client.aclose()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    async def websocket(self, target: str, **options: Any) -> ClientConnection:
        """A WebSocket to ``target`` on the dataplane."""
        return await unix_connect(self.path, uri=f"ws://dataplane{target}", **options)


@dataclass
class TcpUpstream:
    """A dataplane reached over TCP (a pod's address on a cluster network)."""

    host: str
    port: int
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=f"http://{self.authority}",
            timeout=httpx.Timeout(None, connect=5.0),
            # The pod network is reached directly, never through a proxy of the environment.
            trust_env=False,
        )

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def close(self) -> None:
        await self.client.aclose()

    async def websocket(self, target: str, **options: Any) -> ClientConnection:
        return await connect(f"ws://{self.authority}{target}", proxy=None, **options)


#: Sandbox id → its upstream; raises a :class:`SandlotError` the client should see
#: (not found, 423 while starting or suspended, 503 when it is gone).
UpstreamLookup = Callable[[str], Upstream | TcpUpstream]
#: Sandbox id → returns once the sandbox is no longer being created.
StartWait = Callable[[str], Awaitable[None]]


class _ClientGone(Exception):
    pass


class SocketRelay:
    """ASGI app: ``/{sandbox_id}/v1/…`` → that sandbox's dataplane socket."""

    def __init__(self, lookup: UpstreamLookup, *, until_started: StartWait | None = None) -> None:
        self.lookup = lookup
        self.until_started = until_started

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return
        root = scope.get("root_path", "")
        path: str = scope["path"]
        route = path[len(root) :] if root and path.startswith(root) else path
        match = _ROUTE.match(route)
        try:
            if match is None:
                raise ResourceNotFound("no such route")
            _check_path(match.group(2))
            upstream = await self._upstream(scope, match.group(1), match.group(2))
        except SandlotError as exc:
            await _refuse(scope, receive, send, exc)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        # The path is decoded: encoded again, so that a ``%3F`` or ``%23`` in it stays
        # part of the path rather than starting a query or a fragment.
        target = quote(route, safe=_PATH_SAFE) + (f"?{query}" if query else "")
        if scope["type"] == "http":
            await self._http(scope, receive, send, upstream, target)
        else:
            await self._websocket(scope, receive, send, upstream, target)

    async def _upstream(self, scope: Any, sandbox_id: str, route: str) -> Upstream | TcpUpstream:
        """The sandbox's upstream. A request for its event log made while it starts is
        held until it is up: the log is where clients that met 423 wait for it."""
        try:
            return self.lookup(sandbox_id)
        except SandboxStarting:
            held = scope["type"] == "http" and scope["method"] == "GET" and route == "/v1/events"
            if not held or self.until_started is None:
                raise
        await self.until_started(sandbox_id)
        return self.lookup(sandbox_id)

    # --- HTTP ---------------------------------------------------------------------------

    async def _http(
        self, scope: Any, receive: Any, send: Any, upstream: Upstream | TcpUpstream, target: str
    ) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        first = await receive()
        if first["type"] == "http.disconnect":
            return
        content: bytes | AsyncIterator[bytes] = first.get("body", b"")
        body_read = [not first.get("more_body")]
        if not body_read[0]:
            content = _body(first.get("body", b""), receive, body_read)
        request = upstream.client.build_request(
            scope["method"], target, headers=headers, content=content
        )
        try:
            response = await upstream.client.send(request, stream=True)
        except _ClientGone:
            return
        except httpx.TransportError:
            error = ProviderUnavailable("the sandbox's dataplane is unreachable")
            await _refuse(scope, receive, send, error, started=True)
            return
        try:
            # The client is watched once its body is read whole (the body's reader takes
            # its messages until then): an event stream requested with a body ran on,
            # with its connection to the dataplane, after its client left.
            await _stream_response(response, receive, send, watch=body_read[0])
        finally:
            await response.aclose()

    # --- WebSocket ----------------------------------------------------------------------

    async def _websocket(
        self, scope: Any, receive: Any, send: Any, upstream: Upstream | TcpUpstream, target: str
    ) -> None:
        connect = await receive()
        if connect["type"] != "websocket.connect":
            return
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.lower() not in _WS_DROP
        ]
        try:
            conn: ClientConnection = await upstream.websocket(
                target,
                additional_headers=headers,
                subprotocols=scope.get("subprotocols") or None,
                compression=None,
                max_size=MAX_FRAME_BYTES,
                ping_interval=None,
                open_timeout=10,
                user_agent_header=None,
            )
        except InvalidStatus:
            await send({"type": "websocket.close", "code": 1008})
            return
        except (OSError, InvalidHandshake, TimeoutError):
            await send({"type": "websocket.close", "code": 1013})
            return
        await send({"type": "websocket.accept", "subprotocol": conn.subprotocol})
        await relay(_AsgiSocket(receive, send), conn)


@dataclass
class _AsgiSocket:
    receive: Callable[[], Any]
    send: Callable[[MutableMapping[str, Any]], Any]


def _check_path(route: str) -> None:
    """No ``.`` or ``..`` segment (the path is passed on as a URL, whose dot segments are
    resolved: ``/v1/%2e%2e/%2e%2e/__control/status`` reached the dataplane's control
    routes, which the relay never forwards), no control character (not a URL at all)."""
    if any(segment in (".", "..") for segment in route.split("/")):
        raise InvalidRequest("a path may not hold a . or .. segment")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in route):
        raise InvalidRequest("a path may not hold a control character")


async def _body(first: bytes, receive: Any, read: list[bool]) -> AsyncIterator[bytes]:
    """The request's body as it comes; ``read[0]`` is set once it has come whole."""
    if first:
        yield first
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        if body:
            yield body
        if not message.get("more_body"):
            read[0] = True
            return


async def _stream_response(
    response: httpx.Response, receive: Any, send: Any, *, watch: bool
) -> None:
    """Pass the response on as it comes; a client that goes away ends the upstream one
    too (an event stream would otherwise run on)."""
    headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP - {b"host"}]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})

    async def pump() -> None:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping = asyncio.ensure_future(pump())
    watcher = asyncio.ensure_future(disconnected()) if watch else None
    try:
        waiting = {pumping} if watcher is None else {pumping, watcher}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, watcher):
            if task is not None and not task.done():
                task.cancel()
        for task in (pumping, watcher):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def _close_code(exc: SandlotError) -> int:
    """The close code the dataplane sends for ``exc`` (PROTOCOL.md: 4404 unknown)."""
    if isinstance(exc, NotFound):
        return 4404
    return 1013 if exc.retryable else 1008


async def _refuse(
    scope: Any, receive: Any, send: Any, exc: SandlotError, *, started: bool = False
) -> None:
    if scope["type"] == "websocket":
        # As the dataplane does: the socket is accepted, then closed with the code of the
        # error (4404 unknown sandbox, 1013 try again later), so the client reads it.
        if not started:
            await receive()
        await send({"type": "websocket.accept"})
        reason = exc.message.encode()[:120].decode(errors="ignore")
        await send({"type": "websocket.close", "code": _close_code(exc), "reason": reason})
        return
    body = json.dumps(exc.to_wire()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["SocketRelay", "TcpUpstream", "Upstream", "open_socket"]

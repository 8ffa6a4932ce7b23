"""The sync side of the concurrency shim (see ``_aio``): threads instead of tasks."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandlot.protocol.errors import ConnectError, RequestTimeout, SocketClosed

if TYPE_CHECKING:  # the WebSocket library is imported on the first connection only
    from websockets.sync.client import ClientConnection

#: Seconds a closing handshake may take (less when pings are more frequent).
CLOSE_TIMEOUT = 10.0

#: Bytes asked of the socket per read (a large download arrives in few reads).
READ_SIZE = 1 << 18


def sleep(seconds: float) -> None:
    """Sleep."""
    time.sleep(seconds)


class Lock:
    """A re-usable ``with`` lock for the sync client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class Stopper:
    """A stop flag a background loop can wait on with a timeout."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        """Ask the loop to stop."""
        self._event.set()

    def is_set(self) -> bool:
        """Whether stop was asked."""
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait until stopped or ``timeout``; True when stopped."""
        return self._event.wait(timeout)


class Background:
    """A background loop run by a daemon thread."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the loop to end (it was asked to stop)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


#: Statuses of a proxy that could not reach the server behind it.
GATEWAY_STATUSES = (502, 503, 504)


def ws_connect(
    url: str, headers: dict[str, str], timeout: float, keepalive: float | None
) -> ClientConnection:
    """Open a WebSocket within ``timeout`` seconds, pinged every ``keepalive`` seconds.

    A ping left unanswered for ``keepalive`` seconds closes the connection (its
    ``recv`` raises ``SocketClosed``): a silently dead connection is noticed. A
    connection that breaks during the upgrade raises ``SocketClosed`` too.
    """
    from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus
    from websockets.sync.client import connect

    try:
        ws = connect(
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
    # The connection outlives this call (closed by ws_close), as with the async client.
    ws.__enter__()
    return ws


def ws_recv(ws: ClientConnection, timeout: float | None) -> str | bytes:
    """Receive one frame, giving up after ``timeout`` seconds (``RequestTimeout``)."""
    from websockets.exceptions import ConnectionClosed

    try:
        return ws.recv(timeout)
    except ConnectionClosed as exc:
        raise _closed(ws, exc) from exc
    except TimeoutError as exc:
        raise RequestTimeout("no frame came before the deadline") from exc


def ws_send(ws: ClientConnection, data: str) -> None:
    """Send one text frame."""
    from websockets.exceptions import ConnectionClosed

    try:
        ws.send(data)
    except ConnectionClosed as exc:
        raise _closed(ws, exc) from exc


def ws_close(ws: ClientConnection) -> None:
    """Close a WebSocket, ignoring a connection that is already gone."""
    with contextlib.suppress(Exception):
        ws.close()


def ws_close_code(ws: Any) -> int | None:
    """The close code the server sent, if any (1006 when the connection broke without one)."""
    code = getattr(ws, "close_code", None)
    return int(code) if code is not None else None


def _closed(ws: Any, exc: Exception) -> SocketClosed:
    return SocketClosed(f"socket closed: {exc}", ws_close_code(ws))


class Stream:
    """One TCP (or TLS) connection of the HTTP wire: bytes out, bytes in, with timeouts."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def open(
        cls, host: str, port: int, tls: ssl.SSLContext | None, timeout: float | None
    ) -> Stream:
        """Connect within ``timeout`` seconds, with TCP_NODELAY (a request is one write)."""
        sock = socket.create_connection((host, port), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def send(self, data: bytes, timeout: float | None) -> None:
        """Write ``data`` within ``timeout`` seconds."""
        self._sock.settimeout(timeout)
        self._sock.sendall(data)

    def receive(self, timeout: float | None) -> bytes:
        """The next bytes that arrive (``b""`` at the end of the stream)."""
        self._sock.settimeout(timeout)
        return self._sock.recv(READ_SIZE)

    def is_stale(self) -> bool:
        """Whether an idle connection was closed by the other side (not to be reused).

        An idle connection has nothing to read: readable means closed (or garbage).
        """
        try:
            return bool(select.select([self._sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Close the connection without waiting for the other side."""
        with contextlib.suppress(OSError):
            self._sock.close()

"""Pinned addresses: the gateway's connections go where an upstream's name first resolved.

A :class:`Pin` holds one host's address, resolved at its first use and checked again
every so often: an answer that no longer holds it raises :class:`AddressChanged`
(the gateway refuses the call), so a DNS that rebinds the name to another machine
cannot move the relay there. :class:`PinnedBackend` is the httpcore network backend
that connects to the pinned address while the request keeps the name (``Host``, TLS
SNI, certificate check), and wraps every connection in a :class:`CountingStream`.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpcore

#: ``resolver(host, port)`` → the host's addresses, best first.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

#: Bytes of an answer's head looked through for its end (h11 refuses longer heads).
HEAD_LIMIT = 128 * 1024


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the system's resolver (``getaddrinfo`` in a thread)."""
    infos = await asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Unresolved(Exception):
    """The name has never resolved (no answer, an error, or no answer in time)."""


class AddressChanged(Exception):
    """The name now resolves to addresses without the pinned one."""

    def __init__(self, pinned: str, answer: Sequence[str]) -> None:
        super().__init__(f"pinned {pinned}, now {', '.join(answer)}")
        self.pinned = pinned
        self.answer = list(answer)


class Pin:
    """The pinned address of one ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.address: str | None = None
        self._checked_at = -math.inf
        self._lock = asyncio.Lock()

    async def resolve(
        self, resolver: Resolver, *, now: Callable[[], float], recheck: float, timeout: float
    ) -> tuple[str, bool]:
        """The pinned address, and whether this call pinned it; the name is resolved
        again if ``recheck`` seconds passed since it last was. An answer that fails
        (after the pin) says nothing of a change: the pin stands."""
        if self.address is not None and now() - self._checked_at < recheck:
            return self.address, False
        async with self._lock:
            if self.address is not None and now() - self._checked_at < recheck:
                return self.address, False
            try:
                async with asyncio.timeout(timeout):
                    answer = list(await resolver(self.host, self.port))
            except (OSError, TimeoutError):
                answer = []
            pinned_now = False
            if not answer:
                if self.address is None:
                    raise Unresolved(self.host)
            elif self.address is None:
                self.address = answer[0]
                pinned_now = True
            elif self.address not in answer:
                raise AddressChanged(self.address, answer)
            self._checked_at = now()
            return self.address, pinned_now


class CountingStream(httpcore.AsyncNetworkStream):
    """A connection that counts the bytes of each answer, to see one whose body runs past
    its ``Content-Length``: h11 stops at the declared length and would leave the rest
    for the next call on the connection to read as its answer. A ``poisoned`` one looks
    readable while idle, which makes the pool drop it."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._head = bytearray()
        self._head_end: int | None = None
        self._received = 0
        self.poisoned = False

    def body_received(self) -> int | None:
        """Bytes after the head of the answer to the last request written, if known."""
        return None if self._head_end is None else self._received - self._head_end

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self._inner.read(max_bytes, timeout)
        if self._head_end is None and len(self._head) < HEAD_LIMIT:
            start = max(len(self._head) - 3, 0)
            self._head += data
            end = self._head.find(b"\r\n\r\n", start)
            if end >= 0:
                self._head_end = end + 4
                self._head.clear()
        self._received += len(data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # HTTP/1.1 writes a whole request before it reads the answer.
        self._head.clear()
        self._head_end = None
        self._received = 0
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return CountingStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self.poisoned:
            return True
        return self._inner.get_extra_info(info)


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects to the pinned address of a host, never to one resolved on the way."""

    def __init__(self, pins: dict[tuple[str, int], Pin]) -> None:
        self._pins = pins
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        pin = self._pins.get((host.lower(), port))
        if pin is None or pin.address is None:
            raise httpcore.ConnectError("no pinned address")
        stream = await self._inner.connect_tcp(
            pin.address, port, timeout, local_address, socket_options
        )
        return CountingStream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("no upstream is a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def connect_socket(address: str, port: int, timeout: float) -> socket.socket:
    """A TCP socket connected to ``address`` (for a WebSocket to a pinned address);
    ``TimeoutError`` or ``OSError`` if it cannot be."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, (address, port))
    except BaseException:
        sock.close()
        raise
    return sock

"""The one gateway from the web server to its upstreams (sandbox dataplanes).

Every HTTP call and WebSocket the web server makes for a browser goes through a
:class:`Gateway`; nothing else in ``sandlot.web`` opens a connection upstream. Its rules:

- **Allowlist** (configuration, never a browser's input): a call leaves only if its
  URL's scheme, host and port are an :class:`Upstream`'s, its path lies under one of
  that upstream's ``path_prefixes`` (no ``.`` or ``..`` segment, encoded or not), and
  its method is one of the upstream's ``methods`` (a WebSocket's handshake is a
  ``GET``). Anything else is :class:`~sandlot.protocol.errors.Forbidden`, with
  ``metadata.reason`` one of ``url``, ``scheme``, ``host``, ``port``, ``path``, ``method``.
- **Redirects** are never followed: a 3xx other than 304 is ``Forbidden`` (``redirect``).
- **DNS pinned**: an upstream's host is resolved at its first call and every connection
  goes to that address, while the URL keeps the name (``Host``, TLS SNI and the
  certificate check use it). The name is resolved again every ``dns_recheck_seconds``;
  an answer without the pinned address is refused (``dns_changed``) and logged, so a
  rebinding DNS cannot turn the relay toward another machine.
- **Headers**: only the request headers in ``forward_request_headers`` pass (never the
  hop-by-hop ones, those a ``Connection`` header names, ``Authorization``, ``Cookie``,
  ``X-Api-Key``, ``Origin``); the gateway sets ``Authorization: Bearer <token>`` from
  the token its caller holds and ``X-Request-Id`` (the browser's, or a new one). Of the
  answer only ``return_response_headers`` come back (never ``Set-Cookie``).
- **Connections**: the short calls share one pool (``max_connections``). A long-lived
  stream (:meth:`Gateway.stream` with ``long_lived``: an event stream, open as long as
  its browser stays) gets a connection of its own, outside that pool, at most
  ``max_streams`` at once (beyond, ``PROVIDER_UNAVAILABLE``, reason ``streams``), closed
  with the stream: however many streams are open, the short calls keep their pool. An
  answer closed before its body was read to the end drops its connection at once, the
  close shielded from the cancellation of a request whose client left (it was left open
  for good, the pool's slot with it).
- **Sizes**: an answer larger than its cap (``max_json_bytes`` for :meth:`Gateway.request`,
  ``max_file_bytes`` for :meth:`Gateway.stream`) is ``PayloadTooLarge``, checked
  against ``Content-Length`` first and while it streams; a body shorter or longer than
  its ``Content-Length`` is an error, and the connection is dropped.
- **Retries**: idempotent methods (and a ``POST`` marked idempotent, or carrying an
  ``Idempotency-Key``) are tried again after a failed connection or a 502/503/504,
  ``retries`` times, after a jittered exponential backoff or the upstream's
  ``Retry-After`` (at most ``max_retry_after``). Nothing else is ever sent twice.
- **Breaker**: one :class:`~sandlot.web.breaker.CircuitBreaker` per upstream counts
  exchanges that got no answer from the dataplane itself (no connection, a timeout, a
  lost connection, a 5xx without the dataplane's own envelope); :meth:`Gateway.states`
  is what ``/readyz`` shows.
- **Version**: before its first call, and again after its breaker has opened, an
  upstream is asked ``GET {base_url}/__meta/version``; another major ``api_version``
  fails every call with a diagnostic (asked again after a cool-down).
- **Errors** are the project's envelope (:func:`error_answer`): an upstream's own 4xx
  envelope passes with its code, message and scalar metadata only, under the
  browser's request id; everything else becomes ``PROVIDER_UNAVAILABLE`` (retryable,
  ``metadata.reason``) with no upstream body, URL or token in it. Tokens are never logged.

The rules live in modules of their own (:mod:`~sandlot.web.allowlist`,
:mod:`~sandlot.web.pinning`, :mod:`~sandlot.web.breaker`, :mod:`~sandlot.web.errors`,
:mod:`~sandlot.web.metrics`, :mod:`~sandlot.web.relay`); this one ties them to the
connections and re-exports what the web server uses. ``docs/WEB.md`` says it at length.

Why httpcore under httpx's URL parsing: the pinning needs a connection made to an
address other than the URL's host while the request keeps the name, and httpcore's
pool takes a network backend for exactly that, where httpx's client does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import re
import socket
import ssl
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import httpcore
import httpx
from prometheus_client import CollectorRegistry
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from sandlot.protocol.common import new_id
from sandlot.protocol.errors import (
    InvalidRequest,
    PayloadTooLarge,
    ProviderUnavailable,
    SandlotError,
)
from sandlot.protocol.version import API_VERSION, major_of
from sandlot.web.allowlist import (
    FORWARD_REQUEST_HEADERS,
    RETURN_RESPONSE_HEADERS,
    Allowlist,
    Upstream,
    forwarded_headers,
    refused,
    returned_headers,
)
from sandlot.web.breaker import CircuitBreaker, Ticket
from sandlot.web.errors import (
    ErrorAnswer,
    error_answer,
    own_envelope,
    retry_after_seconds,
    upstream_error,
)
from sandlot.web.metrics import GatewayMetrics
from sandlot.web.pinning import (
    AddressChanged,
    CountingStream,
    Pin,
    PinnedBackend,
    Resolver,
    Unresolved,
    connect_socket,
    system_resolver,
)
from sandlot.web.redaction import MASK
from sandlot.web.relay import BrowserSocket, RelayEnd, relay

log = logging.getLogger("sandlot.web")


#: The upstream WebSockets' logger: a child of the library's own, so its level and
#: handlers apply, with the credential headers masked in its debug dump of a handshake
#: (``> Authorization: Bearer …``), so the dataplane token never reaches a log line.
_websocket_log = logging.getLogger("websockets.client.sandlot_gateway")
_websocket_log.addFilter(MASK)

MiB = 1 << 20

#: Methods whose request may be sent twice with the effect of once (RFC 9110 9.2.2).
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
RETRY_STATUSES = frozenset({502, 503, 504})
#: Refusals a newly discovered upstream may lift (a method refused stays refused).
_DISCOVERABLE = frozenset({"host", "port", "scheme", "path"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{1,16384}$")
#: Bytes of an error answer read to find the dataplane's envelope in it.
_ENVELOPE_LIMIT = 64 * 1024

_FAILURES = {
    "unreachable": "the sandbox host cannot be reached",
    "dns": "the sandbox host's name does not resolve",
    "timeout": "the sandbox host did not answer in time",
    "busy": "too many calls to the sandbox host are waiting",
    "streams": "too many event streams to sandbox hosts are open",
    "connection_lost": "the connection to the sandbox host broke",
    "length_mismatch": "the sandbox host's answer did not match its Content-Length",
    "upstream_status": "the sandbox host failed to answer",
}

Body = bytes | AsyncIterable[bytes] | None


def request_id_of(headers: Mapping[str, str] | None) -> str:
    """The browser's ``X-Request-Id`` if it is a sane one, else a new id."""
    for name, value in (headers or {}).items():
        if name.lower() == "x-request-id" and _REQUEST_ID.match(value):
            return value
    return new_id("req", 8)


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway's limits (the web server's settings build them)."""

    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    #: Seconds a call may wait for a free connection.
    pool_timeout: float = 10.0
    max_connections: int = 100
    #: Long-lived streams open at once, each on a connection of its own (not the pool's).
    max_streams: int = 1000
    keepalive_expiry: float = 5.0
    #: Answers of :meth:`Gateway.request` (JSON) and :meth:`Gateway.stream` (files).
    max_json_bytes: int = 8 * MiB
    max_file_bytes: int = 64 * MiB
    max_upload_bytes: int = 64 * MiB
    #: Attempts after the first, for calls that may be sent twice.
    retries: int = 2
    backoff_base: float = 0.1
    backoff_max: float = 2.0
    max_retry_after: float = 5.0
    breaker_failures: int = 5
    breaker_cool_down: float = 10.0
    #: Seconds between two resolutions of an upstream's name (0: at every call).
    dns_recheck_seconds: float = 30.0
    max_ws_message_bytes: int = 4 * MiB
    forward_request_headers: frozenset[str] = FORWARD_REQUEST_HEADERS
    return_response_headers: frozenset[str] = RETURN_RESPONSE_HEADERS


@dataclass
class _Route:
    """What the gateway knows of one upstream: its pinned address, its breaker, and
    whether its version was checked since the breaker last opened."""

    upstream: Upstream
    pin: Pin
    breaker: CircuitBreaker
    #: The breaker's ``openings`` when the version was last checked (-1: never).
    verified: int = -1
    mismatch: tuple[str, dict[str, Any]] | None = None
    mismatch_at: float = -math.inf
    lock: asyncio.Lock | None = None


class _Failed(Exception):
    """An exchange failed: the browser's error, whether to try again, whether it counts
    against the breaker."""

    def __init__(
        self,
        reason: str,
        *,
        retry: bool = False,
        counts: bool = True,
        retry_after: float | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry
        self.counts = counts
        self.retry_after = retry_after
        self.outcome = str((metadata or {}).get("upstream_status") or reason)
        self.error = ProviderUnavailable(
            _FAILURES[reason],
            metadata={"reason": reason, **(metadata or {})},
            retry_after=retry_after,
        )


def _transport_failure(exc: Exception) -> _Failed:
    """What an httpcore exception means for the browser and for the breaker."""
    if isinstance(exc, httpcore.ConnectTimeout):
        return _Failed("timeout", retry=True)
    if isinstance(exc, httpcore.ConnectError):
        return _Failed("unreachable", retry=True)
    if isinstance(exc, httpcore.PoolTimeout):
        return _Failed("busy", counts=False)
    if isinstance(exc, httpcore.TimeoutException):
        return _Failed("timeout")
    return _Failed("connection_lost")


_TRANSPORT_ERRORS = (httpcore.TimeoutException, httpcore.NetworkError, httpcore.RemoteProtocolError)


@dataclass(frozen=True)
class Answer:
    """An upstream's whole answer (2xx, or 304): status, filtered headers (lower-case
    names), body, and the request id it was sent under."""

    status_code: int
    headers: dict[str, str]
    content: bytes
    request_id: str

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` if it is not)."""
        return json.loads(self.content)


class UpstreamStream:
    """An upstream's answer (2xx, or 304) whose body is read as it arrives.

    :meth:`aiter_bytes` raises ``PayloadTooLarge`` past the cap and
    ``ProviderUnavailable`` if the body breaks or does not match its ``Content-Length``;
    by then the browser's answer has started, so its server can only cut it short.
    """

    def __init__(
        self,
        gateway: Gateway,
        route: _Route,
        ticket: Ticket,
        response: httpcore.Response,
        *,
        method: str,
        request_id: str,
        limit: int,
        connection: httpcore.AsyncHTTPConnection | None = None,
    ) -> None:
        self.status_code = response.status
        self.request_id = request_id
        allowed = gateway.settings.return_response_headers
        self.headers = returned_headers(response.headers, allowed, request_id)
        self._gateway = gateway
        self._route = route
        self._ticket = ticket
        self._response = response
        self._limit = limit
        self._declared = _content_length(response.headers)
        self._has_body = method != "HEAD" and response.status not in (204, 304)
        self._used = False
        self._complete = False
        #: A long-lived stream's own connection (``None``: the pool's).
        self._connection = connection
        self._closed = False

    async def aiter_bytes(self) -> AsyncGenerator[bytes]:
        """The body, chunk by chunk, as it arrives (once)."""
        if self._used:
            raise RuntimeError("an upstream answer is read once")
        self._used = True
        received = 0
        try:
            async for chunk in self._response.aiter_stream():
                received += len(chunk)
                if received > self._limit:
                    error = _too_large(self._limit)
                    error.request_id = self.request_id
                    raise error
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            short = self._declared is not None and received < self._declared
            self._fail(_Failed("length_mismatch") if short else _transport_failure(exc))
        if self._declared is not None and self._has_body:
            net = self._response.extensions.get("network_stream")
            if isinstance(net, CountingStream):
                extra = net.body_received()
                if extra is not None and extra > self._declared:
                    net.poisoned = True
                    await net.aclose()
                    self._fail(_Failed("length_mismatch"))
        self._complete = True

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        """Ends the answer. One not read to its end drops its connection (the rest of its
        body is not waited for, nor is the connection given back to the pool); a
        long-lived stream's own connection is closed whatever was read. Shielded: a
        request whose client left is being cancelled when it closes its answer."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                if self._has_body and not self._complete:
                    net = self._response.extensions.get("network_stream")
                    if isinstance(net, CountingStream):
                        # Looks readable while idle: the pool drops it rather than reuse it.
                        net.poisoned = True
                        await net.aclose()
                await self._response.aclose()
            finally:
                if self._connection is not None:
                    await self._connection.aclose()
                    self._gateway.stream_closed()

    def _fail(self, failed: _Failed) -> NoReturn:
        self._route.breaker.record(self._ticket, ok=False)
        name = self._route.upstream.name
        self._gateway.metrics.body_failures.labels(name, failed.reason).inc()
        log.info("gateway: upstream %s answer body failed: %s", name, failed.reason)
        failed.error.request_id = self.request_id
        raise failed.error from None


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        "the sandbox host's answer is larger than the gateway passes",
        metadata={"reason": "too_large", "limit": limit},
    )


def _upload_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        "the upload is larger than the gateway passes",
        metadata={"reason": "upload_too_large", "limit": limit},
    )


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _header(headers: Sequence[tuple[bytes, bytes]], wanted: bytes) -> str | None:
    for name, value in headers:
        if name.lower() == wanted:
            return value.decode("latin-1")
    return None


class Gateway:
    """The one way from the web server to its upstreams (see the module's rules).

    ``resolver`` resolves an upstream's host (the system's, in a thread, unless a test
    gives its own); ``registry`` receives the metrics (a private one if none);
    ``tls`` is the context for ``https``/``wss`` upstreams; ``clock`` drives the
    breakers and the DNS re-checks. :meth:`aclose` (or ``async with``) closes its
    connections.

    ``discover``: where more upstreams come from while it runs (the dataplanes of the
    sandbox hosts registered with the broker, read from its store; never a browser's
    input). A URL that no upstream admits has it asked again, at most every
    ``discover_seconds``, before the call is refused; the upstreams it returns replace
    the ones it returned before. Discovered upstreams do not count in the readiness
    (:meth:`states` with ``discovered=False``): one host down does not make the web
    server unready.
    """

    def __init__(
        self,
        upstreams: Iterable[Upstream],
        settings: GatewaySettings | None = None,
        *,
        resolver: Resolver | None = None,
        registry: CollectorRegistry | None = None,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
        discover: Callable[[], Awaitable[Iterable[Upstream]]] | None = None,
        discover_seconds: float = 1.0,
    ) -> None:
        self.settings = s = settings or GatewaySettings()
        self._resolver = resolver or system_resolver
        self._clock = clock
        self._tls = tls or ssl.create_default_context()
        self.allowlist = Allowlist(upstreams)
        pins: dict[tuple[str, int], Pin] = {}
        self._pins = pins
        self._routes: dict[str, _Route] = {}
        for upstream in self.allowlist.upstreams:
            self._add_route(upstream)
        self._static = frozenset(self._routes)
        self._discover = discover
        self._discover_seconds = discover_seconds
        self._discovered_at = -math.inf
        self._discover_lock = asyncio.Lock()
        self._timeouts = {
            "connect": s.connect_timeout,
            "read": s.read_timeout,
            "write": s.write_timeout,
            "pool": s.pool_timeout,
        }
        self._backend = PinnedBackend(pins)
        self._socket_options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=self._tls,
            max_connections=s.max_connections,
            keepalive_expiry=s.keepalive_expiry,
            retries=0,
            network_backend=self._backend,
            socket_options=self._socket_options,
        )
        #: Long-lived streams open now (each on its own connection).
        self.streams_open = 0
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, self.states)

    # --- what the web server calls ------------------------------------------------------

    async def request(
        self,
        method: str,
        url: str,
        *,
        token: str,
        headers: Mapping[str, str] | None = None,
        content: Body = None,
        idempotent: bool = False,
        max_bytes: int | None = None,
    ) -> Answer:
        """Send a call and read its whole answer (capped at ``max_json_bytes``).

        ``headers`` are the browser's (filtered); ``token`` the dataplane token the
        server holds. A 2xx (or 304) is returned; anything else raises the browser's
        :class:`~sandlot.protocol.errors.SandlotError`.
        """
        limit = self.settings.max_json_bytes if max_bytes is None else max_bytes
        async with self.stream(
            method,
            url,
            token=token,
            headers=headers,
            content=content,
            idempotent=idempotent,
            max_bytes=limit,
        ) as answer:
            content_read = await answer.aread()
        return Answer(answer.status_code, answer.headers, content_read, answer.request_id)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        token: str,
        headers: Mapping[str, str] | None = None,
        content: Body = None,
        idempotent: bool = False,
        max_bytes: int | None = None,
        long_lived: bool = False,
    ) -> AsyncIterator[UpstreamStream]:
        """Send a call; its answer's body streams (capped at ``max_file_bytes``).

        ``idempotent`` marks a ``POST`` that may be sent twice (a ``command_id`` in it);
        an ``Idempotency-Key`` header does the same. ``long_lived``: an answer that may
        stream for as long as its browser stays (an event stream) gets a connection of
        its own, outside the short calls' pool (at most ``max_streams`` at once).
        """
        method = method.upper()
        rid = request_id_of(headers)
        limit = self.settings.max_file_bytes if max_bytes is None else max_bytes
        connection: httpcore.AsyncHTTPConnection | None = None
        response: httpcore.Response | None = None
        if long_lived:
            self._stream_opened(rid)
        try:
            route, target = await self._target(method, url)
            _check_token(token)
            retry = method in IDEMPOTENT or idempotent
            retry = retry or any(k.lower() == "idempotency-key" for k in (headers or {}))
            if content is not None and not isinstance(content, bytes):
                retry = False
                content = _capped_upload(content, self.settings.max_upload_bytes)
            elif content is not None and len(content) > self.settings.max_upload_bytes:
                raise _upload_too_large(self.settings.max_upload_bytes)
            sent = self._request_headers(target, rid, token, headers, content)
            response, ticket, connection = await self._call(
                route, method, target, sent, content, retry, own=long_lived
            )
            declared = _content_length(response.headers)
            if declared is not None and declared > limit and method != "HEAD":
                raise _too_large(limit)
            answer = UpstreamStream(
                self,
                route,
                ticket,
                response,
                method=method,
                request_id=rid,
                limit=limit,
                connection=connection,
            )
        except BaseException as exc:
            if isinstance(exc, SandlotError):
                exc.request_id = rid
            if connection is not None:
                await _close(connection)
            elif response is not None:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            if long_lived:
                self.stream_closed()
            raise
        try:
            yield answer
        finally:
            await answer.aclose()

    async def websocket(
        self,
        url: str,
        *,
        token: str,
        headers: Mapping[str, str] | None = None,
        subprotocols: Sequence[str] | None = None,
    ) -> ClientConnection:
        """Open a WebSocket to an allowlisted upstream path (``ws``/``wss``, or the
        ``http``/``https`` form of its URL), under the same rules as HTTP calls; the
        caller closes it (or :func:`relay` does)."""
        rid = request_id_of(headers)
        try:
            route, target = await self._target("GET", url, websocket=True)
            _check_token(token)
            await self._verify(route)
            return await self._open_websocket(route, target, token, headers, subprotocols, rid)
        except _Failed as failed:
            failed.error.request_id = rid
            raise failed.error from None
        except SandlotError as exc:
            exc.request_id = rid
            raise

    def states(self, *, discovered: bool = True) -> dict[str, str]:
        """Each upstream's breaker state (``closed``, ``half-open``, ``open``) for ``/readyz``
        (``discovered=False``: the configured upstreams only)."""
        return {
            name: r.breaker.state.value
            for name, r in self._routes.items()
            if discovered or name in self._static
        }

    def _stream_opened(self, request_id: str) -> None:
        if self.streams_open >= self.settings.max_streams:
            log.info("gateway: %d long-lived streams are open: one more refused", self.streams_open)
            error = _Failed("streams", counts=False).error
            error.request_id = request_id
            raise error
        self.streams_open += 1

    def stream_closed(self) -> None:
        """A long-lived stream's connection was closed (its slot is free)."""
        self.streams_open -= 1

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- rules --------------------------------------------------------------------------

    def _add_route(self, upstream: Upstream) -> None:
        _, host, port = upstream.origin
        breaker = CircuitBreaker(
            upstream.name,
            failures=self.settings.breaker_failures,
            cool_down=self.settings.breaker_cool_down,
            clock=self._clock,
        )
        pin = self._pins.setdefault((host, port), Pin(host, port))
        self._routes[upstream.name] = _Route(upstream, pin, breaker)

    async def _target(
        self, method: str, url: str, *, websocket: bool = False
    ) -> tuple[_Route, httpx.URL]:
        try:
            try:
                upstream, target = self.allowlist.match(method, url, websocket=websocket)
            except SandlotError as exc:
                if exc.metadata.get("reason") not in _DISCOVERABLE or not await self._rediscover():
                    raise
                upstream, target = self.allowlist.match(method, url, websocket=websocket)
        except SandlotError as exc:
            reason = exc.metadata.get("reason", "url")
            self.metrics.refusals.labels(reason).inc()
            log.info("gateway: refused a call (%s)", reason)
            raise
        return self._routes[upstream.name], target

    async def _rediscover(self) -> bool:
        """Ask ``discover`` for the upstreams again (at most every ``discover_seconds``);
        whether they changed."""
        if self._discover is None:
            return False
        async with self._discover_lock:
            if self._clock() - self._discovered_at < self._discover_seconds:
                return False
            self._discovered_at = self._clock()
            try:
                found = {u.name: u for u in await self._discover()}
            except Exception:
                log.exception("gateway: discovering upstreams failed")
                return False
        found = {name: u for name, u in found.items() if name not in self._static}
        changed = False
        for name in [n for n in self._routes if n not in self._static and n not in found]:
            del self._routes[name]
            changed = True
        for name, upstream in found.items():
            route = self._routes.get(name)
            if route is None or route.upstream != upstream:
                self._add_route(upstream)
                changed = True
        if changed:
            self.allowlist = Allowlist(r.upstream for r in self._routes.values())
        return changed

    def _request_headers(
        self,
        target: httpx.URL,
        rid: str,
        token: str,
        headers: Mapping[str, str] | None,
        content: Body,
    ) -> list[tuple[bytes, bytes]]:
        sent = [
            (b"Host", target.netloc),
            (b"Accept-Encoding", b"identity"),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.forwarded(headers)),
            (b"Authorization", f"Bearer {token}".encode("ascii")),
            (b"X-Request-Id", rid.encode("ascii")),
        ]
        if isinstance(content, bytes):
            sent.append((b"Content-Length", str(len(content)).encode("ascii")))
        elif content is not None:
            sent.append((b"Transfer-Encoding", b"chunked"))
        return sent

    def forwarded(self, headers: Mapping[str, str] | None) -> list[tuple[str, str]]:
        """The browser's headers that may go upstream."""
        return forwarded_headers(headers, self.settings.forward_request_headers)

    async def _pinned(self, route: _Route) -> str:
        """The upstream's pinned address, or why not (see :mod:`sandlot.web.pinning`)."""
        name = route.upstream.name
        try:
            address, pinned_now = await route.pin.resolve(
                self._resolver,
                now=self._clock,
                recheck=self.settings.dns_recheck_seconds,
                timeout=self.settings.connect_timeout,
            )
        except Unresolved:
            raise _Failed("dns", retry=True) from None
        except AddressChanged as exc:
            log.warning(
                "gateway: upstream %s now resolves to %s, not its pinned %s: refused",
                name,
                ", ".join(exc.answer),
                exc.pinned,
            )
            self.metrics.refusals.labels("dns_changed").inc()
            raise refused("dns_changed") from None
        if pinned_now:
            log.info("gateway: upstream %s pinned to %s", name, address)
        return address

    # --- exchanges ----------------------------------------------------------------------

    async def _call(
        self,
        route: _Route,
        method: str,
        target: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: Body,
        retry: bool,
        *,
        own: bool = False,
    ) -> tuple[httpcore.Response, Ticket, httpcore.AsyncHTTPConnection | None]:
        """The version check and one exchange, tried again within the rules (``own``: on
        a connection of its own, returned with the answer)."""
        attempt = 0
        while True:
            try:
                await self._verify(route)
                return await self._exchange(route, method, target, headers, content, own=own)
            except _Failed as failed:
                if not (retry and failed.retry and attempt < self.settings.retries):
                    raise failed.error from None
                attempt += 1
                self.metrics.retries.labels(route.upstream.name).inc()
                await asyncio.sleep(self._backoff(attempt, failed.retry_after))

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.settings.max_retry_after)
        ceiling = min(self.settings.backoff_base * (1 << (attempt - 1)), self.settings.backoff_max)
        return random.uniform(0, ceiling)

    async def _exchange(
        self,
        route: _Route,
        method: str,
        target: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: Body,
        *,
        raw: bool = False,
        own: bool = False,
    ) -> tuple[httpcore.Response, Ticket, httpcore.AsyncHTTPConnection | None]:
        """One exchange through the breaker: the answer's head (2xx or 304; any status
        below 500 with ``raw``) or the reason it failed. ``own``: on a new connection,
        outside the pool, returned with the answer (the caller closes it); closed here if
        the exchange fails."""
        ticket = route.breaker.admit()
        name = route.upstream.name
        started = time.perf_counter()
        connection: httpcore.AsyncHTTPConnection | None = None
        try:
            await self._pinned(route)
            request = httpcore.Request(
                method,
                httpcore.URL(
                    scheme=target.raw_scheme,
                    host=target.raw_host,
                    port=target.port,
                    target=target.raw_path,
                ),
                headers=headers,
                content=content,
                extensions={"timeout": self._timeouts},
            )
            sender: httpcore.AsyncConnectionInterface | httpcore.AsyncConnectionPool = self._pool
            if own:
                sender = connection = httpcore.AsyncHTTPConnection(
                    request.url.origin,
                    ssl_context=self._tls,
                    network_backend=self._backend,
                    socket_options=self._socket_options,
                )
            try:
                response = await sender.handle_async_request(request)
            except httpcore.LocalProtocolError:
                raise InvalidRequest("the call cannot be sent as it is") from None
            except _TRANSPORT_ERRORS as exc:
                raise _transport_failure(exc) from None
            status = response.status
            seconds = time.perf_counter() - started
            if status >= 500:
                body = await _read_at_most(response, _ENVELOPE_LIMIT)
                retry_after = retry_after_seconds(_header(response.headers, b"retry-after"))
                raise _Failed(
                    "upstream_status",
                    retry=status in RETRY_STATUSES,
                    counts=own_envelope(body) is None,
                    retry_after=retry_after,
                    metadata={"upstream_status": status},
                )
            route.breaker.record(ticket, ok=True)
            self.metrics.exchange(name, method, str(status), seconds)
            if 300 <= status < 400 and status != 304:
                await response.aclose()
                log.info("gateway: upstream %s answered %s: redirect refused", name, status)
                self.metrics.refusals.labels("redirect").inc()
                raise refused("redirect")
            if status >= 400 and not raw:
                body = await _read_at_most(response, _ENVELOPE_LIMIT)
                retry_after = retry_after_seconds(_header(response.headers, b"retry-after"))
                raise upstream_error(status, body, retry_after)
            return response, ticket, connection
        except _Failed as failed:
            await _close(connection)
            if failed.counts:
                route.breaker.record(ticket, ok=False)
            else:
                route.breaker.abandon(ticket)
            seconds = time.perf_counter() - started
            self.metrics.exchange(name, method, failed.outcome, seconds)
            log.info("gateway: upstream %s %s failed: %s", name, method, failed.reason)
            raise
        except BaseException:
            await _close(connection)
            route.breaker.abandon(ticket)
            raise

    async def _verify(self, route: _Route) -> None:
        """Check the upstream's ``api_version`` (first use, and after its breaker opened)."""
        if route.verified == route.breaker.openings:
            return
        if route.lock is None:
            route.lock = asyncio.Lock()
        async with route.lock:
            if route.verified == route.breaker.openings:
                return
            cool_down = self.settings.breaker_cool_down
            if route.mismatch is not None and self._clock() - route.mismatch_at < cool_down:
                raise ProviderUnavailable(route.mismatch[0], metadata=dict(route.mismatch[1]))
            target = route.upstream.version_url
            headers = [
                (b"Host", target.netloc),
                (b"Accept", b"application/json"),
                (b"Accept-Encoding", b"identity"),
            ]
            response, _, _ = await self._exchange(route, "GET", target, headers, None, raw=True)
            body = await _read_at_most(response, _ENVELOPE_LIMIT)
            version = _api_version(body) if response.status == 200 else None
            ours = major_of(API_VERSION)
            if version is not None and major_of(version) == ours:
                route.verified = route.breaker.openings
                route.mismatch = None
                log.info("gateway: upstream %s speaks api_version %s", route.upstream.name, version)
                return
            if version is None:
                message = (
                    f"upstream {route.upstream.name} did not answer GET __meta/version "
                    f"as a sandlot dataplane (status {response.status})"
                )
            else:
                message = (
                    f"upstream {route.upstream.name} speaks dataplane api_version {version}, "
                    f"this server speaks {API_VERSION}: upgrade one of them"
                )
            metadata = {
                "reason": "api_version",
                "upstream": route.upstream.name,
                "upstream_api_version": version,
                "api_version": API_VERSION,
            }
            route.mismatch = (message, metadata)
            route.mismatch_at = self._clock()
            log.error("gateway: %s", message)
            raise ProviderUnavailable(message, metadata=dict(metadata))

    async def _open_websocket(
        self,
        route: _Route,
        target: httpx.URL,
        token: str,
        headers: Mapping[str, str] | None,
        subprotocols: Sequence[str] | None,
        rid: str,
    ) -> ClientConnection:
        ticket = route.breaker.admit()
        name = route.upstream.name
        started = time.perf_counter()
        secure = target.scheme == "https"
        try:
            address = await self._pinned(route)
            try:
                port = route.upstream.origin[2]
                sock = await connect_socket(address, port, self.settings.connect_timeout)
            except TimeoutError:
                raise _Failed("timeout", retry=True) from None
            except OSError:
                raise _Failed("unreachable", retry=True) from None
            sent = [*self.forwarded(headers), ("Authorization", f"Bearer {token}")]
            sent.append(("X-Request-Id", rid))
            try:
                # The socket is connected to the pinned address; the URL keeps the name
                # (Host, SNI). With a socket given, websockets follows no redirect.
                upstream = await connect(
                    str(target.copy_with(scheme="wss" if secure else "ws")),
                    sock=sock,
                    ssl=self._tls if secure else None,
                    additional_headers=sent,
                    subprotocols=[Subprotocol(p) for p in subprotocols or ()] or None,
                    open_timeout=self.settings.connect_timeout,
                    max_size=self.settings.max_ws_message_bytes,
                    compression=None,
                    logger=_websocket_log,
                )
            except BaseException as exc:
                sock.close()
                rejected = exc if isinstance(exc, InvalidStatus) else exc.__cause__
                if isinstance(rejected, InvalidStatus):
                    self._websocket_rejected(route, ticket, rejected)
                if isinstance(exc, TimeoutError):
                    raise _Failed("timeout") from None
                if isinstance(exc, OSError | InvalidHandshake | ValueError):
                    raise _Failed("connection_lost") from None
                raise
            route.breaker.record(ticket, ok=True)
            self.metrics.exchange(name, "GET", "101", time.perf_counter() - started)
            return upstream
        except _Failed as failed:
            if failed.counts:
                route.breaker.record(ticket, ok=False)
            else:
                route.breaker.abandon(ticket)
            self.metrics.exchange(name, "GET", failed.outcome, time.perf_counter() - started)
            log.info("gateway: upstream %s websocket failed: %s", name, failed.reason)
            raise
        except BaseException:
            route.breaker.abandon(ticket)
            raise

    def _websocket_rejected(self, route: _Route, ticket: Ticket, exc: InvalidStatus) -> NoReturn:
        status = exc.response.status_code
        body = bytes(exc.response.body)
        if status >= 500:
            raise _Failed(
                "upstream_status",
                counts=own_envelope(body) is None,
                metadata={"upstream_status": status},
            )
        route.breaker.record(ticket, ok=True)
        self.metrics.exchange(route.upstream.name, "GET", str(status), 0.0)
        if 300 <= status < 400:
            self.metrics.refusals.labels("redirect").inc()
            raise refused("redirect")
        raise upstream_error(
            status, body, retry_after_seconds(exc.response.headers.get("Retry-After"))
        )


async def _close(connection: httpcore.AsyncHTTPConnection | None) -> None:
    """Closes a connection of its own (shielded: its request may be being cancelled)."""
    if connection is not None:
        with anyio.CancelScope(shield=True):
            await connection.aclose()


def _check_token(token: str) -> None:
    # The token goes into a header: a malformed one is the server's bug (never shown).
    if not _TOKEN.match(token):
        raise ValueError("the dataplane token is malformed")


async def _capped_upload(content: AsyncIterable[bytes], limit: int) -> AsyncIterator[bytes]:
    sent = 0
    async for chunk in content:
        sent += len(chunk)
        if sent > limit:
            raise _upload_too_large(limit)
        yield chunk


async def _read_at_most(response: httpcore.Response, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of the answer (``None`` past them); closes it."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
    except _TRANSPORT_ERRORS as exc:
        raise _transport_failure(exc) from None
    finally:
        await response.aclose()
    return b"".join(chunks)


def _api_version(body: bytes | None) -> str | None:
    try:
        data = json.loads(body or b"")
    except ValueError:
        return None
    version = data.get("api_version") if isinstance(data, dict) else None
    return version if isinstance(version, str) and major_of(version) is not None else None


__all__ = [
    "Answer",
    "BrowserSocket",
    "ErrorAnswer",
    "Gateway",
    "GatewaySettings",
    "RelayEnd",
    "Resolver",
    "Upstream",
    "UpstreamStream",
    "error_answer",
    "relay",
    "request_id_of",
    "system_resolver",
]

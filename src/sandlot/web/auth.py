"""Browser sign-in: cookie sessions, one-time links, CSRF and Origin checks.

A browser signs in with an API key (``POST /api/auth/login``, JSON ``{"api_key"}`` or a
form field ``api_key``) or with a one-time link (``GET /login?token=…``, as Jupyter
prints one): ``sandlot web`` makes the link in process (:meth:`WebAuth.login_url`),
``sandlot open THREAD`` asks a running server for one with its API key
(``POST /api/auth/links``). Either way the server starts a browser session: the browser
gets an opaque random id in an ``HttpOnly``, ``SameSite=Strict`` cookie (``Secure``, and
named ``__Host-sandlot_session``, over TLS or behind an ``https`` public URL); the
server keeps the user, the credential it negotiates with on the user's behalf (never
sent back), the CSRF token and the session's idle and absolute expiry: in its memory
(:class:`BrowserSessions`, :class:`LoginLinks`), or, under ``sandlot serve``, in the
broker's store, shared by its replicas (:mod:`sandlot.broker.browsersessions`).
``GET /api/auth/me`` gives the page its user and CSRF token; ``POST /api/auth/logout``
ends the session.

Every request to the web app passes :class:`BrowserAuthMiddleware`:

- A request is cookie-authenticated or header-authenticated, never both: one carrying
  an ``Authorization`` header is left to its route with no browser session attached.
  Browsers never add that header on their own, so another site cannot forge one.
- A state-changing request (any method but GET, HEAD and OPTIONS) must come from an own
  origin (its ``Origin`` header, else its ``Referer``; with neither it is refused) and,
  except the API-key sign-in itself, carry the session's CSRF token in ``X-CSRF-Token``.
- A WebSocket handshake must come from an own origin and carry a live session cookie;
  otherwise it is refused before being accepted (HTTP 403 or 401, with the envelope).

The own origins are the public URL's (``SANDLOT_PUBLIC_URL``) when one is configured,
else the one the request was addressed to (its scheme and ``Host``), plus the
configured allowed origins. ``GET /login`` is the one GET that changes state: the link
is opened by a top-level navigation from a terminal, used once, valid for minutes.

Failures answer with the error envelope: 401 ``UNAUTHENTICATED``, 403 ``FORBIDDEN``.
No API key, session id, CSRF token or secret is ever logged; sign-in links appear in a
server's access log, if it keeps one, only as the spent token of a used link.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from sandlot.protocol.errors import (
    Forbidden,
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    SandlotError,
    Unauthenticated,
)
from sandlot.web.settings import WebSettings, normalize_origin

log = logging.getLogger(__name__)

T = TypeVar("T")

SESSION_COOKIE = "sandlot_session"
#: The cookie's name when it is ``Secure``: browsers then also insist on ``Path=/`` and
#: no ``Domain``, so a sibling host or a plain-HTTP page cannot plant one.
SECURE_SESSION_COOKIE = "__Host-sandlot_session"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: State-changing routes that need no CSRF token (there is no session yet).
TOKENLESS_PATHS = frozenset({"/api/auth/login"})
#: Largest sign-in request body.
MAX_AUTH_BODY_BYTES = 16 * 1024
_SCOPE_KEY = "sandlot.web.session"
_NO_STORE = {"Cache-Control": "no-store"}


class UserPrincipal(Protocol):
    """Who an API key belongs to (the broker's ``Principal`` is one)."""

    @property
    def user_id(self) -> str: ...


class KeyAuthenticator(Protocol):
    """Checks an API key (the broker's ``KeyService`` is one).

    Raises :class:`~sandlot.protocol.errors.Unauthenticated` for a key it refuses; it
    may block (it is called in a worker thread).
    """

    def authenticate(self, raw: str | None, /) -> UserPrincipal: ...


def secret_digest(secret: str) -> str:
    """The SHA-256 (hex) of a cookie's id or a link's secret: what a store keeps."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(eq=False)
class BrowserSession:
    """A signed-in browser, as the server remembers it."""

    user_id: str
    #: What the server negotiates with on the user's behalf (their API key); never sent.
    credential: str | None = field(repr=False)
    csrf_token: str = field(repr=False)
    created_at: float
    last_seen: float
    #: The absolute end; an idle session ends earlier.
    expires_at: float
    #: When the credential was last found valid.
    checked_at: float
    key: str = field(repr=False)


class SessionStore(Protocol):
    """Where a server keeps its browser sessions, looked up by the SHA-256 of the
    cookie's id: in its memory (:class:`BrowserSessions`) or in the broker's store,
    shared by its replicas and worker processes
    (:class:`sandlot.broker.browsersessions.StoredSessions`)."""

    #: Whether its calls block (a database): they then run in a worker thread.
    blocking: bool

    def create(self, user_id: str, *, credential: str | None) -> tuple[str, BrowserSession]:
        """A new session: the id for the cookie (kept nowhere) and the record."""
        ...

    def get(self, raw: str | None) -> BrowserSession | None:
        """The live session of a cookie's id (marking it used), or ``None``."""
        ...

    def delete(self, raw: str | None) -> bool: ...

    def discard(self, session: BrowserSession) -> None: ...

    def checked(self, session: BrowserSession, at: float) -> None:
        """Its credential was found valid at ``at``."""
        ...

    def end_user(self, user_id: str) -> int:
        """End every session of ``user_id``; returns how many."""
        ...


class LinkStore(Protocol):
    """Where a server keeps its one-time sign-in links (:class:`LoginLinks` in memory, or
    the broker's store: :class:`sandlot.broker.browsersessions.StoredLinks`)."""

    blocking: bool
    ttl_seconds: float

    def create(
        self, user_id: str, *, credential: str | None = None, next_path: str = "/"
    ) -> str: ...

    def redeem(self, token: str | None) -> LoginLink | None:
        """The link's grant if ``token`` is valid; it is spent either way."""
        ...


class BrowserSessions:
    """Live browser sessions, in memory, looked up by the SHA-256 of the cookie's id.

    Kept in the process: a restart signs every browser out. ``sandlot serve`` keeps its
    sessions in the broker's store instead, so that its worker processes and replicas
    share them.
    """

    blocking = False

    #: Sessions one user may hold; a new one ends their least recently used.
    MAX_PER_USER = 100

    def __init__(
        self,
        *,
        idle_seconds: float,
        max_seconds: float,
        max_sessions: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.max_seconds = max_seconds
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, BrowserSession] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, user_id: str, *, credential: str | None) -> tuple[str, BrowserSession]:
        """A new session; returns the id for the cookie (kept nowhere else) and the record."""
        raw = secrets.token_urlsafe(32)
        now = self._clock()
        session = BrowserSession(
            user_id=user_id,
            credential=credential,
            csrf_token=secrets.token_urlsafe(32),
            created_at=now,
            last_seen=now,
            expires_at=now + self.max_seconds,
            checked_at=now,
            key=secret_digest(raw),
        )
        with self._lock:
            for key in [k for k, s in self._sessions.items() if not self._live(s, now)]:
                del self._sessions[key]
            # Oldest first: one user signing in again and again ends their own sessions,
            # not everyone else's.
            mine = [k for k, s in self._sessions.items() if s.user_id == user_id]
            for key in mine[: max(0, len(mine) - self.MAX_PER_USER + 1)]:
                del self._sessions[key]
            while len(self._sessions) >= self.max_sessions:
                self._sessions.popitem(last=False)
            self._sessions[session.key] = session
        return raw, session

    def get(self, raw: str | None) -> BrowserSession | None:
        """The live session of a cookie's id (marking it used), or ``None``."""
        if not raw or len(raw) > 256:
            return None
        key = secret_digest(raw)
        now = self._clock()
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if not self._live(session, now):
                del self._sessions[key]
                return None
            session.last_seen = now
            self._sessions.move_to_end(key)
            return session

    def delete(self, raw: str | None) -> bool:
        if not raw:
            return False
        with self._lock:
            return self._sessions.pop(secret_digest(raw), None) is not None

    def discard(self, session: BrowserSession) -> None:
        with self._lock:
            self._sessions.pop(session.key, None)

    def checked(self, session: BrowserSession, at: float) -> None:
        session.checked_at = at

    def end_user(self, user_id: str) -> int:
        """End every session of ``user_id``; returns how many."""
        with self._lock:
            keys = [k for k, s in self._sessions.items() if s.user_id == user_id]
            for key in keys:
                del self._sessions[key]
        return len(keys)

    def _live(self, session: BrowserSession, now: float) -> bool:
        return now < session.expires_at and now - session.last_seen < self.idle_seconds


@dataclass(frozen=True)
class LoginLink:
    """What a one-time link signs its user into."""

    user_id: str
    credential: str | None = field(repr=False)
    #: Where the browser lands after signing in (a path on this server).
    next_path: str
    expires_at: float


class LoginLinks:
    """One-time sign-in tokens: ``<id>.<secret>``, the secret kept only as its SHA-256.

    A token is spent by its first use, right or wrong, and dies after ``ttl_seconds``.
    """

    blocking = False

    def __init__(
        self,
        *,
        ttl_seconds: float,
        max_links: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_links = max_links
        self._clock = clock
        self._links: OrderedDict[str, tuple[str, LoginLink]] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, user_id: str, *, credential: str | None = None, next_path: str = "/") -> str:
        link_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        now = self._clock()
        link = LoginLink(user_id, credential, checked_next(next_path), now + self.ttl_seconds)
        with self._lock:
            for key in [k for k, (_, v) in self._links.items() if v.expires_at <= now]:
                del self._links[key]
            while len(self._links) >= self.max_links:
                self._links.popitem(last=False)
            self._links[link_id] = (secret_digest(secret), link)
        return f"{link_id}.{secret}"

    def redeem(self, token: str | None) -> LoginLink | None:
        """The link's grant if ``token`` is valid; it is spent either way."""
        if not token or len(token) > 256:
            return None
        link_id, _, secret = token.partition(".")
        with self._lock:
            found = self._links.pop(link_id, None)
        if found is None:
            return None
        digest, link = found
        if not hmac.compare_digest(digest, secret_digest(secret)):
            return None
        if link.expires_at <= self._clock():
            return None
        return link


def checked_next(value: object) -> str:
    """A path on this server (never another host: ``//evil`` and ``/\\evil`` are refused)."""
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or value.startswith("//")
        or "\\" in value
        or len(value) > 2048
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)
    ):
        raise InvalidRequest("next must be a path on this server, such as /?thread=thr_1")
    return value


def error_response(exc: SandlotError) -> JSONResponse:
    """The error envelope of ``exc``, never cached."""
    return JSONResponse(
        exc.to_wire(f"req_{secrets.token_hex(8)}"), status_code=exc.status, headers=_NO_STORE
    )


async def sandlot_error_handler(request: Request, exc: Exception) -> Response:
    """For an app's ``exception_handlers``: a :class:`SandlotError` as its envelope."""
    if isinstance(exc, SandlotError):
        return error_response(exc)
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(InternalError("internal error"))


def _enveloped(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except SandlotError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unexpected error on %s %s", request.method, _route_path(request.scope))
            return error_response(InternalError("internal error"))

    return endpoint


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def current_user(conn: HTTPConnection) -> BrowserSession:
    """The browser session of a request or WebSocket; ``Unauthenticated`` without one.

    Needs :class:`BrowserAuthMiddleware` in front of the route (it refuses to guess).
    """
    if _SCOPE_KEY not in conn.scope:
        raise RuntimeError("BrowserAuthMiddleware must wrap the routes that call current_user")
    session: BrowserSession | None = conn.scope[_SCOPE_KEY]
    if session is None:
        raise Unauthenticated("sign in first")
    return session


class WebAuth:
    """Browser sign-in for the web app: its routes, and the checks of the middleware.

    ``authenticator`` checks API keys (``None``: only one-time links sign in). A
    session's credential is checked again every ``RECHECK_SECONDS`` of use, so a
    revoked key ends its browser sessions within that time.
    """

    RECHECK_SECONDS = 60.0

    def __init__(
        self,
        settings: WebSettings,
        authenticator: KeyAuthenticator | None = None,
        *,
        clock: Callable[[], float] = time.time,
        sessions: SessionStore | None = None,
        links: LinkStore | None = None,
    ) -> None:
        self.settings = settings
        self.authenticator = authenticator
        self._clock = clock
        # ``is None``: an empty store is falsy (it has a length).
        self.sessions: SessionStore = (
            sessions
            if sessions is not None
            else BrowserSessions(
                idle_seconds=settings.session_idle_seconds,
                max_seconds=settings.session_max_seconds,
                max_sessions=settings.max_sessions,
                clock=clock,
            )
        )
        self.links: LinkStore = (
            links
            if links is not None
            else LoginLinks(ttl_seconds=settings.login_link_ttl_seconds, clock=clock)
        )

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/api/auth/login", _enveloped(self.login), methods=["POST"]),
            Route("/login", _enveloped(self.login_with_link), methods=["GET"]),
            Route("/api/auth/links", _enveloped(self.create_link), methods=["POST"]),
            Route("/api/auth/logout", _enveloped(self.logout), methods=["POST"]),
            Route("/api/auth/me", _enveloped(self.me), methods=["GET"]),
        ]

    def login_url(
        self, base_url: str, user_id: str, *, credential: str | None = None, next_path: str = "/"
    ) -> str:
        """A one-time sign-in link for ``user_id`` (what ``sandlot web`` prints)."""
        token = self.links.create(user_id, credential=credential, next_path=next_path)
        return _link_url(base_url, token)

    async def _store(
        self, store: SessionStore | LinkStore, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)``, a method of ``store``: in a worker thread if the store
        blocks."""
        if store.blocking:
            return await run_in_threadpool(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    # -- what every request goes through -------------------------------------------

    def secure(self, conn: HTTPConnection) -> bool:
        """Whether the session cookie is ``Secure`` for this connection."""
        if self.settings.cookie_secure is not None:
            return self.settings.cookie_secure
        public = self.settings.public_origin
        return (public or "").startswith("https:") or conn.url.scheme in ("https", "wss")

    def cookie_name(self, conn: HTTPConnection) -> str:
        return SECURE_SESSION_COOKIE if self.secure(conn) else SESSION_COOKIE

    def own_origins(self, conn: HTTPConnection) -> frozenset[str]:
        origins = set(self.settings.allowed_origins)
        public = self.settings.public_origin
        if public is not None:
            origins.add(public)
        elif host := conn.headers.get("host"):
            scheme = "https" if conn.url.scheme in ("https", "wss") else "http"
            if own := normalize_origin(f"{scheme}://{host}"):
                origins.add(own)
        return frozenset(origins)

    def _foreign_origin(self, conn: HTTPConnection, *, referer: bool) -> str | None:
        """Why the connection's origin is not an own one, or ``None`` if it is."""
        origin = conn.headers.get("origin")
        if origin is None and referer:
            origin = conn.headers.get("referer")
        if origin is None:
            return "no Origin header" + (" or Referer" if referer else "")
        if normalize_origin(origin) not in self.own_origins(conn):
            return f"origin {origin[:200]!r} is not this server's"
        return None

    async def session_of(self, conn: HTTPConnection) -> BrowserSession | None:
        """The live session named by the connection's cookie, its credential still valid."""
        cookie = conn.cookies.get(self.cookie_name(conn))
        if not cookie:
            return None
        session = await self._store(self.sessions, self.sessions.get, cookie)
        if session is None:
            return None
        now = self._clock()
        if (
            session.credential is not None
            and self.authenticator is not None
            and now - session.checked_at >= self.RECHECK_SECONDS
        ):
            try:
                principal = await run_in_threadpool(
                    self.authenticator.authenticate, session.credential
                )
            except Unauthenticated:
                principal = None
            if principal is None or principal.user_id != session.user_id:
                log.info("browser session of %s ended: its key is no longer valid", session.user_id)
                await self._store(self.sessions, self.sessions.discard, session)
                return None
            await self._store(self.sessions, self.sessions.checked, session, now)
        return session

    async def guard(self, request: Request) -> BrowserSession | None:
        """The session of an HTTP request, once its origin and CSRF token pass."""
        if "authorization" in request.headers:
            return None
        session = await self.session_of(request)
        if request.method in SAFE_METHODS:
            return session
        path = _route_path(request.scope)
        if reason := self._foreign_origin(request, referer=True):
            log.info("refused %s %s: %s", request.method, path, reason)
            raise Forbidden("cross-origin request refused")
        if path in TOKENLESS_PATHS:
            return session
        if session is None:
            raise Unauthenticated("sign in first")
        token = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(token.encode(), session.csrf_token.encode()):
            log.info("refused %s %s: missing or wrong CSRF token", request.method, path)
            raise Forbidden(f"missing or wrong {CSRF_HEADER} header")
        return session

    async def admit_websocket(self, websocket: WebSocket) -> BrowserSession | None:
        """The session of a WebSocket handshake from an own origin; otherwise the
        handshake is refused (403 foreign origin, 401 no session) and ``None`` returned."""
        path = _route_path(websocket.scope)
        error: SandlotError | None = None
        session: BrowserSession | None = None
        if reason := self._foreign_origin(websocket, referer=False):
            log.info("refused WebSocket %s: %s", path, reason)
            error = Forbidden("cross-origin WebSocket refused")
        else:
            try:
                session = await self.session_of(websocket)
            except SandlotError as exc:
                error = exc
            else:
                if session is None:
                    error = Unauthenticated("sign in first")
        if error is None:
            return session
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(error_response(error))
        else:
            await websocket.close(code=1008)
        return None

    # -- routes --------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        """``POST /api/auth/login``: sign in with an API key (JSON or form)."""
        if self.authenticator is None:
            raise Unauthenticated("this server signs in with the link it printed")
        is_form, key = await _read_api_key(request)
        try:
            principal = await run_in_threadpool(self.authenticator.authenticate, key)
        except Unauthenticated:
            log.info("browser sign-in refused: invalid API key")
            raise Unauthenticated("invalid API key") from None
        raw, session = await self._start_session(request, principal.user_id, key)
        log.info("browser signed in as %s with an API key", session.user_id)
        response: Response
        if is_form:
            response = RedirectResponse(_root(request) + "/", status_code=303, headers=_NO_STORE)
        else:
            response = JSONResponse(_me(session), headers=_NO_STORE)
        self._set_cookie(response, request, raw, session)
        return response

    async def login_with_link(self, request: Request) -> Response:
        """``GET /login?token=…``: spend a one-time link, then go to its page."""
        if request.method == "HEAD":
            # Link checkers and previews probe with HEAD: that must not spend the link.
            return Response(status_code=204, headers=_NO_STORE)
        link = await self._store(self.links, self.links.redeem, request.query_params.get("token"))
        if link is None:
            log.info("browser sign-in refused: unknown, used or expired link")
            raise Unauthenticated("this sign-in link is invalid, used or expired")
        raw, session = await self._start_session(request, link.user_id, link.credential)
        log.info("browser signed in as %s with a one-time link", session.user_id)
        response = RedirectResponse(
            _root(request) + link.next_path,
            status_code=303,
            headers={**_NO_STORE, "Referrer-Policy": "no-referrer"},
        )
        self._set_cookie(response, request, raw, session)
        return response

    async def create_link(self, request: Request) -> Response:
        """``POST /api/auth/links`` with ``Authorization: Bearer <API key>``: a one-time
        link signing a browser in as the key's user (optional JSON ``{"next": path}``)."""
        if self.authenticator is None:
            raise Unauthenticated("this server does not take API keys")
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("an API key is required (Authorization: Bearer <key>)")
        body = await _read_body(request)
        next_path: object = "/"
        if body.strip():
            data = _json_object(body)
            next_path = data.get("next", "/")
        try:
            principal = await run_in_threadpool(self.authenticator.authenticate, key)
        except Unauthenticated:
            raise Unauthenticated("invalid API key") from None
        base = self.settings.public_url or str(request.base_url)
        token = await self._store(
            self.links,
            self.links.create,
            principal.user_id,
            credential=key,
            next_path=checked_next(next_path),
        )
        url = _link_url(base, token)
        log.info("one-time sign-in link made for %s", principal.user_id)
        expires_at = self._clock() + self.links.ttl_seconds
        return JSONResponse(
            {"url": url, "expires_at": expires_at}, status_code=201, headers=_NO_STORE
        )

    async def logout(self, request: Request) -> Response:
        """``POST /api/auth/logout``: end this browser's session."""
        session = current_user(request)
        await self._store(self.sessions, self.sessions.discard, session)
        log.info("browser of %s signed out", session.user_id)
        response = JSONResponse({"signed_out": True}, headers=_NO_STORE)
        response.delete_cookie(
            self.cookie_name(request),
            path="/",
            secure=self.secure(request),
            httponly=True,
            samesite="strict",
        )
        return response

    async def me(self, request: Request) -> Response:
        """``GET /api/auth/me``: the user, and the CSRF token the page sends back."""
        return JSONResponse(_me(current_user(request)), headers=_NO_STORE)

    async def _start_session(
        self, request: Request, user_id: str, credential: str | None
    ) -> tuple[str, BrowserSession]:
        """A new session for ``user_id``, ending the one the browser had."""
        if old := request.cookies.get(self.cookie_name(request)):
            await self._store(self.sessions, self.sessions.delete, old)
        return await self._store(
            self.sessions, self.sessions.create, user_id, credential=credential
        )

    def _set_cookie(
        self, response: Response, conn: HTTPConnection, raw: str, session: BrowserSession
    ) -> None:
        response.set_cookie(
            self.cookie_name(conn),
            raw,
            max_age=max(1, int(session.expires_at - self._clock())),
            path="/",
            secure=self.secure(conn),
            httponly=True,
            samesite="strict",
        )


def _me(session: BrowserSession) -> dict[str, Any]:
    return {
        "user": session.user_id,
        "csrf_token": session.csrf_token,
        "expires_at": session.expires_at,
    }


def _link_url(base_url: str, token: str) -> str:
    return f"{base_url.rstrip('/')}/login?token={token}"


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


async def read_capped(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes, declared or streamed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the body is larger than {limit} bytes")
    return bytes(body)


async def _read_body(request: Request) -> bytes:
    return await read_capped(request, MAX_AUTH_BODY_BYTES)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        raise InvalidRequest("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    return data


async def _read_api_key(request: Request) -> tuple[bool, str]:
    """(whether it came from a form, the key) of a sign-in request."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    body = await _read_body(request)
    if media_type == "application/x-www-form-urlencoded":
        try:
            fields = parse_qs(body.decode(), max_num_fields=20)
        except (UnicodeDecodeError, ValueError):
            raise InvalidRequest("the form cannot be read") from None
        key = (fields.get("api_key") or [""])[0]
        is_form = True
    elif media_type == "application/json":
        value = _json_object(body).get("api_key")
        key = value if isinstance(value, str) else ""
        is_form = False
    else:
        raise InvalidRequest('send the key as JSON {"api_key": …} or as a form field api_key')
    if not key:
        raise Unauthenticated("an API key is required")
    return is_form, key


class BrowserAuthMiddleware:
    """Attaches the browser session to each request and WebSocket of the app it wraps,
    after the origin, CSRF and WebSocket checks of :class:`WebAuth`."""

    def __init__(self, app: ASGIApp, auth: WebAuth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                session = await self.auth.guard(Request(scope, receive))
            except SandlotError as exc:
                await error_response(exc)(scope, receive, send)
                return
            scope[_SCOPE_KEY] = session
        elif scope["type"] == "websocket":
            session = await self.auth.admit_websocket(WebSocket(scope, receive, send))
            if session is None:
                return
            scope[_SCOPE_KEY] = session
        await self.app(scope, receive, send)

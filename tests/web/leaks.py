"""The suite-wide leak scan: no credential reaches a browser, a query string or a log line.

Every test of ``tests/web`` (and ``tests/cli/test_web.py``) runs under a
:class:`LeakScan` (the autouse fixtures of ``tests/web/conftest.py``); at each test's
teardown :meth:`LeakScan.check` looks at everything seen since the last check and fails
the test on a leak. What it **collects**:

- **What the browser receives** from the web app (a path ``WebDispatch.is_web`` claims:
  ``/``, ``/login``, ``/api/…``, ``/ws/…``), through the test's own clients: every
  ``httpx`` response's body (read or streamed, error pages included) and headers, every
  frame a ``websockets`` client receives, a WebSocket's close reason and a refused
  handshake's answer; and the URL of each such request (its query string). The broker's
  ``/v1/…`` answers are not the browser's: ``ensure`` hands the SDK its dataplane token.
- **Log lines**: every record of every logger at every level in this process (a handler
  on the root logger at DEBUG, loggers set above DEBUG lowered for the while, levels
  restored after; SQLAlchemy's statement echo stays off), and every line a
  :class:`~tests.servers.SandlotServer` prints.
- **Secrets**, by shape and by value. By shape: a JWT (``eyJ….eyJ…``; a terminal session
  id is told from a dataplane token by its audience, and an unsigned one, ``alg: none``,
  is a test's forgery, no secret) and an API key (``sl_…``). By value,
  as they are issued in this process: API keys (``KeyService.create``,
  ``SandlotServer.key``), dataplane tokens (``KeyRing.mint``, ``LocalSigner.mint``), the
  key signing session ids (``SessionTokens``, a server's ``web-session.key``), session
  cookies and CSRF tokens (``BrowserSessions.create``, and a subprocess server's
  ``Set-Cookie`` and sign-in answers), one-time link tokens (``LoginLinks.create``).

What is **allowed where** (docs/WEB.md, "Browser sign-in"):

- A credential (API key, dataplane token, signing key): nowhere.
- A session cookie: in ``Set-Cookie`` only; in a debug line of a library, not sandlot's
  (uvicorn's and websockets' dumps of request headers show cookies, as any server's do).
- A CSRF token: in the answers of ``/api/auth/login`` and ``/api/auth/me``; in a library's
  debug line.
- A terminal session id and a link token are the browser's: in anything it receives or
  sends, and in a library's log lines (the access log's request line); never in sandlot's.
- No browser-facing answer carries an internal header (``Authorization``, ``X-Api-Key``,
  ``X-Sandlot-On-Behalf-Of``, ``X-Sandlot-Provider-Secret``, ``Proxy-Authorization``).

``tests/web/test_leaks.py`` plants each kind of leak in a throwaway app and shows the scan
fails on it.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import enum
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection

from sandlot.broker.keys import KeyService
from sandlot.broker.tokens import KeyRing
from sandlot.cli.server import WebDispatch
from sandlot.web.auth import SECURE_SESSION_COOKIE, SESSION_COOKIE, BrowserSessions, LoginLinks
from sandlot.web.localplane import LocalSigner
from sandlot.web.session_tokens import AUDIENCE as SESSION_ID_AUDIENCE
from sandlot.web.session_tokens import SessionTokens
from tests.servers import SandlotServer

JWT = re.compile(r"eyJ[A-Za-z0-9_-]{2,}\.eyJ[A-Za-z0-9_-]{2,}(?:\.[A-Za-z0-9_-]*)?")
API_KEY = re.compile(r"sl_[a-z0-9]{12}_[A-Za-z0-9_-]{20,}")
INTERNAL_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "x-sandlot-on-behalf-of",
        "x-sandlot-provider-secret",
    }
)
#: The answers that carry the page's own CSRF token.
CSRF_ANSWERS = frozenset({"/api/auth/login", "/api/auth/me"})
#: A subprocess server's log line (``sandlot.broker.logs``' text format).
SERVER_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ([A-Z]+) (\S+): ")
#: Shorter values would match by chance.
MIN_SECRET_CHARS = 16


class Secret(enum.Enum):
    CREDENTIAL = "credential"
    COOKIE = "session cookie"
    CSRF = "CSRF token"
    BROWSER_HELD = "browser-held id"


class Place(enum.Enum):
    BODY = "body"
    FRAME = "frame"
    HEADER = "header"
    SET_COOKIE = "set-cookie"
    URL = "url"
    LOG = "log line"
    SERVER_LOG = "server line"


@dataclass(frozen=True)
class Seen:
    """One thing scanned: where it was seen, and what it says."""

    place: Place
    text: str
    #: The request path (bodies, frames, headers, URLs) or the logger's name (lines).
    source: str = ""
    level: int = logging.INFO

    def describe(self) -> str:
        if self.place in (Place.LOG, Place.SERVER_LOG):
            return f"{self.place.value} of {self.source} at {logging.getLevelName(self.level)}"
        return f"{self.place.value} of {self.source}"


def allowed(kind: Secret, seen: Seen) -> bool:
    """Whether a secret of ``kind`` may appear where ``seen`` was (the module's table)."""
    if kind is Secret.CREDENTIAL:
        return False
    if seen.place in (Place.LOG, Place.SERVER_LOG):
        if seen.source.startswith("sandlot"):
            return False
        return kind is Secret.BROWSER_HELD or seen.level < logging.INFO
    if kind is Secret.COOKIE:
        return seen.place is Place.SET_COOKIE
    if kind is Secret.CSRF:
        return seen.place is Place.BODY and seen.source in CSRF_ANSWERS
    return True


def jwt_kind(token: str) -> Secret | None:
    """A terminal session id (the browser's), an unsigned JWT (no secret: a forgery a
    test sends), or anything else (a credential)."""
    try:
        header, payload = (
            json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
            for part in token.split(".")[:2]
        )
    except (ValueError, binascii.Error):
        return Secret.CREDENTIAL
    if isinstance(header, dict) and str(header.get("alg", "")).lower() == "none":
        return None
    if isinstance(payload, dict) and payload.get("aud") == SESSION_ID_AUDIENCE:
        return Secret.BROWSER_HELD
    return Secret.CREDENTIAL


def text_forms(secret: bytes) -> list[str]:
    """How a binary key could be written out."""
    forms = [secret.hex(), base64.b64encode(secret).decode().rstrip("=")]
    forms.append(base64.urlsafe_b64encode(secret).decode().rstrip("="))
    with contextlib.suppress(UnicodeDecodeError):
        forms.append(secret.decode())
    return forms


@dataclass
class Counts:
    bodies: int = 0
    frames: int = 0
    headers: int = 0
    urls: int = 0
    lines: int = 0
    server_lines: int = 0

    def add(self, seen: Seen) -> None:
        name = {
            Place.BODY: "bodies",
            Place.FRAME: "frames",
            Place.HEADER: "headers",
            Place.SET_COOKIE: "headers",
            Place.URL: "urls",
            Place.LOG: "lines",
            Place.SERVER_LOG: "server_lines",
        }[seen.place]
        setattr(self, name, getattr(self, name) + 1)

    def __iadd__(self, other: Counts) -> Counts:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def total(self) -> int:
        return sum(vars(self).values())

    def __str__(self) -> str:
        return (
            f"{self.bodies} bodies, {self.frames} frames, {self.headers} headers, "
            f"{self.urls} URLs, {self.lines} log lines, {self.server_lines} server lines"
        )


def find_leaks(items: list[Seen], secrets: dict[str, Secret]) -> list[str]:
    """Every secret in ``items`` where it is not allowed: JWTs and API keys by shape,
    ``secrets`` by value. All items are searched as one text, then located."""
    if not items:
        return []
    starts: list[int] = []
    parts: list[str] = []
    at = 0
    for item in items:
        starts.append(at)
        parts.append(item.text)
        at += len(item.text) + 1
    blob = "\n".join(parts)

    def owner(offset: int) -> Seen:
        return items[bisect.bisect_right(starts, offset) - 1]

    found: list[str] = []

    def leak(kind: Secret, value: str, offset: int) -> None:
        seen = owner(offset)
        if not allowed(kind, seen):
            shown = f"{value[:12]}…" if len(value) > 12 else value
            found.append(f"a {kind.value} ({shown}) in a {seen.describe()}: {seen.text[:300]!r}")

    for m in JWT.finditer(blob):
        if (kind := jwt_kind(m.group())) is not None:
            leak(kind, m.group(), m.start())
    for m in API_KEY.finditer(blob):
        leak(Secret.CREDENTIAL, m.group(), m.start())
    for value, kind in secrets.items():
        offset = blob.find(value)
        while offset >= 0:
            leak(kind, value, offset)
            offset = blob.find(value, offset + 1)
    for item in items:
        if item.place is Place.HEADER:
            name = item.text.partition(":")[0].strip().lower()
            if name in INTERNAL_HEADERS:
                found.append(f"an internal header in a {item.describe()}: {name}")
    return found


class _Lines(logging.Handler):
    """Every record, formatted as it is emitted (its arguments may change later)."""

    def __init__(self, scan: LeakScan) -> None:
        super().__init__(logging.DEBUG)
        self.scan = scan
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a record that cannot be formatted shows nothing
            return
        self.scan.add(Seen(Place.LOG, line, record.name, record.levelno))


#: Where a response keeps the body its client read, a connection its scan.
_BODY = "_leak_scan_body"
_SOCKET = "_leak_scan_socket"


@dataclass
class _Output:
    """A subprocess server's output, and how much of it is scanned yet."""

    server: SandlotServer
    taken: int = 0
    #: The start of a line not ended yet.
    tail: str = ""

    def lines(self, final: bool) -> list[str]:
        chunks = self.server.output[self.taken :]
        self.taken += len(chunks)
        text = self.tail + "".join(chunks)
        lines = text.split("\n")
        self.tail = "" if final else lines.pop()
        return [line for line in lines if line.strip()]


@dataclass
class _Socket:
    """A WebSocket the test's client opened, and what of it is scanned yet."""

    conn: ClientConnection
    frames: list[str] = field(default_factory=list)
    handshake_done: bool = False
    close_done: bool = False

    @property
    def path(self) -> str:
        return str(self.conn.protocol.uri.path)


class LeakScan:
    """What one module's tests let through to a browser or a log, checked test by test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[Seen] = []
        self.secrets: dict[str, Secret] = {}
        self.counts = Counts()
        self.responses: list[httpx.Response] = []
        self.sockets: list[_Socket] = []
        self.servers: dict[int, _Output] = {}
        self._handler = _Lines(self)
        self._levels: dict[logging.Logger, int] = {}
        self._patches = pytest.MonkeyPatch()

    # -- collecting --------------------------------------------------------------------

    def add(self, seen: Seen) -> None:
        with self.lock:
            self.pending.append(seen)

    def secret(self, value: str | None, kind: Secret) -> None:
        if value and len(value) >= MIN_SECRET_CHARS:
            with self.lock:
                self.secrets.setdefault(value, kind)

    def credential(self, value: str) -> None:
        self.secret(value, Secret.CREDENTIAL)
        if m := API_KEY.fullmatch(value):
            self.secret(m.group().rsplit("_", 1)[1], Secret.CREDENTIAL)

    def start(self) -> LeakScan:
        root = logging.getLogger()
        self._levels[root] = root.level
        root.setLevel(logging.DEBUG)
        root.addHandler(self._handler)
        for logger in list(logging.Logger.manager.loggerDict.values()):
            if not isinstance(logger, logging.Logger):
                continue
            # SQLAlchemy's INFO and DEBUG are its ``echo`` of every statement and row,
            # a switch of its own (off), not a level of what it reports.
            if logger.level > logging.DEBUG and not logger.name.startswith("sqlalchemy"):
                self._levels[logger] = logger.level
                logger.setLevel(logging.DEBUG)
            if not logger.propagate:
                logger.addHandler(self._handler)
        self._hook()
        return self

    def stop(self) -> None:
        self._patches.undo()
        for logger in list(logging.Logger.manager.loggerDict.values()):
            if isinstance(logger, logging.Logger):
                logger.removeHandler(self._handler)
        logging.getLogger().removeHandler(self._handler)
        for logger, level in self._levels.items():
            logger.setLevel(level)

    def _hook(self) -> None:
        scan = self
        patch = self._patches.setattr

        def wrap(owner: Any, name: str, after: Any) -> None:
            original = getattr(owner, name)

            def hooked(*args: Any, **kw: Any) -> Any:
                result = original(*args, **kw)
                after(result, *args, **kw)
                return result

            patch(owner, name, hooked)

        async def asend(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> Any:
            response = await original_asend(self, request, **kw)
            with scan.lock:
                scan.responses.append(response)
            return response

        def send(self: httpx.Client, request: httpx.Request, **kw: Any) -> Any:
            response = original_send(self, request, **kw)
            with scan.lock:
                scan.responses.append(response)
            return response

        # What the client reads, read whole or streamed (decoded, as the page gets it).
        def iter_bytes(self: httpx.Response, *args: Any, **kw: Any) -> Iterator[bytes]:
            for chunk in original_iter_bytes(self, *args, **kw):
                self.__dict__.setdefault(_BODY, bytearray()).extend(chunk)
                yield chunk

        async def aiter_bytes(self: httpx.Response, *args: Any, **kw: Any) -> AsyncIterator[bytes]:
            async for chunk in original_aiter_bytes(self, *args, **kw):
                self.__dict__.setdefault(_BODY, bytearray()).extend(chunk)
                yield chunk

        original_asend = httpx.AsyncClient.send
        original_send = httpx.Client.send
        original_iter_bytes = httpx.Response.iter_bytes
        original_aiter_bytes = httpx.Response.aiter_bytes
        patch(httpx.AsyncClient, "send", asend)
        patch(httpx.Client, "send", send)
        patch(httpx.Response, "iter_bytes", iter_bytes)
        patch(httpx.Response, "aiter_bytes", aiter_bytes)

        original_init = ClientConnection.__init__
        original_recv = ClientConnection.recv

        def init(self: ClientConnection, *args: Any, **kw: Any) -> None:
            original_init(self, *args, **kw)
            socket = _Socket(self)
            if WebDispatch.is_web(socket.path):  # not the gateway's to a dataplane
                with scan.lock:
                    scan.sockets.append(socket)
                self.__dict__[_SOCKET] = socket

        async def recv(self: ClientConnection, *args: Any, **kw: Any) -> Any:
            data = await original_recv(self, *args, **kw)
            if (socket := self.__dict__.get(_SOCKET)) is not None:
                socket.frames.append(data if isinstance(data, str) else data.decode("latin-1"))
            return data

        patch(ClientConnection, "__init__", init)
        patch(ClientConnection, "recv", recv)

        def issued_session(result: tuple[str, Any], *args: Any, **kw: Any) -> None:
            raw, session = result
            scan.secret(raw, Secret.COOKIE)
            scan.secret(session.csrf_token, Secret.CSRF)

        wrap(BrowserSessions, "create", issued_session)
        wrap(LoginLinks, "create", lambda token, *a, **k: scan.secret(token, Secret.BROWSER_HELD))
        wrap(KeyService, "create", lambda result, *a, **k: scan.credential(result[0]))
        wrap(SandlotServer, "key", lambda key, *a, **k: scan.credential(key))
        wrap(KeyRing, "mint", lambda minted, *a, **k: scan.credential(minted.token))
        wrap(LocalSigner, "mint", lambda minted, *a, **k: scan.credential(minted.token))

        def signing_key(_: None, tokens: SessionTokens, *a: Any, **k: Any) -> None:
            for form in text_forms(a[0] if a else k["secret"]):
                scan.credential(form)

        wrap(SessionTokens, "__init__", signing_key)
        wrap(SandlotServer, "start", lambda server, *a, **k: scan.watch(server))

    def watch(self, server: SandlotServer) -> None:
        """Scan what ``server`` prints (and know its keys)."""
        self.servers.setdefault(id(server), _Output(server))
        for name, value in server.env.items():
            if "SECRET" in name or "KEY" in name:
                self.credential(value)

    # -- checking ----------------------------------------------------------------------

    def _take_responses(self) -> list[Seen]:
        seen: list[Seen] = []
        with self.lock:
            responses, self.responses = self.responses, []
        for r in responses:
            path = r.request.url.path
            if not WebDispatch.is_web(path):
                continue
            body = r.__dict__.get(_BODY) or r.__dict__.get("_content", b"")
            text = bytes(body).decode("utf-8", errors="replace")
            seen.append(Seen(Place.BODY, text, path))
            seen.append(Seen(Place.URL, str(r.request.url), path))
            seen += self._headers(r.headers.multi_items(), path)
            if path in CSRF_ANSWERS and r.status_code == 200:
                with contextlib.suppress(ValueError):
                    self.secret(r.json().get("csrf_token"), Secret.CSRF)
            if path == "/api/auth/links" and r.status_code == 201:
                link = str(r.json().get("url", ""))
                self.secret(link.partition("token=")[2], Secret.BROWSER_HELD)
        return seen

    def _headers(self, headers: Any, path: str) -> list[Seen]:
        seen = []
        for name, value in headers:
            if name.lower() == "set-cookie":
                cookie, _, rest = value.partition("=")
                if cookie.strip() in (SESSION_COOKIE, SECURE_SESSION_COOKIE):
                    self.secret(rest.partition(";")[0], Secret.COOKIE)
                seen.append(Seen(Place.SET_COOKIE, f"{name}: {value}", path))
            else:
                seen.append(Seen(Place.HEADER, f"{name}: {value}", path))
        return seen

    def _take_sockets(self) -> list[Seen]:
        seen: list[Seen] = []
        with self.lock:
            sockets = list(self.sockets)
        for socket in sockets:
            path = socket.path
            frames, socket.frames = socket.frames, []
            seen += [Seen(Place.FRAME, frame, path) for frame in frames]
            response = socket.conn.response
            if response is not None and not socket.handshake_done:
                socket.handshake_done = True
                seen.append(Seen(Place.URL, socket.conn.protocol.uri.resource_name, path))
                seen += self._headers(response.headers.raw_items(), path)
                body = (response.body or b"").decode("utf-8", errors="replace")
                seen.append(Seen(Place.FRAME, body, path))
            if socket.conn.protocol.close_rcvd is not None and not socket.close_done:
                socket.close_done = True
                seen.append(Seen(Place.FRAME, socket.conn.protocol.close_rcvd.reason, path))
        with self.lock:
            self.sockets = [s for s in self.sockets if not s.close_done]
        return seen

    def _take_server_lines(self, final: bool) -> list[Seen]:
        seen: list[Seen] = []
        for output in self.servers.values():
            key = output.server.data_dir / "web-session.key"
            if key.is_file():
                for form in text_forms(key.read_bytes()):
                    self.credential(form)
            for line in output.lines(final):
                m = SERVER_LINE.match(line)
                name, level = (m.group(2), logging.getLevelName(m.group(1))) if m else ("", 0)
                if not isinstance(level, int) or not name:
                    # A banner or a traceback's line: judged as sandlot's own.
                    name, level = "sandlot", logging.INFO
                seen.append(Seen(Place.SERVER_LOG, line, name, level))
        return seen

    def check(self, *, final: bool = False) -> Counts:
        """Scan everything seen since the last check; fail on any leak. Returns the counts."""
        items = self._take_responses() + self._take_sockets() + self._take_server_lines(final)
        with self.lock:
            items += self.pending
            self.pending = []
            secrets = dict(self.secrets)
        counts = Counts()
        for item in items:
            counts.add(item)
        self.counts += counts
        leaks = find_leaks(items, secrets)
        assert not leaks, f"{len(leaks)} leaked:\n" + "\n".join(leaks[:20])
        return counts


#: Everything the scans of this run saw (the terminal summary reports it).
TOTALS = Counts()


@pytest.fixture(scope="module", autouse=True)
def leak_scan() -> Iterator[LeakScan]:
    """The module's scan: collecting from before its servers start to after they stop."""
    scan = LeakScan().start()
    try:
        yield scan
        scan.check(final=True)
    finally:
        scan.stop()
        TOTALS.__iadd__(scan.counts)


@pytest.fixture(autouse=True)
def scanned(leak_scan: LeakScan) -> Iterator[None]:
    """Each test checked at its end (what its module's servers said meanwhile included)."""
    yield
    leak_scan.check()

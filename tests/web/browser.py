"""A real web app serving the terminal and chat routes over a real ``sandlot serve``, and a
browser for it: signed in with a one-time link, WebSockets sent with an own ``Origin``.

The workspace is the one a test negotiated with the real broker (its grant), wrapped in
a minimal :class:`~sandlot.web.workspace.Workspace`; every call to its dataplane goes
through a real :class:`~sandlot.web.gateway.Gateway` allowlisting that dataplane.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from sandlot.protocol.errors import SandlotError
from sandlot.sdk import Grant
from sandlot.web.auth import BrowserAuthMiddleware, WebAuth, sandlot_error_handler
from sandlot.web.gateway import Gateway, Upstream
from sandlot.web.session_tokens import SessionTokens
from sandlot.web.settings import WebSettings
from sandlot.web.workspace import Dataplane
from tests.servers import SandlotServer
from tests.web.conftest import Clock, serving

SECRET = secrets.token_bytes(32)


@dataclass
class GrantWorkspace:
    """A thread's sandbox as the web server would open it: the grants it negotiated, used
    in turn (as a real workspace hands out a renewed token now and then)."""

    id: str
    grant: Grant
    others: tuple[Grant, ...] = ()
    #: A token the dataplane refuses, handed out until :meth:`renewed` is called.
    stale: str | None = None
    #: Calls to :meth:`dataplane` and :meth:`renewed` so far.
    calls: int = 0
    renewals: int = 0

    async def dataplane(self) -> Dataplane:
        grants = (self.grant, *self.others)
        g = grants[self.calls % len(grants)]
        self.calls += 1
        return Dataplane(
            g.sandbox_id,
            g.http_base_url,
            g.ws_base_url,
            self.stale or g.token,
            frozenset(g.capabilities),
        )

    async def renewed(self) -> Dataplane:
        self.renewals += 1
        self.stale = None
        return await self.dataplane()


def dataplane_gateway(server: SandlotServer) -> Gateway:
    return Gateway([Upstream("dp", f"{server.url}/dp", ("/dp/",))])


@dataclass
class Browser:
    """The app under uvicorn and a signed-in browser: its cookie, CSRF token, and every
    frame and body it received (scanned for credentials)."""

    base: str
    auth: WebAuth | None
    cookie: str
    csrf: str
    received: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        return self.base

    def ws_url(self, path: str, **query: Any) -> str:
        params = urlencode({k: v for k, v in query.items() if v is not None}, doseq=True)
        return f"{self.base.replace('http', 'ws', 1)}{path}" + (f"?{params}" if params else "")

    @contextlib.asynccontextmanager
    async def socket(
        self, path: str = "/ws/pty", *, origin: str | None = None, **query: Any
    ) -> AsyncIterator[Socket]:
        async with connect(
            self.ws_url(path, **query),
            origin=origin or self.origin,  # type: ignore[arg-type]
            additional_headers={"Cookie": f"sandlot_session={self.cookie}"},
            max_queue=4,
            max_size=16 * 1024 * 1024,
        ) as ws:
            yield Socket(ws, self.received)

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {
            "Cookie": f"sandlot_session={self.cookie}",
            "Origin": self.origin,
            "X-CSRF-Token": self.csrf,
            **kw.pop("headers", {}),
        }
        async with httpx.AsyncClient(base_url=self.base) as client:
            r = await client.request(method, path, headers=headers, **kw)
        self.received.append(r.text)
        return r


class Socket:
    """A browser's WebSocket: frames read as JSON (a binary frame of output as an
    ``output`` frame marked ``binary``), the terminal's output gathered."""

    def __init__(self, ws: ClientConnection, received: list[str]) -> None:
        self.ws = ws
        self.received = received
        self.frames: list[dict[str, Any]] = []
        #: Output by offset (``/ws/pty``), as the page would write it.
        self.chunks: list[tuple[int, str]] = []

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def type(self, text: str) -> None:
        await self.send({"type": "input", "data": text})

    async def frame(self) -> dict[str, Any]:
        raw = await self.ws.recv()
        frame: dict[str, Any]
        if isinstance(raw, bytes):
            # ``/ws/pty?binary=1``'s output: the offset (8 bytes, big-endian), the bytes.
            data = raw[8:].decode()
            self.received.append(data)
            frame = {"type": "output", "offset": int.from_bytes(raw[:8]), "data": data}
            frame["binary"] = True
        else:
            self.received.append(raw)
            frame = json.loads(raw)
        self.frames.append(frame)
        if frame.get("type") == "output":
            self.chunks.append((frame["offset"], frame["data"]))
        return frame

    async def until(self, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read frames until one satisfies ``done`` (which is returned)."""
        async with asyncio.timeout(30):
            while True:
                frame = await self.frame()
                if done(frame):
                    return frame

    async def until_output(self, text: str) -> str:
        """Read until the output (history included) contains ``text``; all of it so far."""
        async with asyncio.timeout(30):
            while text not in self.output():
                await self.frame()
        return self.output()

    def same_bytes_as(self, other: Socket) -> int:
        """Checks that where both sockets received output, they received the same bytes
        (their frames may be cut differently: output is merged per socket); answers how
        many bytes both received."""
        ours, theirs = self._bytes(), other._bytes()
        start = max(ours[0], theirs[0])
        end = min(ours[0] + len(ours[1]), theirs[0] + len(theirs[1]))
        if end <= start:
            return 0
        mine = ours[1][start - ours[0] : end - ours[0]]
        assert mine == theirs[1][start - theirs[0] : end - theirs[0]], (start, end)
        return end - start

    def _bytes(self) -> tuple[int, bytes]:
        """The output from the first chunk on, each chunk where the previous ended."""
        start = self.chunks[0][0] if self.chunks else 0
        out = b""
        for offset, data in self.chunks:
            assert offset == start + len(out), f"chunk at {offset}, expected {start + len(out)}"
            out += data.encode()
        return start, out

    def output(self) -> str:
        history = "".join(f["data"] for f in self.frames if f.get("type") == "history")
        return history + "".join(data for _, data in self.chunks)

    def end(self) -> int:
        """The offset just past the last output received (what a reattach resumes from)."""
        ends = [o + len(d.encode()) for o, d in self.chunks]
        ends += [
            f["offset"] + len(f["data"].encode()) for f in self.frames if f.get("type") == "history"
        ]
        return max(ends, default=0)

    async def closed(self) -> tuple[int | None, list[dict[str, Any]]]:
        """Read to the close: its code, and the frames read on the way."""
        start = len(self.frames)
        async with asyncio.timeout(30):
            with contextlib.suppress(ConnectionClosed):
                while True:
                    await self.frame()
        return self.ws.close_code, self.frames[start:]


async def sign_in(
    base: str, auth: WebAuth, user: str, credential: str | None = None
) -> tuple[str, str]:
    """(cookie, CSRF token) of ``user`` signed in with a one-time link, as ``sandlot web`` does
    (``credential``: the API key the server then opens workspaces with)."""
    async with httpx.AsyncClient() as client:
        r = await client.get(auth.login_url(base, user, credential=credential))
        assert r.status_code == 303, r.text
        cookie = r.cookies["sandlot_session"]
        me = await client.get(
            f"{base}/api/auth/me", headers={"Cookie": f"sandlot_session={cookie}"}
        )
        return cookie, str(me.json()["csrf_token"])


@contextlib.asynccontextmanager
async def web_app(
    routes: Callable[[WebAuth, SessionTokens], Sequence[BaseRoute]],
    *,
    user: str = "alice",
    clock: Clock | None = None,
) -> AsyncIterator[tuple[Browser, SessionTokens]]:
    """The routes ``routes(auth, tokens)`` makes, with the sign-in routes, behind the auth
    middleware, under uvicorn; a browser signed in as ``user``."""
    auth = WebAuth(WebSettings())
    tokens = SessionTokens(SECRET, clock=clock or Clock())
    app = Starlette(
        routes=[*auth.routes(), *routes(auth, tokens)],
        middleware=[Middleware(BrowserAuthMiddleware, auth=auth)],
        exception_handlers={SandlotError: sandlot_error_handler},
    )
    async with serving(app) as base:
        cookie, csrf = await sign_in(base, auth, user)
        yield Browser(base, auth, cookie, csrf), tokens


def workspace_of(workspace: GrantWorkspace) -> Callable[[HTTPConnection], Any]:
    async def of(conn: HTTPConnection) -> GrantWorkspace:
        return workspace

    return of

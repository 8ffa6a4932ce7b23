"""Fixtures of the web suite: real servers on loopback, clocks, sign-in helpers.

Every test here runs under the suite-wide leak scan (``tests/web/leaks.py``, its
fixtures imported below): whatever a browser receives from the web app, every log line
of this process and every line a ``sandlot serve`` prints is scanned, at each test's
end, for API keys, dataplane tokens, signing keys, session cookies and CSRF tokens
where they must not be; the run's summary says how much was scanned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from sandlot.broker.keys import KeyService
from sandlot.broker.store import Store
from sandlot.protocol.errors import SandlotError
from sandlot.sdk import Grant, Sandlot
from sandlot.web.auth import BrowserAuthMiddleware, WebAuth, current_user, sandlot_error_handler
from tests.servers import SandlotServer, running
from tests.web import upstreams
from tests.web.leaks import TOTALS, leak_scan, scanned  # noqa: F401  (autouse: every test)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TOTALS.total():
        terminalreporter.write_line(f"leak scan: {TOTALS} scanned")


class Clock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[KeyService]:
    """The broker's real key service over a fresh store."""
    store = Store(f"sqlite:///{tmp_path / 'broker' / 'sandlot.db'}")
    store.migrate()
    yield KeyService(store)
    store.dispose()


async def _change(request: Request) -> Response:
    """A state-changing route of the workspace, as the file routes will be."""
    return JSONResponse({"changed_by": current_user(request).user_id})


async def _pty(websocket: WebSocket) -> None:
    """A WebSocket route of the workspace, as ``/ws/pty`` will be."""
    user = current_user(websocket).user_id
    await websocket.accept()
    await websocket.send_json({"type": "session", "user": user})
    await websocket.close()


def make_app(auth: WebAuth) -> Starlette:
    """The sign-in routes and one route of each kind behind the auth middleware."""
    return Starlette(
        routes=[
            *auth.routes(),
            Route("/api/file", _change, methods=["PUT", "POST", "DELETE", "PATCH"]),
            WebSocketRoute("/ws/pty", _pty),
        ],
        middleware=[Middleware(BrowserAuthMiddleware, auth=auth)],
        exception_handlers={SandlotError: sandlot_error_handler},
    )


@contextlib.asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[str]:
    """``app`` under uvicorn on a loopback port, access log on (its lines are scanned too)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def assert_not_leaked(
    records: Iterable[logging.LogRecord],
    bodies: Iterable[str],
    *,
    credentials: Iterable[str],
    session_values: Iterable[str] = (),
) -> None:
    """``credentials`` (API keys, signing secrets) appear in no body and no log line at any
    level; ``session_values`` (session cookie ids, CSRF tokens) in no line sandlot logs,
    nor in any line at INFO or above (a server's debug log of request headers, such as
    uvicorn's at ``--log-level debug``, shows cookies, as any server's does)."""
    formatter = logging.Formatter("%(message)s")
    records = list(records)
    bodies = list(bodies)
    every_line = [formatter.format(r) for r in records]
    served = [
        formatter.format(r)
        for r in records
        if r.levelno >= logging.INFO or r.name.startswith("sandlot")
    ]
    assert records, "nothing was logged: the scan would prove nothing"
    for value in credentials:
        assert value, "an empty value would match everything"
        assert not [b for b in bodies if value in b]
        assert not [line for line in every_line if value in line]
    for value in session_values:
        assert value
        assert not [line for line in served if value in line]


# --- the gateway's: a real dataplane, and an upstream that misbehaves -------------------


@pytest.fixture
async def misbehaving() -> AsyncIterator[upstreams.Misbehaving]:
    state = upstreams.Misbehaving()
    async with upstreams.serving(state.app()) as port:
        state.port = port
        try:
            yield state
        finally:
            state.release.set()


@pytest.fixture(scope="module")
def dataplane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SandlotServer, Grant]]:
    """A real ``sandlot serve`` and a grant to one of its sandboxes (URLs and token)."""
    with running(tmp_path_factory.mktemp("gateway") / "d") as server:
        client = Sandlot(server.url, server.key("alice"), auto_refresh=False)
        with client:
            sandbox = client.ensure("thr_gateway")
            yield server, sandbox.grant


class ThreadedServer:
    """An ASGI app under uvicorn on a loopback port, its loop in a thread (lifespan on)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True
        )

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def login_with_key(base: str, key: str, bodies: list[str]) -> tuple[httpx.Client, str, str]:
    """Signs in with an API key through ``/api/auth/login``: (client, CSRF token, cookie)."""
    client = httpx.Client(base_url=base, timeout=60)
    r = client.post("/api/auth/login", json={"api_key": key}, headers={"Origin": base})
    assert r.status_code == 200, r.text
    bodies.append(r.text)
    cookie = next(iter(client.cookies.values()))
    return client, r.json()["csrf_token"], cookie

"""The leak scan of the web suite (``tests/web/leaks.py``) can fail: a throwaway app plants
each kind of secret where it must not be, a browser (httpx, websockets) receives it, and
the scan finds it; what a browser legitimately holds passes, and every channel is counted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from sandlot.broker.keys import KeyService
from sandlot.protocol.common import PrincipalType
from sandlot.web.auth import SESSION_COOKIE, BrowserSessions
from sandlot.web.localplane import LocalSigner
from sandlot.web.session_tokens import SessionTokens
from tests.servers import SandlotServer
from tests.web.conftest import serving
from tests.web.leaks import Counts, LeakScan

#: What the throwaway app answers on each route (the tests fill it in).
PLANTED: dict[str, str] = {}


async def _body(request: Request) -> Response:
    return JSONResponse({"value": PLANTED["body"]})


async def _streamed(request: Request) -> Response:
    value = PLANTED["body"]

    async def halves() -> AsyncIterator[bytes]:
        # Split mid-secret: the scan must see the body whole, as the page does.
        yield value[:10].encode()
        await asyncio.sleep(0)
        yield value[10:].encode()

    return StreamingResponse(halves(), media_type="text/plain")


async def _header(request: Request) -> Response:
    name, _, value = PLANTED["header"].partition(":")
    return JSONResponse({}, headers={name: value.strip()})


async def _logged(request: Request) -> Response:
    logging.getLogger("sandlot.web.planted").debug("handled %s", PLANTED["log"])
    return JSONResponse({})


async def _socket(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text(PLANTED["frame"])
    await websocket.close(4000, PLANTED.get("reason", "bye"))


def app() -> Starlette:
    return Starlette(
        routes=[
            Route("/api/body", _body),
            Route("/api/streamed", _streamed),
            Route("/api/header", _header),
            Route("/api/logged", _logged),
            WebSocketRoute("/ws/planted", _socket),
        ]
    )


@pytest.fixture
def secrets(keys: KeyService) -> Iterator[dict[str, str]]:
    """One of each secret, issued through the code the scan hooks."""
    sessions = BrowserSessions(idle_seconds=60, max_seconds=60, max_sessions=10)
    cookie, session = sessions.create("ada", credential=None)
    key, _ = keys.create(user_id="ada", principal_type=PrincipalType.HUMAN)
    yield {
        "token": LocalSigner().mint("ada").token,
        "key": key,
        "cookie": cookie,
        "csrf": session.csrf_token,
        "session_id": SessionTokens(b"k" * 32).issue(
            provider="shell", exec_id="exe_1", kind="pty", user="ada", workspace="thr_1"
        ),
    }
    PLANTED.clear()


def caught(scan: LeakScan, *expected: str) -> str:
    with pytest.raises(AssertionError) as failure:
        scan.check()
    message = str(failure.value)
    for text in expected:
        assert text in message, message
    return message


async def get(base: str, path: str, **params: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.get(path, params=params)
        assert r.status_code == 200
        return r


async def test_a_credential_in_a_body_is_caught(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    kinds = {
        "token": "a credential",
        "key": "a credential",
        "cookie": "a session cookie",
        "csrf": "a CSRF token",
    }
    leak_scan.check()
    async with serving(app()) as base:
        for name, kind in kinds.items():
            PLANTED["body"] = secrets[name]
            await get(base, "/api/body")
            caught(leak_scan, kind, "in a body of /api/body")


async def test_a_secret_split_across_streamed_chunks_is_caught(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    PLANTED["body"] = secrets["cookie"]
    async with (
        serving(app()) as base,
        httpx.AsyncClient(base_url=base) as client,
        client.stream("GET", "/api/streamed") as r,
    ):
        async for _ in r.aiter_text():
            pass
    caught(leak_scan, "a session cookie", "in a body of /api/streamed")


async def test_a_secret_in_a_header_or_an_internal_header_is_caught(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    async with serving(app()) as base:
        PLANTED["header"] = f"X-Trace: {secrets['csrf']}"
        await get(base, "/api/header")
        caught(leak_scan, "a CSRF token", "in a header of /api/header")
        PLANTED["header"] = "X-Sandlot-On-Behalf-Of: ada"
        await get(base, "/api/header")
        caught(leak_scan, "an internal header", "x-sandlot-on-behalf-of")


async def test_a_token_in_a_query_string_and_the_access_log_is_caught(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    PLANTED["body"] = ""
    async with serving(app()) as base:
        await get(base, "/api/body", token=secrets["token"])
    caught(leak_scan, "in a url of /api/body", "in a log line of uvicorn.access at INFO")


async def test_a_secret_in_a_frame_or_a_close_reason_is_caught(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    PLANTED["frame"] = f'{{"type": "output", "data": "{secrets["key"]}"}}'
    PLANTED["reason"] = secrets["cookie"]
    async with (
        serving(app()) as base,
        connect(base.replace("http", "ws", 1) + "/ws/planted") as ws,
    ):
        await ws.recv()
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    caught(leak_scan, "a credential", "in a frame of /ws/planted", "a session cookie")


async def test_a_secret_in_sandlots_log_is_caught_at_any_level(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    async with serving(app()) as base:
        for name in ("session_id", "cookie", "token"):
            PLANTED["log"] = secrets[name]
            await get(base, "/api/logged")
            caught(leak_scan, "in a log line of sandlot.web.planted at DEBUG")


def test_a_secret_a_server_prints_is_caught(
    leak_scan: LeakScan, secrets: dict[str, str], tmp_path: Path
) -> None:
    server = SandlotServer(tmp_path / "d")
    leak_scan.watch(server)
    server.output.append(f"2026-01-01 00:00:00,000 INFO sandlot.web: signed in {secrets['csrf']}")
    leak_scan.check()  # a line is scanned once it is ended
    server.output.append(" (again)\nsandlot listening on http://127.0.0.1:1\n")
    caught(leak_scan, "a CSRF token", "in a server line of sandlot.web at INFO")


async def test_what_the_browser_holds_passes_where_it_holds_it(
    leak_scan: LeakScan, secrets: dict[str, str]
) -> None:
    """A session id in a frame, the query string and the access log; the CSRF token in
    the sign-in answers; the cookie in ``Set-Cookie`` and a library's debug dump."""
    leak_scan.check()
    seen = Counts()

    async def me(request: Request) -> Response:
        r = JSONResponse({"csrf_token": secrets["csrf"]})
        r.set_cookie(SESSION_COOKIE, secrets["cookie"], httponly=True)
        return r

    plain = app()
    plain.add_route("/api/auth/me", me)
    PLANTED["frame"] = f'{{"type": "session", "session_id": "{secrets["session_id"]}"}}'
    async with serving(plain) as base:
        assert (await get(base, "/api/auth/me")).json()["csrf_token"] == secrets["csrf"]
        url = base.replace("http", "ws", 1) + f"/ws/planted?session_id={secrets['session_id']}"
        async with connect(url, additional_headers={"Cookie": f"x={secrets['cookie']}"}) as ws:
            await ws.recv()
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        logging.getLogger("websockets.client").debug("> Cookie: %s", secrets["cookie"])
    seen += leak_scan.check()
    assert seen.bodies and seen.frames and seen.headers and seen.urls and seen.lines, seen

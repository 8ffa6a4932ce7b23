"""Upstreams that misbehave on purpose, for the gateway's tests.

The dataplane itself is the real one (``sandlot serve``, see ``conftest.py``). The
failure modes (a 503, a redirect, a slow answer, a body that breaks or lies about its
length) come from servers that misbehave as a third party in front of a dataplane
could: a small Starlette app under uvicorn (:class:`Misbehaving`) and a raw socket
server for what no HTTP library would send (:func:`raw_upstream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

MiB = 1 << 20
#: What the misbehaving upstream puts in every error body: it must never reach a browser.
UPSTREAM_SECRET = "SECRET-UPSTREAM-BODY"


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    """``app`` under uvicorn on a loopback port, in this event loop; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        log_config=None,
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=1,
        ws_ping_interval=None,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclass
class Misbehaving:
    """The state of the misbehaving upstream: what it received, how it answers."""

    port: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    headers: dict[str, str] = field(default_factory=dict)
    api_version: str = "1"
    version_status: int = 200
    #: Data paths answer 503 (plain text); with ``failing_version`` the version path too.
    failing: bool = False
    failing_version: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str, host: str = "upstream.test") -> str:
        return f"http://{host}:{self.port}{path}"

    def app(self) -> Starlette:
        async def version(request: Request) -> Response:
            self.hits["version"] += 1
            if self.failing_version:
                return PlainTextResponse(UPSTREAM_SECRET, 503)
            if self.version_status != 200:
                return PlainTextResponse(UPSTREAM_SECRET, self.version_status)
            return JSONResponse({"api_version": self.api_version, "server": "misbehaving/0"})

        async def echo(request: Request) -> Response:
            self.hits["echo"] += 1
            self.headers = dict(request.headers)
            body = await request.body()
            return JSONResponse(
                {"method": request.method, "body": body.decode()},
                headers={
                    "Set-Cookie": "upstream_session=1",
                    "X-Upstream-Secret": "1",
                    "Cache-Control": "no-store",
                    "ETag": '"e1"',
                },
            )

        async def status(request: Request) -> Response:
            code = int(request.path_params["code"])
            self.hits[f"status/{code}"] += 1
            headers = {}
            if "retry_after" in request.query_params:
                headers["Retry-After"] = request.query_params["retry_after"]
            return PlainTextResponse(f"{UPSTREAM_SECRET} at {request.url}", code, headers)

        async def flaky(request: Request) -> Response:
            self.hits["flaky"] += 1
            if self.failing:
                return PlainTextResponse(UPSTREAM_SECRET, 503)
            return JSONResponse({"ok": True})

        async def redirect(request: Request) -> Response:
            self.hits["redirect"] += 1
            return RedirectResponse("/up/echo", status_code=302)

        async def slow(request: Request) -> Response:
            self.hits["slow"] += 1
            await self.release.wait()
            return PlainTextResponse("late")

        async def big(request: Request) -> Response:
            return Response(b"x" * (2 * MiB), media_type="application/octet-stream")

        async def big_chunked(request: Request) -> Response:
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(32):
                    yield b"y" * (64 * 1024)

            return StreamingResponse(chunks(), media_type="application/octet-stream")

        async def envelope(request: Request) -> Response:
            return JSONResponse(
                {
                    "error": {
                        "code": "FILE_NOT_FOUND",
                        "message": "no such file: notes.txt",
                        "retryable": False,
                        "request_id": "upstream-own-id",
                        "domain": "sandlot",
                        "metadata": {
                            "path": "notes.txt",
                            "nested": {"debug": UPSTREAM_SECRET},
                            "long": UPSTREAM_SECRET * 100,
                        },
                        "debug": UPSTREAM_SECRET,
                    }
                },
                404,
            )

        async def own_503(request: Request) -> Response:
            self.hits["own-503"] += 1
            error = {
                "code": "PROVIDER_UNAVAILABLE",
                "message": "sandbox runtime busy",
                "retryable": True,
                "domain": "sandlot",
                "metadata": {},
            }
            return JSONResponse({"error": error}, 503)

        async def ws_echo(ws: WebSocket) -> None:
            await ws.accept()
            await ws.send_json({"headers": dict(ws.headers)})
            async for text in ws.iter_text():
                await ws.send_text(f"echo:{text}")

        return Starlette(
            routes=[
                Route("/up/__meta/version", version),
                Route("/up/echo", echo, methods=["GET", "POST", "PUT", "DELETE"]),
                Route("/up/status/{code:int}", status, methods=["GET", "POST", "PUT"]),
                Route("/up/flaky", flaky),
                Route("/up/redirect", redirect),
                Route("/up/slow", slow),
                Route("/up/big", big),
                Route("/up/big-chunked", big_chunked),
                Route("/up/envelope", envelope),
                Route("/up/own-503", own_503),
                WebSocketRoute("/up/ws", ws_echo),
            ]
        )


@contextlib.asynccontextmanager
async def raw_upstream() -> AsyncIterator[int]:
    """An upstream that speaks HTTP/1.1 by hand, keeping connections open between answers.

    ``…/__meta/version`` and ``…/fresh`` answer properly; ``…/short`` declares 100 bytes,
    sends 10 and closes; ``…/long`` declares 5 and sends them followed by a whole second
    answer (``POISONED``), which a client that reused the connection would take for the
    answer to its next request; ``…/drop`` starts a chunked body and closes mid-way.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                if path.endswith(b"/__meta/version"):
                    body = b'{"api_version": "1"}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
                elif path.endswith(b"/fresh"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")
                elif path.endswith(b"/short"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
                    await writer.drain()
                    return
                elif path.endswith(b"/long"):
                    second = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nPOISONED"
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + second)
                elif path.endswith(b"/drop"):
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
                    )
                    await writer.drain()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()

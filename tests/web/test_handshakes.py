"""A refused WebSocket handshake under ``sandlot serve`` logs no error.

The web app refuses a handshake (a foreign or missing ``Origin``, no session) with an
HTTP answer carrying its error envelope; uvicorn's WebSocket implementation logged
``ERROR … ASGI callable returned without completing handshake.`` after each, so anyone
could fill the server's log with errors (:mod:`sandlot.web.handshakes`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import websockets
from websockets.asyncio.client import connect

from tests.servers import SandlotServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    server = SandlotServer(tmp_path_factory.mktemp("handshakes") / "d").start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup()


async def test_a_refused_handshake_logs_no_error(server: SandlotServer) -> None:
    ws_url = server.url.replace("http://", "ws://") + "/ws/pty"
    refusals = [
        ("http://evil.example", {}, 403),
        (None, {}, 403),
        (server.url, {}, 401),
        (server.url, {"Cookie": "sandlot_session=not-a-session"}, 401),
    ]
    for origin, headers, status in refusals * 3:
        with pytest.raises(websockets.InvalidStatus) as caught:
            async with connect(ws_url, origin=origin, additional_headers=headers):
                pass
        assert caught.value.response.status_code == status
        body = json.loads(caught.value.response.body or b"")
        assert body["error"]["code"] in ("FORBIDDEN", "UNAUTHENTICATED")
    # One more, whose line the server prints after whatever the others made it print.
    with pytest.raises(websockets.InvalidStatus):
        async with connect(ws_url + "?last=1", origin="http://evil.example"):
            pass
    deadline = time.monotonic() + 20
    while '"WebSocket /ws/pty?last=1" 403' not in "".join(server.output):
        assert time.monotonic() < deadline, "the server never logged the last refusal"
        time.sleep(0.05)
    printed = "".join(server.output)
    assert printed.count('"WebSocket /ws/pty" 403') == 6, printed[-3000:]
    assert "without completing handshake" not in printed
    assert not [line for line in printed.splitlines() if " ERROR " in line], printed[-3000:]

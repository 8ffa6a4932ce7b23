"""Output streams: UTF-8 boundaries, invalid bytes, offsets, trimming and gaps."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import websockets

from sandlot.dataplane.services.streams import Cursor, OutputStream, complete_utf8, decode
from tests.dataplane.conftest import Server


def test_complete_utf8_holds_back_partial_sequences() -> None:
    euro = "€".encode()  # 3 bytes
    assert complete_utf8(b"abc") == 3
    assert complete_utf8(b"ab" + euro[:1]) == 2
    assert complete_utf8(b"ab" + euro[:2]) == 2
    assert complete_utf8(b"ab" + euro) == 5
    assert complete_utf8(b"\xff\xfe") == 2  # invalid: nothing to wait for
    assert complete_utf8(b"\x80\x80\x80\x80\x80") == 5


def test_invalid_bytes_keep_offsets_exact() -> None:
    text, replaced = decode(b"a\xffb\xc3")
    assert text == "a?b?" and replaced == 2
    assert len(text.encode()) == 4


async def _collect(stream: OutputStream, offsets: int = 0) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []

    async def send(frame: dict[str, Any]) -> None:
        frames.append(frame)

    cursor = Cursor([stream], [offsets])
    await cursor.flush(send, 4)
    cursor.close()
    return frames


def test_split_characters_and_frame_limits() -> None:
    async def run() -> None:
        s = OutputStream("stdout", 1 << 20)
        data = "h€llo wörld ✓".encode()
        for i in range(len(data)):
            s.feed(data[i : i + 1])
        s.close()
        frames = await _collect(s)
        joined = b""
        for f in frames:
            assert f["offset"] == len(joined)
            joined += f["data"].encode()
        assert joined == data

    asyncio.run(run())


def test_trimming_reports_gap_on_a_character_boundary() -> None:
    async def run() -> None:
        s = OutputStream("stdout", 16)
        s.feed(("€" * 40).encode())  # 120 bytes, trimmed to about 16
        s.close()
        frames = await _collect(s)
        assert frames[0]["type"] == "gap" and frames[0]["from"] == 0
        assert frames[0]["to"] % 3 == 0 and frames[0]["to"] == s.start
        assert "".join(f["data"] for f in frames[1:]) == "€" * ((120 - s.start) // 3)

    asyncio.run(run())


def test_binary_output_over_the_wire(server: Server) -> None:
    async def run() -> None:
        async with websockets.connect(
            server.ws_url("/exec/ws"), additional_headers=server.headers()
        ) as ws:
            cmd = "printf 'ok \\377\\376 \\342\\202'; sleep 0.1; printf '\\254 end'"
            await ws.send(json.dumps({"type": "start", "command": cmd}))
            assert json.loads(await ws.recv())["type"] == "ready"
            got, frames = 0, []
            while (f := json.loads(await ws.recv()))["type"] != "exit":
                assert f["offset"] == got
                got += len(f["data"].encode())
                frames.append(f)
            text = "".join(f["data"] for f in frames)
            # The euro sign split across two writes arrives whole; 0xff 0xfe become "??".
            assert text == "ok ?? € end"
            assert got == len(b"ok \xff\xfe \xe2\x82\xac end")
            assert sum(f.get("replaced", 0) for f in frames) == 2

    asyncio.run(run())


def test_pacing_follows_the_most_advanced_cursor() -> None:
    async def run() -> None:
        s = OutputStream("stdout", 1000, headroom=200)
        woken: list[int] = []
        ahead, behind = Cursor([s], [0]), Cursor([s], [0])
        s.feed(b"x" * 900)
        assert s.full  # 900 unsent + 200 of headroom would trim
        s.when_room(lambda: woken.append(s.end))
        frames: list[dict[str, Any]] = []

        async def send(frame: dict[str, Any]) -> None:
            frames.append(frame)

        await ahead.flush(send, 100)
        assert woken == [900] and not s.full  # the leader caught up; the other one lags
        s.feed(b"y" * 900)
        s.when_room(lambda: woken.append(-1))
        ahead.close()  # the pacer leaves: the lagging cursor now paces
        assert s.full and woken == [900]
        behind.close()  # nobody attached: never held back
        assert woken == [900, -1] and not s.full
        paced = Cursor([s], [0])
        assert s.full
        s.stop_pacing()  # the process exited
        assert not s.full
        paced.close()

    asyncio.run(run())


async def _closed_by_the_server(ws: Any) -> tuple[int, str]:
    with pytest.raises(websockets.ConnectionClosed) as info:
        while True:
            await asyncio.wait_for(ws.recv(), 20)
    assert info.value.rcvd is not None
    return info.value.rcvd.code, info.value.rcvd.reason


def test_sockets_close_when_their_token_expires_unless_refreshed(server: Server) -> None:
    # A socket outlives no token: an exec's, a shell's and an event stream opened with a
    # token near the end of its leeway are closed (4401) or ended at its expiry, whereas
    # one given a fresh token in an ``auth`` frame goes on.
    def ending() -> dict[str, str]:
        # Expired 27 s ago: valid for the 30 s leeway's last 3 s.
        t = int(time.time())
        return {"Authorization": f"Bearer {server.token(exp=t - 27, iat=t - 100, nbf=t - 100)}"}

    async def run() -> None:
        async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=ending()) as ws:
            await ws.send(json.dumps({"type": "start", "command": "sleep 8"}))
            code, reason = await _closed_by_the_server(ws)
            assert (code, "expired" in reason) == (4401, True)
        async with websockets.connect(
            server.ws_url("/shell/ws?session=expiring&profile=sh"), additional_headers=ending()
        ) as ws:
            code, reason = await _closed_by_the_server(ws)
            assert (code, "expired" in reason) == (4401, True)
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream("GET", server.url("/events"), headers=ending()) as resp,
        ):
            assert resp.status_code == 200
            async with asyncio.timeout(20):
                async for _ in resp.aiter_lines():
                    pass  # to its end
        async with websockets.connect(
            server.ws_url("/shell/ws?session=renewed&profile=sh"), additional_headers=ending()
        ) as ws:
            await ws.send(json.dumps({"type": "auth", "token": server.token()}))
            async with asyncio.timeout(20):
                while json.loads(await ws.recv())["type"] != "auth_ok":
                    pass
            await asyncio.sleep(4)  # past the first token's end
            await ws.send(json.dumps({"type": "stdin", "data": "echo RENEWED$((40+2))\n"}))
            out = ""
            async with asyncio.timeout(20):
                while "RENEWED42" not in out:
                    frame = json.loads(await ws.recv())
                    out += frame.get("data", "") if frame["type"] == "stdout" else ""

    asyncio.run(run())

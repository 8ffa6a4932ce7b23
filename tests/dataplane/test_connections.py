"""A connection that sends no request head in time is closed; nothing else is cut
(``sandlot.dataplane.http.connections``), on a real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
import websockets

from sandlot.dataplane.http.connections import (
    HEAD_SECONDS,
    guarded_http,
    head_seconds,
    raise_open_files_limit,
)
from tests.servers import free_port

DEADLINE = 0.5


async def app(scope: Any, receive: Any, send: Any) -> None:
    """``/slow`` answers after 1.5 s, ``/stream`` sends a chunk every 0.3 s for 1.5 s,
    ``/body`` answers the length of the body it read, ``/ws`` echoes; else 200 ``ok``."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": message.get("text")})
        return
    path, body = scope["path"], b"ok"
    if path == "/slow":
        await asyncio.sleep(1.5)
    if path == "/body":
        got = 0
        while True:
            message = await receive()
            got += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = str(got).encode()
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(5):
            await send({"type": "http.response.body", "body": b"%d" % i, "more_body": True})
            await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": b"."})
        return
    length = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": length})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def guarded() -> AsyncIterator[tuple[str, int]]:
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=guarded_http(DEADLINE)
    )
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    try:
        yield "127.0.0.1", port
    finally:
        srv.should_exit = True
        await task


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> float:
    """Seconds until the server closed the connection (it sent nothing before)."""
    t0 = time.monotonic()
    async with asyncio.timeout(within):
        assert await reader.read() == b""
    return time.monotonic() - t0


async def test_a_connection_that_sends_no_head_in_time_is_closed(
    guarded: tuple[str, int],
) -> None:
    host, port = guarded
    silent = [await asyncio.open_connection(host, port) for _ in range(20)]
    dripping = await asyncio.open_connection(host, port)

    async def drip() -> None:
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n":
            dripping[1].write(bytes([byte]))
            await asyncio.sleep(0.1)

    dripper = asyncio.create_task(drip())
    for reader, _ in silent:
        took = await closed_by_server(reader, 3.0)
    assert took < 3.0
    await closed_by_server(dripping[0], 3.0)
    dripper.cancel()
    # A head sent whole, then nothing: answered, then closed once idle (keep-alive or the
    # deadline, whichever ends first).
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    writer.write(b"GET / HT")  # the next head begun, never finished
    await closed_by_server(reader, 3.0)
    # A head whole, then a body that stops coming while its handler reads it.
    stalled = await asyncio.open_connection(host, port)
    stalled[1].write(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    await closed_by_server(stalled[0], 3 * 3 * DEADLINE)
    for _, w in [*silent, dripping, (reader, writer), stalled]:
        w.close()


async def test_requests_streams_bodies_and_websockets_are_never_cut(
    guarded: tuple[str, int],
) -> None:
    host, port = guarded
    url = f"http://{host}:{port}"
    async with httpx.AsyncClient(timeout=10) as client:
        # Each lasts three deadlines.
        slow, stream = await asyncio.gather(client.get(f"{url}/slow"), client.get(f"{url}/stream"))
        assert slow.text == "ok" and stream.text == "01234."

        async def trickle() -> AsyncIterator[bytes]:
            for _ in range(5):
                yield b"x" * 1000
                await asyncio.sleep(0.3)

        assert (await client.post(f"{url}/body", content=trickle())).text == "5000"
        # One connection kept alive between requests that come within the deadline.
        for _ in range(4):
            assert (await client.get(url)).text == "ok"
            await asyncio.sleep(DEADLINE / 2)
    async with websockets.connect(f"ws://{host}:{port}/ws") as ws:
        await asyncio.sleep(3 * DEADLINE)
        await ws.send("still here")
        assert await ws.recv() == "still here"
    # Two requests in one write, the first slow: the second is answered after it.
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
    first = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
    second = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")
    writer.close()


def test_the_deadline_comes_from_the_environment_when_it_is_a_number() -> None:
    assert head_seconds({}) == HEAD_SECONDS
    assert head_seconds({"SANDLOT_HEAD_TIMEOUT_SECONDS": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        assert head_seconds({"SANDLOT_HEAD_TIMEOUT_SECONDS": bad}) == HEAD_SECONDS


def test_the_soft_limit_of_open_files_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_open_files_limit() == hard  # already there
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

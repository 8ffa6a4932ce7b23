"""Streaming exec back-pressure: the leading client paces the command, over real WebSockets.

The replay buffer is 256 KiB here, so a producer flooding tens of MiB would be trimmed long
before any client could read it, were the command not held back by its fastest client.
Clients that must lag behind the server use a small receive buffer and no compression: the
kernel (tcp_rmem autotuned up to 32 MiB here) and permessage-deflate would otherwise absorb
the whole flood for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.dataplane.conftest import Server, start_server

BUFFER = 256 * 1024
#: Blocks of deterministic output: 1,000 lines of a SHA-256 hex digest and two multi-byte
#: characters (70,000 bytes, so reads and frames split characters); an optional second
#: argument makes the producer wait for a line on stdin first.
PRODUCER = """
import hashlib, sys
if len(sys.argv) > 2:
    sys.stdin.readline()
out = sys.stdout.buffer
for i in range(int(sys.argv[1])):
    out.write((hashlib.sha256(b"%d" % i).hexdigest() + "\\u00e9\\u2713\\n").encode() * 1000)
"""
BLOCK = 70_000


def _expected(blocks: int) -> bytes:
    return b"".join(
        (hashlib.sha256(b"%d" % i).hexdigest() + "é✓\n").encode() * 1000 for i in range(blocks)
    )


def _producer(blocks: int, *, wait: bool = False) -> list[str]:
    return [sys.executable, "-c", PRODUCER, str(blocks)] + (["wait"] if wait else [])


@pytest.fixture
def paced(tmp_path: Path) -> Iterator[Server]:
    yield from start_server(tmp_path, stream_buffer_bytes=BUFFER)


async def _recv(ws: Any, timeout: float = 20) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def _connect_lagging(server: Server) -> Any:
    """A client whose socket holds little, so the server really waits for it to read."""
    sk = socket.socket()
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sk.connect(("127.0.0.1", int(server.base.rsplit(":", 1)[1])))
    return await websockets.connect(
        server.ws_url("/exec/ws"),
        additional_headers=server.headers(),
        sock=sk,
        compression=None,
        max_queue=1,
    )


class Received:
    """What one client got: SHA-256 of the stdout bytes, their count, and the gaps."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.size = 0
        self.offset = 0
        self.gaps: list[dict[str, Any]] = []
        self.tail = b""

    def take(self, frame: dict[str, Any]) -> None:
        if frame["type"] == "gap":
            assert frame["from"] == self.offset, frame
            self.gaps.append(frame)
            self.offset = frame["to"]
        elif frame["type"] == "stdout":
            assert frame["offset"] == self.offset, (frame["offset"], self.offset)
            data = frame["data"].encode()
            self.sha.update(data)
            self.size += len(data)
            self.offset += len(data)
            self.tail = (self.tail + data)[-BLOCK:]
        else:
            raise AssertionError(f"unexpected frame {frame}")

    async def until_exit(self, ws: Any, *, pause_every: int = 0) -> dict[str, Any]:
        frames = 0
        while True:
            frame = await _recv(ws)
            if frame["type"] == "exit":
                return frame
            self.take(frame)
            frames += 1
            if pause_every and frames % pause_every == 0:
                await asyncio.sleep(0.002)


async def _wait_paused(http: httpx.AsyncClient, server: Server, exec_id: str) -> int:
    """The command still runs but its output stops growing: its reader is paused."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    last = -1
    while True:
        snap = (await http.get(server.url(f"/execs/{exec_id}"))).json()
        assert snap["state"] == "running", snap
        if snap["stdout_offset"] == last > 0:
            return last
        last = snap["stdout_offset"]
        assert loop.time() < deadline, "the command was never held back"
        await asyncio.sleep(0.3)


async def _wait_finished(http: httpx.AsyncClient, server: Server, exec_id: str) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        snap: dict[str, Any] = (await http.get(server.url(f"/execs/{exec_id}"))).json()
        if snap["state"] != "running":
            return snap
        assert loop.time() < deadline, "the command did not finish on its own"
        await asyncio.sleep(0.05)


def test_slower_client_gets_every_byte_of_a_fast_producer(paced: Server) -> None:
    """32 MiB written as fast as possible, read slower: no gap, exact bytes, exit code."""
    blocks = 480

    async def run() -> None:
        ws = await _connect_lagging(paced)
        try:
            await ws.send(json.dumps({"type": "start", "command": _producer(blocks)}))
            assert (await _recv(ws))["type"] == "ready"
            got = Received()
            exit_frame = await got.until_exit(ws, pause_every=4)
        finally:
            await ws.close()
        assert not got.gaps, got.gaps
        assert exit_frame["exit_code"] == 0
        expected = _expected(blocks)
        assert got.size == len(expected)
        assert got.sha.hexdigest() == hashlib.sha256(expected).hexdigest()

    asyncio.run(run())


def test_stalled_client_neither_stalls_the_reading_one_nor_the_command(paced: Server) -> None:
    """The fastest client paces; one that never reads gets a gap when it finally does."""
    blocks = 480

    async def run() -> None:
        hdr = paced.headers()
        async with websockets.connect(paced.ws_url("/exec/ws"), additional_headers=hdr) as fast:
            await fast.send(
                json.dumps(
                    {"type": "start", "command": _producer(blocks, wait=True), "command_id": "bp"}
                )
            )
            assert (await _recv(fast))["type"] == "ready"
            stalled = await _connect_lagging(paced)
            try:
                await stalled.send(json.dumps({"type": "attach", "command_id": "bp"}))
                assert (await _recv(stalled))["type"] == "ready"
                stalled.transport.pause_reading()
                await fast.send(json.dumps({"type": "stdin", "data": "go\n"}))
                got = Received()
                exit_frame = await asyncio.wait_for(got.until_exit(fast), 120)
                assert exit_frame["exit_code"] == 0 and not got.gaps
                expected = _expected(blocks)
                assert got.sha.hexdigest() == hashlib.sha256(expected).hexdigest()

                stalled.transport.resume_reading()
                late = Received()
                late_exit = await asyncio.wait_for(late.until_exit(stalled), 120)
                assert late_exit["exit_code"] == 0
                assert late.gaps, "the stalled client must be told what it lost"
                lost = sum(g["to"] - g["from"] for g in late.gaps)
                assert late.size + lost == len(expected) == late.offset
                assert late.tail == expected[-len(late.tail) :]
            finally:
                stalled.transport.abort()

    asyncio.run(run())


def test_detached_command_runs_free_and_reattach_gets_gap_then_tail(paced: Server) -> None:
    blocks = 120  # 8.4 MB: many times the buffer

    async def run() -> None:
        async with (
            httpx.AsyncClient(headers=paced.headers(), timeout=20) as http,
            websockets.connect(paced.ws_url("/exec/ws"), additional_headers=paced.headers()) as ws,
        ):
            await ws.send(json.dumps({"type": "start", "command": _producer(blocks)}))
            exec_id = (await _recv(ws))["exec_id"]
            await ws.close()  # detach at once: nobody reads, nothing holds the command
            snap = await _wait_finished(http, paced, exec_id)
            assert snap["state"] == "exited" and snap["exit_code"] == 0
            expected = _expected(blocks)
            assert snap["stdout_offset"] == len(expected)

        async with websockets.connect(
            paced.ws_url("/exec/ws"), additional_headers=paced.headers()
        ) as ws:
            await ws.send(
                json.dumps(
                    {"type": "attach", "exec_id": exec_id, "stdout_offset": 0, "stderr_offset": 0}
                )
            )
            assert (await _recv(ws))["type"] == "ready"
            got = Received()
            exit_frame = await got.until_exit(ws)
        assert exit_frame["exit_code"] == 0
        assert len(got.gaps) == 1 and got.gaps[0]["from"] == 0
        assert got.offset == len(expected)
        assert 0 < got.size <= BUFFER + 65536  # trimmed in steps of at most 64 KiB
        assert got.tail == expected[-len(got.tail) :]

    asyncio.run(run())


def test_timeout_kills_a_command_held_back_by_its_client(paced: Server) -> None:
    """A paused reader delays neither the timeout nor the exit; the client then loses nothing."""

    async def run() -> None:
        async with httpx.AsyncClient(headers=paced.headers(), timeout=20) as http:
            ws = await _connect_lagging(paced)
            try:
                await ws.send(
                    json.dumps({"type": "start", "command": "yes 0123456789", "timeout_seconds": 3})
                )
                exec_id = (await _recv(ws))["exec_id"]
                ws.transport.pause_reading()
                await _wait_paused(http, paced, exec_id)
                snap = await _wait_finished(http, paced, exec_id)
                assert snap["state"] == "killed" and snap["exit_code"] == 124, snap
                ws.transport.resume_reading()
                got = Received()
                exit_frame = await got.until_exit(ws)
            finally:
                ws.transport.abort()
        assert exit_frame["exit_code"] == 124 and exit_frame["timed_out"] is True
        # The only client paced the command: what was left in the pipe at exit was not
        # trimmed before it got there.
        assert not got.gaps and got.offset == snap["stdout_offset"] > BUFFER
        assert got.tail.split(b"\n")[-2] == b"0123456789"

    asyncio.run(run())


def test_pacing_client_leaving_lets_the_command_finish(paced: Server) -> None:
    """A cursor that closes resumes the reader it was holding back."""
    blocks = 120

    async def run() -> None:
        async with httpx.AsyncClient(headers=paced.headers(), timeout=20) as http:
            ws = await _connect_lagging(paced)
            try:
                await ws.send(json.dumps({"type": "start", "command": _producer(blocks)}))
                exec_id = (await _recv(ws))["exec_id"]
                ws.transport.pause_reading()
                held = await _wait_paused(http, paced, exec_id)
                assert held < blocks * BLOCK
            finally:
                ws.transport.abort()
            snap = await _wait_finished(http, paced, exec_id)
            assert snap["state"] == "exited" and snap["exit_code"] == 0
            assert snap["stdout_offset"] == blocks * BLOCK

    asyncio.run(run())

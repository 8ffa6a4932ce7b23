"""Connections that send nothing cannot take ``sandlot serve`` from everyone else
(``sandlot.dataplane.http.connections``): what anyone who reaches its port can do,
with no key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandlot.sdk import AsyncSandlot
from tests.servers import SandlotServer

#: More than the soft limit of open files a shell often gives (1024).
SILENT = 1100


@pytest.fixture
def room() -> Iterator[int]:
    """This process may open :data:`SILENT` sockets and more (root raises its hard limit
    where it is lower); the limits it had are put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = max(hard, 4 * SILENT) if os.geteuid() == 0 else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, room))
    try:
        yield room
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, room))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start_with_common_limit(server: SandlotServer, room: int) -> None:
    """``server`` started with the soft limit of open files a shell often gives (1024),
    and a hard one above (as systemd gives)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, room))
    try:
        server.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (room, room))


def server_fds(server: SandlotServer) -> int:
    assert server.proc is not None
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def test_connections_that_send_nothing_do_not_take_the_server(tmp_path: Path, room: int) -> None:
    server = SandlotServer(tmp_path / "data", env={"SANDLOT_HEAD_TIMEOUT_SECONDS": "1"})
    start_with_common_limit(server, room)
    try:
        # The server took its soft limit up to the hard one.
        assert server.proc is not None
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        soft, hard = next(ln for ln in limits.splitlines() if "open files" in ln).split()[3:5]
        assert soft == hard == str(room)
        before = server_fds(server)
        host, port = "127.0.0.1", server.port
        silent = [socket.create_connection((host, port)) for _ in range(SILENT)]
        for s in silent[::10]:
            s.sendall(b"GET /api/healthz HTTP/1.1\r\n")  # a head begun, never finished
        # The sign-in takes no key and reads a body: one announced, never sent.
        origin = f"http://{host}:{port}"
        for s in silent[5::10]:
            s.sendall(
                f"POST /api/auth/login HTTP/1.1\r\nHost: {host}:{port}\r\nOrigin: {origin}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
            )
        # Everyone else is answered meanwhile: a fresh connection, and a command that
        # runs longer than a head may take (its request is not cut).
        assert httpx.get(f"{server.url}/api/healthz", timeout=10).status_code == 200
        key = server.key("alice", "agent")

        async def long_command() -> str:
            client = AsyncSandlot(server.url, key, auto_refresh=False)
            try:
                sandbox = await client.ensure("thr_slow")
                return (await sandbox.run("sleep 2.5; echo done")).stdout
            finally:
                await client.aclose()

        assert asyncio.run(long_command()) == "done\n"
        # Each silent connection was closed by the server, its descriptor given back.
        deadline = time.monotonic() + 10
        for s in silent:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1) == b""
            s.close()
        assert server_fds(server) < before + 50
    finally:
        server.stop()


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_request_head_has_a_bounded_size(tmp_path: Path) -> None:
    # A header's value or a URL sent in small pieces was built by appending each to what
    # came before: an 80 MB head held the loop for seconds at a time, without a key.
    server = SandlotServer(tmp_path / "data").start()
    try:
        host, port = "127.0.0.1", server.port
        with socket.create_connection((host, port)) as sock:
            # Sent at once: a client still sending when the server closes (it reads on,
            # dropping, for 2 s) would have its answer cut by the reset.
            # A whole head, past the bound: refused, and nothing of it reaches the app (it
            # answered after the refusal, writing on a connection already ended).
            with contextlib.suppress(OSError):
                sock.sendall(
                    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (80 << 10) + b"\r\n\r\n"
                )
            answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b'"code":"INVALID_REQUEST"' in answer
        # A long URL too, and the server answers on.
        with socket.create_connection((host, port)) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(b"GET /healthz?" + b"q" * (200 << 10) + b" HTTP/1.1\r\n\r\n")
            assert _answer(sock).startswith(b"HTTP/1.1 431 ")
        # A head within the bound, its body past it in the same read, is served.
        body = b'{"pad": "' + b"p" * (20 << 10) + b'"}'
        head = (
            b"POST /v1/sandbox/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nX-Big: " + b"b" * (60 << 10) + b"\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        with socket.create_connection((host, port)) as sock:
            sock.sendall(head + body)
            answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]  # no key: refused as such
        # The rest of a body its handler never read is no head: the next request on the
        # connection is answered (it was refused as a head too large, its answer cut).
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(3):
                r = client.post("/v1/sandbox/scopes/nope/x/members/y", content=b"p" * (300 << 10))
                assert r.status_code in (400, 401, 404, 422), r.text
                assert client.get("/healthz").status_code == 200
        assert not [line for line in server.output if "Traceback" in line]
    finally:
        server.stop()
        server.cleanup()

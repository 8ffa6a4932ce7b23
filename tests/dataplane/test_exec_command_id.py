"""A command_id names one command even while that command is still being spawned: a
second ``start`` (a client resending it after a broken connection) or a second
``POST /exec`` arriving meanwhile attaches to the first instead of running it again."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets

from sandlot.runtime.base import Keep, ProcessSpec, SandboxProcess
from tests.dataplane.conftest import Server


@pytest.fixture
def slow_spawn(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # A runtime that takes a while to spawn, as the isolated one does (a round trip to
    # the sandbox's init), so that the second request arrives in the middle.
    spawn = server.runtime.spawn

    async def slow(spec: ProcessSpec, keep: Keep | None = None) -> SandboxProcess:
        await asyncio.sleep(0.3)
        return await spawn(spec, keep)

    monkeypatch.setattr(server.runtime, "spawn", slow)


async def _two_starts(server: Server) -> list[dict[str, Any]]:
    hdr = server.headers()
    frame = json.dumps(
        {"type": "start", "command": "echo run >> ws-runs; echo out", "command_id": "twice-ws"}
    )
    async with (
        websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as a,
        websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as b,
    ):
        await a.send(frame)
        await asyncio.sleep(0.05)  # the first spawn is under way
        await b.send(frame)
        ready = [json.loads(await a.recv()), json.loads(await b.recv())]
        # `ready` means spawned, not run: wait for the exit before looking at the file.
        while json.loads(await a.recv())["type"] != "exit":
            pass
        return ready


@pytest.mark.local_only("slows the in-process runtime's spawn")
def test_start_during_spawn_attaches(server: Server, slow_spawn: None) -> None:
    first, second = asyncio.run(_two_starts(server))
    assert first["type"] == second["type"] == "ready"
    assert first["exec_id"] == second["exec_id"]
    assert (server.workspace / "ws-runs").read_text() == "run\n"


async def _two_posts(server: Server) -> list[httpx.Response]:
    body = {"command": "echo run >> post-runs; echo $$", "command_id": "twice-post"}
    async with httpx.AsyncClient(headers=server.headers(), timeout=10) as client:
        first = asyncio.ensure_future(client.post(server.url("/exec"), json=body))
        await asyncio.sleep(0.05)
        second = await client.post(server.url("/exec"), json=body)
        return [await first, second]


@pytest.mark.local_only("slows the in-process runtime's spawn")
def test_exec_during_spawn_returns_the_same_result(server: Server, slow_spawn: None) -> None:
    first, second = asyncio.run(_two_posts(server))
    assert first.status_code == second.status_code == 200
    assert first.json()["exec_id"] == second.json()["exec_id"]
    assert first.json()["stdout"] == second.json()["stdout"]
    assert (server.workspace / "post-runs").read_text() == "run\n"

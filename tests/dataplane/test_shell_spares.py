"""Spare shells: once a profile has been opened, the next shell of it is already running."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.dataplane.conftest import Server, start_server


async def _recv(ws: Any, timeout: float = 10) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def _run(ws: Any, command: str, pattern: str) -> re.Match[str]:
    """Type ``command`` and read until ``pattern`` matches the output."""
    await ws.send(json.dumps({"type": "stdin", "data": command + "\n"}))
    out = ""
    while True:
        f = await _recv(ws)
        if f["type"] in ("stdout", "history"):
            out += f["data"]
            m = re.search(pattern, out)
            if m:
                return m


async def _open(server: Server, name: str, size: str = "") -> Any:
    ws = await websockets.connect(
        server.ws_url(f"/shell/ws?session={name}&profile=sh{size}"),
        additional_headers=server.headers(),
    )
    assert (await _recv(ws))["type"] == "session"
    assert (await _recv(ws))["type"] == "history"
    return ws


def _spare_pid(server: Server, timeout: float = 10) -> int:
    """The pid of the spare ``sh`` shell, once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spare = server.call(lambda: server.host.entry(server.sandbox_id).shells._spares.get("sh"))
        if spare is not None and spare.process is not None:
            return int(spare.process.pid)
        time.sleep(0.02)
    raise AssertionError("no spare shell started")


def _shell_events(server: Server) -> list[tuple[str, str]]:
    batch = server.call(lambda: server.host.entry(server.sandbox_id).events.since(0))
    out = []
    for _, etype, data in batch:
        ev = json.loads(data)
        if "shell" in ev["details"]:
            out.append((etype, ev["details"]["shell"]["name"]))
    return out


@pytest.mark.local_only("reads the in-process host's spare shells")
def test_the_next_shell_is_the_spare_renamed_and_resized(server: Server) -> None:
    async def run() -> None:
        one = await _open(server, "one")
        first = int((await _run(one, "echo P$$Q", r"P(\d+)Q"))[1])
        spare = _spare_pid(server)
        assert spare != first
        two = await _open(server, "two", "&cols=91&rows=21")
        # The second shell is the spare: its own process, at the size its client asked for.
        assert int((await _run(two, "echo P$$Q", r"P(\d+)Q"))[1]) == spare
        assert (await _run(two, "stty size", r"21 91"))[0] == "21 91"
        # Each shell is its own: what is typed in one does not reach the other.
        await _run(two, "X=two; echo V${X}W", r"VtwoW")
        assert (await _run(one, "echo V${X}W", r"V(\w*)W"))[1] == ""
        # A new spare replaces the one taken.
        third = _spare_pid(server)
        assert third not in (first, spare)
        for ws in (one, two):
            await ws.close()

    asyncio.run(run())
    listed = httpx.get(server.url("/shells"), headers=server.headers()).json()["shells"]
    assert sorted(s["name"] for s in listed) == ["one", "two"]
    # Spares are not shells anyone opened: no event until one is taken.
    assert _shell_events(server).count(("shell.created", "one")) == 1
    assert [e for e in _shell_events(server) if e[0] == "shell.created"] == [
        ("shell.created", "one"),
        ("shell.created", "two"),
    ]


@pytest.mark.local_only("reads the in-process host's spare shells")
def test_a_spare_that_exits_is_dropped_and_the_next_open_starts_its_own(
    server: Server,
) -> None:
    async def run() -> None:
        one = await _open(server, "one")
        spare = _spare_pid(server)
        os.kill(spare, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.call(lambda: server.host.entry(server.sandbox_id).shells._spares):
            assert time.monotonic() < deadline, "the dead spare was kept"
            await asyncio.sleep(0.02)
        two = await _open(server, "two")
        pid = int((await _run(two, "echo P$$Q", r"P(\d+)Q"))[1])
        assert pid != spare
        for ws in (one, two):
            await ws.close()

    asyncio.run(run())
    events = _shell_events(server)
    assert ("shell.exited", "") not in events
    assert [e for e in events if e[0] == "shell.created"] == [
        ("shell.created", "one"),
        ("shell.created", "two"),
    ]


def test_no_spare_when_disabled_and_none_left_after_close(tmp_path: Path) -> None:
    gen = start_server(tmp_path, spare_shells=False)
    server = next(gen)
    try:

        async def run() -> None:
            one = await _open(server, "one")
            await _run(one, "echo R$((1+1))S", "R2S")
            await asyncio.sleep(0.3)
            assert server.call(lambda: server.host.entry(server.sandbox_id).shells._spares) == {}
            await one.close()

        asyncio.run(run())
    finally:
        gen.close()
    gen = start_server(tmp_path / "with")
    server = next(gen)
    try:

        async def run_with() -> int:
            one = await _open(server, "one")
            await one.close()
            return _spare_pid(server)

        spare = asyncio.run(run_with())
    finally:
        gen.close()
    # Closing the sandbox ends its spare with its shells.
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{spare}") and _state(spare) != "Z":
        assert time.monotonic() < deadline, "the spare outlived its sandbox"
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"

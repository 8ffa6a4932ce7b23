"""What a container provider makes of a dataplane that answers its status reads slowly
or with nonsense (one its sandbox's commands took over, say): the read ends in time,
and the sandbox is checked as if unanswered; never an exception or a wait without end
for the caller (the reaper, a resume)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import SandboxActivity, SandboxSpec
from sandlot.providers.socketrelay import Upstream
from tests.dataplane.conftest import Keys
from tests.providers.dockerharness import make_provider


@contextlib.asynccontextmanager
async def dataplane(path: Path, answer: bytes | None) -> AsyncIterator[None]:
    """A socket answering every request with ``answer`` as a JSON body, or (``None``)
    with a head and then a byte every 0.2 s, forever."""
    handlers: set[asyncio.Task[None]] = set()

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            if answer is not None:
                head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(answer)
                writer.write(head + answer)
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n{")
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await answering(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            handlers.discard(task)

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


def upstream_at(path: Path) -> Upstream:
    return Upstream(os.open(path, os.O_PATH))


@pytest.mark.parametrize(
    "answer",
    [
        None,
        json.dumps({"last_event_sequence": None, "running_execs": []}).encode(),
        json.dumps(["not", "an", "object"]).encode(),
        json.dumps({"last_event_sequence": 3, "running_execs": 1}).encode(),
    ],
    ids=["trickle", "nulls", "list", "sound"],
)
async def test_a_status_read_ends_in_time_whatever_the_dataplane_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: bytes | None
) -> None:
    monkeypatch.setattr("sandlot.providers.inbox.STATUS_SECONDS", 1.0)
    monkeypatch.setattr("sandlot.providers.inbox.ACTIVITY_SECONDS", 1.0)
    nowhere = SimpleNamespace(url="unix:///nonexistent.sock")
    provider = make_provider(nowhere, "img", tmp_path / "data", Keys())  # type: ignore[arg-type]
    unanswered: list[str] = []

    async def checked(sandbox_id: str, box: object) -> None:
        unanswered.append(sandbox_id)

    monkeypatch.setattr(provider, "_unanswered", checked)
    sock = tmp_path / "dp.sock"
    async with dataplane(sock, answer):
        spec = SandboxSpec("sb_odd", 1, Template(name="t", image="host"))
        box = provider._new_box(spec, SandboxState.ACTIVE)
        box.upstream = upstream_at(sock)
        provider._sandboxes["sb_odd"] = box
        try:
            async with asyncio.timeout(30):
                status = await provider.status("sb_odd")
                activity = await provider.activity("sb_odd")
        finally:
            await box.upstream.close()
    assert status.state is SandboxState.ACTIVE
    if answer is not None and b'"running_execs": 1' in answer:
        assert (status.last_event_sequence, unanswered) == (3, [])
        assert activity.running_execs == 1
    else:
        assert (status.last_event_sequence, unanswered) == (0, ["sb_odd"])
        assert activity == SandboxActivity()

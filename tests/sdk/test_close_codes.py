"""The SDK reads the close code a dataplane socket ends with (PROTOCOL.md 3.3): a refused
capability or a command that does not exist fails at once with its error, instead of being
retried as a broken connection."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from sandlot.protocol.errors import ExecNotFound, Forbidden
from sandlot.sdk import AsyncSandlot, _aio
from tests.servers import SandlotServer


def thread() -> str:
    return f"thr_close_{uuid.uuid4().hex[:8]}"


async def stream_is_refused_at_once(server: SandlotServer, agent_key: str) -> None:
    """A stream asked without the ``exec`` capability fails with ``Forbidden``, not after
    the reconnection budget (5 attempts with backoff, then an INTERNAL)."""
    async with AsyncSandlot(server.url, agent_key) as client:
        sandbox = await client.ensure(thread(), capabilities=["fs_read"])
        started = time.monotonic()
        with pytest.raises(Forbidden):
            async with sandbox:
                cmd = await sandbox.stream("echo hi", timeout=30)
                await cmd.wait()
        assert time.monotonic() - started < 5


async def test_a_stream_without_exec_is_refused_at_once(server: SandlotServer, agent_key: str):
    await stream_is_refused_at_once(server, agent_key)


async def test_a_refusal_that_closes_the_socket_before_the_first_frame_fails_at_once(
    server: SandlotServer, agent_key: str, monkeypatch: pytest.MonkeyPatch
):
    # The server may close a refused socket before the client sent its start frame:
    # the send then fails with the close code, which is a refusal all the same.
    connect = _aio.ws_connect

    async def connect_then_wait(*args: Any, **kwargs: Any) -> Any:
        ws = await connect(*args, **kwargs)
        await asyncio.wait_for(ws.wait_closed(), 5)
        return ws

    monkeypatch.setattr(_aio, "ws_connect", connect_then_wait)
    await stream_is_refused_at_once(server, agent_key)


async def test_attaching_to_an_unknown_command_says_so(server: SandlotServer, agent_key: str):
    async with AsyncSandlot(server.url, agent_key) as client:
        sandbox = await client.ensure(thread())
        async with sandbox:
            with pytest.raises(ExecNotFound):
                cmd = await sandbox.attach("ex_0000000000000000", timeout=30)
                await cmd.wait()

"""Peers a provider talks to, for tests on loopback: a sandbox host's real app
(:func:`host_api`), and a server that answers a byte at a time or a fixed body
(:func:`trickling`) — what a misbehaving host or dataplane does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn

from sandlot.cli.hostagent import host_frame
from tests.broker.fakes import FakeProvider
from tests.servers import free_port


@contextlib.asynccontextmanager
async def host_api(secret: str) -> AsyncIterator[str]:
    """A sandbox host's provider API (``sandlot host``'s app, over a provider of its
    own) on loopback: its URL."""

    async def readiness() -> tuple[bool, dict[str, Any]]:
        return True, {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield

    port = free_port()
    app = host_frame(FakeProvider(), secret, readiness, lifespan)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def trickling(answer: bytes | None = None, *, uds: Path | None = None) -> AsyncIterator[str]:
    """A server answering every request with ``answer`` as its body, or (``None``) with a
    head and then a byte every 0.2 s, forever; on ``uds`` or on a loopback port. Its
    address (the socket's path, or ``http://127.0.0.1:PORT``)."""
    handlers: set[asyncio.Task[Any]] = set()

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            if answer is not None:
                head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(answer)
                writer.write(head + answer)
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n{")
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

    if uds is not None:
        server = await asyncio.start_unix_server(serve, path=str(uds))
        where = str(uds)
    else:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        where = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield where
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()

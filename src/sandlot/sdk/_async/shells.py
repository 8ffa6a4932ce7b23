"""Shared shells over ``WS /shell/ws`` (PROTOCOL.md 3.4)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sandlot.protocol.errors import (
    CapabilityDenied,
    ResourceNotFound,
    SandlotError,
    SocketClosed,
    Unauthenticated,
    error_from_wire,
)
from sandlot.sdk import _aio
from sandlot.sdk._async._http import KEEPALIVE, open_timeout
from sandlot.sdk.transport import Deadline
from sandlot.sdk.types import OutputChunk


class AsyncShell:
    """One client of a named, persistent shell: a driver types, an observer watches.

    Every client of the shell sees the same bytes. ``history`` holds the recent
    output sent on attach; :meth:`read` returns what follows, chunk by chunk.
    """

    def __init__(self, ws: Any, *, name: str, role: str) -> None:
        self._ws = ws
        self.name = name
        self.role = role
        self.session_id: str | None = None
        self.history = ""
        self.offset = 0
        self.exit_code: int | None = None
        self.exited = False

    @classmethod
    async def connect(
        cls,
        url: str,
        auth: Callable[[], dict[str, str]],
        *,
        name: str,
        role: str,
        timeout: float | None,
        keepalive: float | None = KEEPALIVE,
    ) -> AsyncShell:
        """Attach to (or create) the shell at ``url`` and read its greeting."""
        deadline = Deadline(timeout)
        ws = await _aio.ws_connect(url, auth(), open_timeout(deadline, keepalive), keepalive)
        shell = cls(ws, name=name, role=role)
        try:
            while shell.session_id is None or not shell._greeted:
                frame = json.loads(await _aio.ws_recv(ws, deadline.remaining()))
                shell._handle(frame)
        except SocketClosed:
            code = _aio.ws_close_code(ws)
            await _aio.ws_close(ws)
            raise _close_error(code) from None
        return shell

    _greeted = False

    def _handle(self, frame: dict[str, Any]) -> OutputChunk | None:
        kind = frame.get("type")
        if kind == "session":
            self.session_id = frame.get("session_id")
            self.name = frame.get("name", self.name)
        elif kind == "history":
            self.history = frame.get("data", "")
            self.offset = int(frame.get("offset", 0)) + len(self.history.encode("utf-8"))
            self._greeted = True
        elif kind == "stdout":
            data = frame["data"]
            offset = int(frame["offset"])
            raw = data.encode("utf-8")
            if offset + len(raw) <= self.offset:
                return None
            if offset < self.offset:
                data = raw[self.offset - offset :].decode("utf-8", errors="replace")
                offset = self.offset
            self.offset = offset + len(data.encode("utf-8"))
            self._greeted = True
            return OutputChunk("stdout", data, offset)
        elif kind == "gap":
            start, end = int(frame["from"]), int(frame["to"])
            self.offset = max(self.offset, end)
            return OutputChunk("stdout", "", start, lost=end - start)
        elif kind == "exit":
            self.exit_code = frame.get("exit_code")
            self.exited = True
        elif kind == "error":
            raise error_from_wire({"error": frame}, 400)
        return None

    async def send(self, data: str) -> None:
        """Type ``data`` into the shell (drivers only)."""
        await _aio.ws_send(self._ws, json.dumps({"type": "stdin", "data": data}))

    async def resize(self, cols: int, rows: int) -> None:
        """Resize the shell's terminal."""
        await _aio.ws_send(self._ws, json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def read(self, timeout: float | None = None) -> OutputChunk | None:
        """The next output chunk; ``None`` once the shell exited (``TimeoutError`` if none came)."""
        deadline = Deadline(timeout)
        while not self.exited:
            try:
                raw = await _aio.ws_recv(self._ws, deadline.remaining())
            except SocketClosed:
                self.exited = True
                code = _aio.ws_close_code(self._ws)
                if code is not None and code >= 4000:
                    raise _close_error(code) from None
                return None
            chunk = self._handle(json.loads(raw))
            if chunk is not None:
                return chunk
        return None

    async def read_until(self, text: str, timeout: float | None = 10.0) -> str:
        """Read until the output (since this call) contains ``text``; return that output."""
        deadline = Deadline(timeout)
        seen = ""
        while text not in seen:
            chunk = await self.read(deadline.remaining())
            if chunk is None:
                raise SandlotError(f"shell exited before {text!r} appeared")
            seen += chunk.data
        return seen

    def __aiter__(self) -> AsyncShell:
        return self

    async def __anext__(self) -> OutputChunk:
        chunk = await self.read()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        """Leave the shell (it keeps running for the other clients and later ones)."""
        await _aio.ws_close(self._ws)

    async def __aenter__(self) -> AsyncShell:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _close_error(code: int | None) -> SandlotError:
    if code == 4401:
        return Unauthenticated("shell socket closed: credential refused")
    if code == 4403:
        return CapabilityDenied("shell socket closed: capability denied")
    if code == 4404:
        return ResourceNotFound("no such shell")
    return SandlotError(f"shell socket closed ({code})")

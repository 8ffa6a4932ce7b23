"""Streaming commands over ``WS /exec/ws`` with automatic reattach (PROTOCOL.md 3.2).

A command is started once, with a client-chosen ``command_id``. When the
connection breaks, the client reconnects and sends ``attach {exec_id,
stdout_offset, stderr_offset}`` (or, if the server had not yet acknowledged the
start, ``start`` again with the same ``command_id``, which attaches to the
command already running): a command is never run twice, and chunks are
trimmed by offset so no byte is lost or repeated. The reconnection budget is
reset whenever the server acknowledges (``ready``). A connection that went
silent (a blackholed network: no reset, no close) is noticed by keepalive
pings, and a connection attempt is bounded, so neither can hang a command.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from sandlot.protocol.errors import (
    CommandExitError,
    ExecNotFound,
    Forbidden,
    SandlotError,
    SocketClosed,
    Unauthenticated,
    error_from_wire,
)
from sandlot.sdk import _aio
from sandlot.sdk._async._http import KEEPALIVE, open_timeout
from sandlot.sdk.transport import Deadline, RetryBudget
from sandlot.sdk.types import CommandResult, OutputChunk

#: Consecutive reconnections without an acknowledgement before giving up...
RECONNECT_ATTEMPTS = 5
#: ...and, once the command was acknowledged, seconds they must also span.
RECONNECT_WINDOW = 30.0


class AsyncCommand:
    """A running (or finished) command whose output is read as it is produced.

    Iterate it (``async for chunk in cmd``) for :class:`~sandlot.sdk.types.OutputChunk`
    objects, or call :meth:`wait` for the whole :class:`~sandlot.sdk.types.CommandResult`.
    ``reconnects`` counts the connections that broke and were resumed. ``keepalive``:
    seconds between pings; one unanswered for as long again counts as a broken
    connection (``None``: no pings).
    """

    def __init__(
        self,
        ws_url: str,
        auth: Callable[[], dict[str, str]],
        *,
        start: dict[str, Any] | None = None,
        exec_id: str | None = None,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        renew: Callable[[], Awaitable[bool]] | None = None,
        timeout: float | None = None,
        keepalive: float | None = KEEPALIVE,
    ) -> None:
        self._url = ws_url
        self._keepalive = keepalive
        self._auth = auth
        self._start = start
        self._renew = renew
        self._deadline = Deadline(timeout)
        self.exec_id = exec_id
        self.command_id: str | None = (start or {}).get("command_id")
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.timed_out = False
        #: The kernel's OOM killer ended the command (the sandbox's memory limit).
        self.oom_killed = False
        self.done = False
        self.reconnects = 0
        self.offsets = {"stdout": stdout_offset, "stderr": stderr_offset}
        self._text: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._ws: Any = None
        self._budget = RetryBudget(RECONNECT_ATTEMPTS, RECONNECT_WINDOW)

    async def connect(self) -> AsyncCommand:
        """Open the command's socket: start it, or attach to it (what
        :meth:`AsyncSandbox.stream` and :meth:`AsyncSandbox.attach` do before returning it).
        Reconnections after that are the command's own."""
        await self._connect()
        return self

    async def _open(self, timeout: float) -> None:
        self._ws = await _aio.ws_connect(self._url, self._auth(), timeout, self._keepalive)
        if self.exec_id is not None:
            frame: dict[str, Any] = {
                "type": "attach",
                "exec_id": self.exec_id,
                "stdout_offset": self.offsets["stdout"],
                "stderr_offset": self.offsets["stderr"],
            }
        else:
            assert self._start is not None
            frame = {"type": "start", **self._start}
        await _aio.ws_send(self._ws, json.dumps(frame))

    async def _connect(self) -> None:
        """Open (or reopen) the socket, within the reconnection budget."""
        while True:
            # TimeoutError once the deadline passed
            timeout = open_timeout(self._deadline, self._keepalive)
            try:
                await self._open(timeout)
                return
            except OSError as exc:  # SocketClosed included
                # A refusal can close the socket before the first frame is sent.
                if isinstance(exc, SocketClosed) and await self._refused(exc.close_code):
                    continue
                if not self._budget.fail():
                    raise SandlotError(f"exec socket: cannot reconnect ({exc})") from exc
                await _aio.sleep(self._budget.backoff())

    async def _broken(self) -> None:
        """The socket closed before ``exit``: decide between reattaching and failing."""
        code = _aio.ws_close_code(self._ws)
        await _aio.ws_close(self._ws)
        self._ws = None
        if await self._refused(code):
            await self._connect()
            return
        self.reconnects += 1
        if not self._budget.fail():
            raise SandlotError("exec socket: too many broken connections")
        await _aio.sleep(self._budget.backoff() / 2)
        await self._connect()

    async def _refused(self, code: int | None) -> bool:
        """Raise the typed error of a close code no reconnection mends; ``True``
        once a refused credential was renewed (connect again), ``False`` for
        any other code (a broken connection: reattach within the budget)."""
        if code == 4401:
            if self._renew is not None and self._budget.failures == 0 and await self._renew():
                self._budget.fail()
                return True
            raise Unauthenticated("exec socket closed: credential refused")
        if code == 4403:
            raise Forbidden("exec socket closed: capability denied")
        if code == 4404:
            raise ExecNotFound(f"exec {self.exec_id} not found")
        return False

    def __aiter__(self) -> AsyncCommand:
        return self

    async def __anext__(self) -> OutputChunk:
        chunk = await self.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def next_chunk(self) -> OutputChunk | None:
        """The next output chunk, or ``None`` once the command exited."""
        while not self.done:
            if self._ws is None:
                await self._connect()
            try:
                raw = await _aio.ws_recv(self._ws, self._deadline.remaining())
            except TimeoutError:
                raise  # the deadline of this command, not a broken connection
            except OSError:  # SocketClosed included
                await self._broken()
                continue
            chunk = self._handle(json.loads(raw))
            if chunk is not None:
                return chunk
        await self.aclose()  # exited: the socket is not needed any more
        return None

    def _handle(self, frame: dict[str, Any]) -> OutputChunk | None:
        kind = frame.get("type")
        if kind == "ready":
            self.exec_id = frame.get("exec_id") or self.exec_id
            self.command_id = frame.get("command_id") or self.command_id
            self.pid = frame.get("pid")
            self._budget.acknowledge()
        elif kind in ("stdout", "stderr"):
            return self._take(kind, frame["data"], int(frame["offset"]))
        elif kind == "gap":
            stream, start, end = frame["stream"], int(frame["from"]), int(frame["to"])
            if end > self.offsets[stream]:
                start = max(start, self.offsets[stream])
                self.offsets[stream] = end
                return OutputChunk(stream, "", start, lost=end - start)
        elif kind == "exit":
            self.exit_code = frame.get("exit_code")
            self.timed_out = bool(frame.get("timed_out"))
            self.oom_killed = bool(frame.get("oom_killed"))
            self.done = True
        elif kind == "error":
            raise error_from_wire({"error": frame}, 400)
        return None

    def _take(self, stream: str, data: str, offset: int) -> OutputChunk | None:
        expected = self.offsets[stream]
        raw = data.encode("utf-8")
        if offset + len(raw) <= expected:
            return None  # replayed bytes already delivered
        if offset < expected:
            raw = raw[expected - offset :]
            data = raw.decode("utf-8", errors="replace")
            offset = expected
        self.offsets[stream] = offset + len(raw)
        self._text[stream].append(data)
        return OutputChunk(stream, data, offset)

    async def send_stdin(self, data: str) -> None:
        """Write ``data`` to the command's standard input."""
        await self._send({"type": "stdin", "data": data})

    async def close_stdin(self) -> None:
        """Close the command's standard input (EOF)."""
        await self._send({"type": "close_stdin"})

    async def signal(self, signal: str = "SIGINT") -> None:
        """Send a signal (``"SIGINT"``, ``"SIGTERM"``, ``"SIGKILL"``, …) to the command."""
        await self._send({"type": "signal", "signal": signal})

    async def resize(self, cols: int, rows: int) -> None:
        """Resize the command's terminal (for commands started with ``pty=True``)."""
        await self._send({"type": "resize", "cols": cols, "rows": rows})

    async def _send(self, frame: dict[str, Any]) -> None:
        if self._ws is None:
            await self._connect()
        try:
            await _aio.ws_send(self._ws, json.dumps(frame))
        except SocketClosed:
            await self._broken()
            await _aio.ws_send(self._ws, json.dumps(frame))

    async def wait(self, *, check: bool = False) -> CommandResult:
        """Read to the end and return the result (``check``: raise on a non-zero exit)."""
        try:
            while await self.next_chunk() is not None:
                pass
        finally:
            await self.aclose()  # also on a deadline: waiting again reattaches
        result = CommandResult(
            exit_code=self.exit_code,
            stdout="".join(self._text["stdout"]),
            stderr="".join(self._text["stderr"]),
            exec_id=self.exec_id,
            command_id=self.command_id,
            timed_out=self.timed_out,
            oom_killed=self.oom_killed,
        )
        if check and result.exit_code != 0:
            raise CommandExitError(result)
        return result

    async def aclose(self) -> None:
        """Detach: close the socket; the command keeps running unless it was told otherwise."""
        if self._ws is not None:
            await _aio.ws_close(self._ws)
            self._ws = None

    async def __aenter__(self) -> AsyncCommand:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

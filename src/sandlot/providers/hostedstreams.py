"""The relay's streams: ``/exec/ws``, ``/shell/ws`` and ``/events`` over a hosted box.

``/exec/ws`` is bridged to the box's ``/execute/ws``: ``start`` becomes ``execute``
(the relay gives every command a ``command_id``), ``attach`` becomes ``reconnect``
with the client's offsets, so a client that reattaches gets every byte after what
it saw, from the box's own buffers; ``ready`` is sent once the box says
``started``. If the box's socket drops without an ``exit`` (its server reloading:
close code 1001), the relay reconnects with the offsets it has passed on, and the
client sees no break. ``stdin`` → ``input``, ``signal`` SIGKILL → ``kill`` (other
signals: ``kill -s`` of the command's process group, over ``/execute``); ``resize``
is answered with a ``NOT_SUPPORTED`` error frame (the box's frames have none).

A shell (``/shell/ws?session=NAME``) is one PTY command of the template's shell
profile on the box, kept by the relay with its recent output, and shared by every
client that attaches to that name: drivers type, observers watch. Each client reads
that recent output through its own cursor, so a client that reads slower than the
shell writes holds no memory of its own: when the output it had not read yet is no
longer kept, it gets a ``gap`` frame saying which bytes it lost, then what is kept
(PROTOCOL.md 3.4); an ``attach {offset}`` frame moves its cursor.

``POST /exec`` with ``stdin`` keeps at most :data:`MAX_OUTPUT_BYTES` of each stream
(``truncated`` beyond), as the box's own ``/execute`` does; the rest of the output is
read and dropped, so the command still runs to its end.

The event log is the relay's (:class:`~sandlot.dataplane.services.events.EventLog`):
what passed through it, in order. ``WS /events/ws`` is not offered (501 over HTTP,
close 1008 with an error frame on a WebSocket); ``GET /events`` is.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import shlex
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from sandlot.dataplane.http.web import endpoint, json_response
from sandlot.dataplane.http.websockets import close_code_for, receive_frame
from sandlot.dataplane.services.auth import AuthContext, bearer_from_header
from sandlot.dataplane.services.events import expired_event
from sandlot.protocol import frames as F
from sandlot.protocol.common import Capability, new_id, rfc3339
from sandlot.protocol.dataplane import ExecRequest
from sandlot.protocol.errors import (
    CapabilityDenied,
    ExecNotFound,
    InvalidRequest,
    NotSupported,
    ProviderUnavailable,
    ResourceNotFound,
    SandlotError,
    SequenceExpired,
    Unauthenticated,
)
from sandlot.providers.hostedbox import Box
from sandlot.providers.hostedstate import (
    Hosted,
    RelayCore,
    RelayExec,
    Tracked,
    authorize,
    command_text,
)

#: Reconnections to the box's socket one stream tries before giving up.
RECONNECTS = 5
#: Output a shell keeps for clients that attach later (and for clients that lag).
SHELL_HISTORY_BYTES = 256 << 10
#: Output of a one-shot command kept per stream (PROTOCOL.md 3.1's default).
MAX_OUTPUT_BYTES = 10 << 20
#: At most this much of a shell's output goes in one frame to a client.
SHELL_FRAME_BYTES = 64 << 10


def kept_output(text: str, limit: int = MAX_OUTPUT_BYTES) -> tuple[str, bool]:
    """``text`` cut to ``limit`` UTF-8 bytes, and whether it was cut. A text that fills
    the limit to within one character was cut by the box (which keeps as much, and says
    nothing about it)."""
    if len(text) * 4 <= limit - 4:  # short enough whatever its characters
        return text, False
    data = text.encode()
    if len(data) <= limit - 4:
        return text, False
    if len(data) <= limit:
        return text, True
    return data[:limit].decode("utf-8", "ignore"), True


def _relay(ws: Any) -> RelayCore:
    relay: RelayCore = ws.app.state.relay
    return relay


async def _send(ws: WebSocket, frame: dict[str, Any]) -> None:
    await ws.send_text(json.dumps(frame, separators=(",", ":")))


async def _fail(ws: WebSocket, exc: SandlotError) -> None:
    with contextlib.suppress(Exception):
        await _send(ws, F.error_frame(exc.wire_code, exc.message, exc.retryable))
        await ws.close(close_code_for(exc), exc.message[:120])


async def _open(ws: WebSocket, capability: Capability) -> tuple[Hosted, AuthContext, Box] | None:
    """Accept, authenticate (header, or a first ``auth`` frame), find the box."""
    relay = _relay(ws)
    await ws.accept()
    try:
        hosted = relay.lookup(ws.path_params["sandbox_id"])
        bearer = bearer_from_header(ws.headers.get("authorization")) or ws.headers.get("x-api-key")
        if bearer is None:
            try:
                raw = await asyncio.wait_for(receive_frame(ws), 10.0)
                frame = F.parse_client_frame(raw)
            except (TimeoutError, ValidationError, ValueError):
                raise Unauthenticated("first frame must be auth") from None
            if not isinstance(frame, F.AuthFrame):
                raise Unauthenticated("first frame must be auth")
            ctx = await relay.authenticate(hosted, frame.token, capability)
            await _send(ws, F.AUTH_OK)
        else:
            ctx = await relay.authenticate(hosted, bearer, capability)
        return hosted, ctx, hosted.ready()
    except WebSocketDisconnect:
        return None
    except SandlotError as exc:
        await _fail(ws, exc)
        return None


def _frame_error(frame: dict[str, Any]) -> SandlotError:
    kind = str(frame.get("error_type") or frame.get("code") or "")
    message = str(frame.get("error") or frame.get("message") or "the box refused")[:300]
    if kind in ("CommandNotFound", "NOT_FOUND", "EXEC_NOT_FOUND"):
        return ExecNotFound(message)
    if kind in ("INVALID_REQUEST", "InvalidRequest"):
        return InvalidRequest(message)
    return ProviderUnavailable(message)


class _Upstream:
    """The box's ``/execute/ws`` for one command, reconnected after a drop."""

    def __init__(self, box: Box, ex: RelayExec) -> None:
        self.box = box
        self.ex = ex
        self.conn: ClientConnection | None = None
        #: Where the next byte of stdout and stderr is, as passed on.
        self.offsets = [0, 0]

    async def start(self, body: dict[str, Any]) -> dict[str, Any]:
        self.conn = await self.box.execute_ws()
        await self.conn.send(json.dumps({"type": "execute", **body}))
        return await self._started()

    async def reconnect(self) -> dict[str, Any]:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
        self.conn = await self.box.execute_ws()
        frame = {
            "type": "reconnect",
            "command_id": self.ex.command_id,
            "stdout_offset": self.offsets[0],
            "stderr_offset": self.offsets[1],
        }
        await self.conn.send(json.dumps(frame))
        return await self._started()

    async def _started(self) -> dict[str, Any]:
        assert self.conn is not None
        while True:
            frame = json.loads(await self.conn.recv())
            if frame.get("type") == "started":
                if frame.get("pid") is not None:
                    self.ex.pid = int(frame["pid"])
                return dict(frame)
            if frame.get("type") == "error":
                raise _frame_error(frame)

    async def send(self, frame: dict[str, Any]) -> None:
        assert self.conn is not None
        await self.conn.send(json.dumps(frame))

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        """Frames of the command until its ``exit`` (reconnecting after a drop)."""
        drops = 0
        while True:
            assert self.conn is not None
            try:
                raw = await self.conn.recv()
            except ConnectionClosed:
                drops += 1
                if drops > RECONNECTS:
                    raise ProviderUnavailable("the hosted box's stream was lost") from None
                await asyncio.sleep(0.05 * drops)
                await self.reconnect()
                continue
            frame = json.loads(raw)
            kind = frame.get("type")
            if kind in ("stdout", "stderr"):
                i = 0 if kind == "stdout" else 1
                data = str(frame.get("data", ""))
                offset = int(frame.get("offset", self.offsets[i]))
                end = offset + len(data.encode())
                if end <= self.offsets[i]:
                    continue  # already passed on (a reconnect replays from our offset)
                self.offsets[i] = end
                if i == 0:
                    self.ex.stdout_offset = max(self.ex.stdout_offset, end)
                else:
                    self.ex.stderr_offset = max(self.ex.stderr_offset, end)
            yield frame
            if kind == "exit":
                return

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()


def _execute_body(frame: Any, ex: RelayExec, box: Box) -> dict[str, Any]:
    body: dict[str, Any] = {
        "command": command_text(frame.command),
        "shell": frame.shell,
        "env": dict(frame.env),
        "command_id": ex.command_id,
        "pty": bool(getattr(frame, "pty", False)),
        "kill_on_disconnect": bool(getattr(frame, "kill_on_disconnect", False)),
    }
    if frame.cwd:
        body["cwd"] = box.resolve(frame.cwd)
    if frame.timeout_seconds:
        body["timeout_seconds"] = frame.timeout_seconds
    return body


async def run_with_stdin(box: Box, req: ExecRequest, ex: RelayExec) -> dict[str, Any]:
    """``POST /exec`` with ``stdin``: the command on ``/execute/ws``, fed and collected
    (up to :data:`MAX_OUTPUT_BYTES` per stream)."""
    up = _Upstream(box, ex)
    out: list[list[str]] = [[], []]
    room = [MAX_OUTPUT_BYTES, MAX_OUTPUT_BYTES]
    truncated = False
    try:
        await up.start(_execute_body(req, ex, box) | {"pty": False})
        if req.stdin:
            await up.send({"type": "input", "data": req.stdin})
        await up.send({"type": "close_stdin"})
        async for frame in up.frames():
            if frame["type"] in ("stdout", "stderr"):
                i = 0 if frame["type"] == "stdout" else 1
                data = str(frame["data"])
                size = len(data.encode())
                if size > room[i]:
                    data = data.encode()[: room[i]].decode("utf-8", "ignore")
                    size = room[i]
                    truncated = True
                if data:
                    out[i].append(data)
                    room[i] -= size
            elif frame["type"] == "exit":
                return {
                    "stdout": "".join(out[0]),
                    "stderr": "".join(out[1]),
                    "exit_code": frame.get("exit_code"),
                    "timed_out": bool(frame.get("timed_out", False)),
                    "truncated": truncated,
                }
            elif frame["type"] == "error":
                if frame.get("code") == "CONFLICT":
                    # The command closed its stdin (or ended) before reading all of its
                    # input: the rest is left unread, as a pipe's writer leaves it.
                    continue
                raise _frame_error(frame)
    finally:
        await up.close()
    raise ProviderUnavailable("the hosted box ended the command without an exit")


# --- /exec/ws -------------------------------------------------------------------------------


async def exec_ws(ws: WebSocket) -> None:
    opened = await _open(ws, Capability.EXEC)
    if opened is None:
        return
    hosted, ctx, box = opened
    relay = _relay(ws)
    closed = asyncio.Event()

    async def close_socket(reason: str) -> None:
        closed.set()
        await _fail(ws, Unauthenticated(reason))

    tracked = relay.track(ctx, close_socket)
    hosted.clients += 1
    up: _Upstream | None = None
    attached: RelayExec | None = None
    try:
        first: Any = None
        while first is None:
            frame = F.parse_client_frame(await receive_frame(ws))
            if isinstance(frame, F.PingFrame):
                await _send(ws, F.PONG)
            elif isinstance(frame, F.AuthFrame):
                ctx = await relay.authenticate(hosted, frame.token, Capability.EXEC)
                tracked.switch(ctx)
                await _send(ws, F.AUTH_OK)
            elif isinstance(frame, (F.StartFrame, F.AttachFrame)):
                first = frame
            elif isinstance(frame, F.CloseFrame):
                await ws.close(1000)
                return
            else:
                raise InvalidRequest("start or attach first")
        known = (
            hosted.by_command.get(first.command_id)
            if isinstance(first, F.StartFrame) and first.command_id
            else None
        )
        if isinstance(first, F.StartFrame) and known is None:
            ex = hosted.new_exec(first.command, first.command_id, ctx.actor, first.pty)
            ex.kill_on_disconnect = first.kill_on_disconnect
            up = _Upstream(box, ex)
            try:
                await up.start(_execute_body(first, ex, box))
            except BaseException:
                hosted.ended(ex, None, state="failed")
                raise
            if first.stdin is not None:
                await up.send({"type": "input", "data": first.stdin})
        else:
            if isinstance(first, F.AttachFrame):
                ex = hosted.find_exec(first.exec_id or first.command_id or "")
                offsets = [first.stdout_offset, first.stderr_offset]
            else:
                ex = hosted.execs[known or ""]
                offsets = [0, 0]
            up = _Upstream(box, ex)
            up.offsets = offsets
            await up.reconnect()
        ex.clients += 1
        attached = ex
        await _send(
            ws, {"type": "ready", "exec_id": ex.exec_id, "command_id": ex.command_id, "pid": ex.pid}
        )
        await _bridge(ws, hosted, box, ex, up, closed, tracked)
    except (WebSocketDisconnect, RuntimeError):
        pass
    except (ValidationError, ValueError) as exc:
        await _fail(ws, InvalidRequest(f"invalid frame: {str(exc).splitlines()[0][:160]}"))
    except SandlotError as exc:
        await _fail(ws, exc)
    finally:
        hosted.clients -= 1
        tracked.end()
        if attached is not None:
            attached.clients -= 1
        if up is not None:
            await up.close()
            # Killed by the box as its last client left: followed to its end, so its
            # snapshot says so. (Others are left alone: reading a detached command's
            # output would lift the box's backpressure on it; their state is brought up
            # to date when a client attaches again.)
            ex = up.ex
            if ex.state == "running" and ex.clients == 0 and ex.kill_on_disconnect:
                hosted.watch(ex, _watch(box, hosted, ex))


async def _watch(box: Box, hosted: Hosted, ex: RelayExec) -> None:
    """Follow a command no client watches until it exits, so its snapshot and the event
    log say how it ended."""
    up = _Upstream(box, ex)
    up.offsets = [ex.stdout_offset, ex.stderr_offset]
    try:
        await up.reconnect()
        async for frame in up.frames():
            if frame.get("type") == "exit":
                code = frame.get("exit_code")
                killed = ex.kill_on_disconnect and ex.clients == 0
                hosted.ended(
                    ex,
                    code if isinstance(code, int) else None,
                    state="killed" if killed else "exited",
                )
    except (SandlotError, ConnectionClosed, OSError):
        pass
    finally:
        await up.close()


async def _bridge(
    ws: WebSocket,
    hosted: Hosted,
    box: Box,
    ex: RelayExec,
    up: _Upstream,
    closed: asyncio.Event,
    tracked: Tracked,
) -> None:
    async def downstream() -> None:
        async for frame in up.frames():
            kind = frame.get("type")
            if kind in ("stdout", "stderr"):
                await _send(ws, {"type": kind, "data": frame["data"], "offset": frame["offset"]})
            elif kind == "exit":
                code = frame.get("exit_code")
                hosted.ended(ex, code if isinstance(code, int) else None)
                await _send(
                    ws,
                    {
                        "type": "exit",
                        "exec_id": ex.exec_id,
                        "exit_code": code,
                        "signal": None,
                        "timed_out": bool(frame.get("timed_out", False)),
                        "oom_killed": False,
                    },
                )
            elif kind == "error":
                err = _frame_error(frame)
                await _send(ws, F.error_frame(err.wire_code, err.message, err.retryable))

    async def upstream() -> None:
        while True:
            try:
                frame = F.parse_client_frame(await receive_frame(ws))
            except ValidationError:
                await _send(ws, F.error_frame("INVALID_REQUEST", "invalid frame"))
                continue
            if isinstance(frame, F.StdinFrame):
                await up.send({"type": "input", "data": frame.data})
            elif isinstance(frame, F.CloseStdinFrame):
                await up.send({"type": "close_stdin"})
            elif isinstance(frame, F.KillFrame):
                await up.send({"type": "kill"})
            elif isinstance(frame, F.SignalFrame):
                name = frame.signal.upper().removeprefix("SIG")
                if name in ("KILL", "9"):
                    await up.send({"type": "kill"})
                elif ex.pid is not None and name.isalnum():
                    await box.run(
                        f"kill -s {name} -- -{ex.pid} 2>/dev/null || kill -s {name} {ex.pid}"
                    )
            elif isinstance(frame, F.PingFrame):
                await _send(ws, F.PONG)
            elif isinstance(frame, F.AuthFrame):
                tracked.switch(await _relay(ws).authenticate(hosted, frame.token, Capability.EXEC))
                await _send(ws, F.AUTH_OK)
            elif isinstance(frame, F.CloseFrame):
                return
            else:
                err = NotSupported("this frame is not available for a sandbox on a hosted service")
                await _send(ws, F.error_frame(err.wire_code, err.message))

    await _until_first(downstream(), upstream(), closed.wait())
    with contextlib.suppress(Exception):
        await ws.close(1000)


async def _until_first(*coros: Any) -> None:
    """Run until one ends; its error (other than the client leaving) is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            exc = t.exception()
            if exc is not None and not isinstance(exc, (WebSocketDisconnect, ConnectionClosed)):
                raise exc
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


# --- shells -----------------------------------------------------------------------------------


class RelayShell:
    """A named PTY shell on the box, shared by the relay's clients."""

    def __init__(self, hosted: Hosted, box: Box, name: str, profile: str, argv: list[str]) -> None:
        self.hosted = hosted
        self.name = name
        self.profile = profile
        self.session_id = new_id("sh", 8)
        self.created_at = time.time()
        self.ex = hosted.new_exec(argv, None, None, True)
        self.up = _Upstream(box, self.ex)
        self.argv = argv
        #: Recent output: (offset, text, its UTF-8 length), contiguous, oldest first.
        self.history: list[tuple[int, str, int]] = []
        self._starts: list[int] = []
        self.history_bytes = 0
        self.offset = 0
        self.exit_code: int | None = None
        self.done = asyncio.Event()
        #: One wake-up per attached client, set when there is output (or an exit) to read.
        self.clients: set[asyncio.Event] = set()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        body = {"command": shlex.join(self.argv), "command_id": self.ex.command_id, "pty": True}
        await self.up.start(body)
        self.task = asyncio.get_running_loop().create_task(self._pump())
        self.hosted.events.append(
            "shell.created", "shell", {"name": self.name, "session_id": self.session_id}
        )

    async def _pump(self) -> None:
        try:
            async for frame in self.up.frames():
                if frame.get("type") in ("stdout", "stderr"):
                    self._keep(str(frame["data"]))
                elif frame.get("type") == "exit":
                    code = frame.get("exit_code")
                    self.exit_code = code if isinstance(code, int) else None
                    self.hosted.ended(self.ex, self.exit_code)
        except Exception:
            self.hosted.ended(self.ex, None, state="failed")
        finally:
            self.done.set()
            self._wake()
            self.hosted.shells.pop(self.name, None)
            self.hosted.events.append("shell.exited", "shell", {"name": self.name})
            await self.up.close()

    def _keep(self, data: str) -> None:
        size = len(data.encode())
        if not size:
            return
        self.history.append((self.offset, data, size))
        self._starts.append(self.offset)
        self.offset += size
        self.history_bytes += size
        while self.history_bytes > SHELL_HISTORY_BYTES and len(self.history) > 1:
            self.history_bytes -= self.history.pop(0)[2]
            self._starts.pop(0)
        self._wake()

    def _wake(self) -> None:
        for wake in self.clients:
            wake.set()

    def history_text(self) -> tuple[str, int]:
        first = self.history[0][0] if self.history else self.offset
        return "".join(d for _, d, _ in self.history), first

    def since(self, cursor: int) -> tuple[int, str, int]:
        """What a client whose next byte is ``cursor`` has not read: where the kept
        output resumes (past ``cursor`` when those bytes are no longer kept: a gap), up
        to about :data:`SHELL_FRAME_BYTES` of text from there, and the offset after it."""
        i = max(0, bisect.bisect_right(self._starts, cursor) - 1)
        resume = end = cursor
        texts: list[str] = []
        for off, data, size in self.history[i:]:
            if off + size <= end:
                continue
            if off > end:  # the oldest kept output starts past the cursor
                resume = end = off
            if off < end:  # the cursor is inside this chunk (an attach): from a character
                raw = data.encode()[end - off :]
                lead = 0
                while lead < len(raw) and raw[lead] & 0xC0 == 0x80:
                    lead += 1
                if not texts:
                    resume = end + lead
                data = raw[lead:].decode("utf-8", "ignore")
            end = off + size
            texts.append(data)
            if end - resume >= SHELL_FRAME_BYTES:
                break
        return resume, "".join(texts), end

    async def kill(self) -> None:
        with contextlib.suppress(Exception):
            await self.up.send({"type": "kill"})


class _ShellReader:
    """One client's place in a shell's output."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.wake = asyncio.Event()


async def shell_ws(ws: WebSocket) -> None:
    params = ws.query_params
    role = params.get("role", "driver")
    if role not in ("driver", "observer"):
        await ws.close(1008, "role must be driver or observer")
        return
    opened = await _open(ws, Capability.SHELL if role == "driver" else Capability.SHELL_OBSERVE)
    if opened is None:
        return
    hosted, ctx, box = opened
    relay = _relay(ws)
    closed = asyncio.Event()

    async def close_socket(reason: str) -> None:
        closed.set()
        await _fail(ws, Unauthenticated(reason))

    tracked = relay.track(ctx, close_socket)
    reader: _ShellReader | None = None
    shell: RelayShell | None = None
    try:
        name = params.get("session", "default")[:128]
        shell = hosted.shells.get(name)
        if shell is None:
            create = params.get("create", "true").lower() not in ("0", "false", "no")
            if role != "driver" or not create:
                raise ResourceNotFound(f"no shell {name!r}")
            profile = params.get("profile", "default")
            argv = hosted.template.shells.get(profile)
            if argv is None:
                raise InvalidRequest(f"no shell profile {profile!r}")
            shell = RelayShell(hosted, box, name, profile, list(argv))
            hosted.shells[name] = shell
            try:
                await shell.start()
            except BaseException:
                hosted.shells.pop(name, None)
                hosted.ended(shell.ex, None, state="failed")
                raise
        text, first = shell.history_text()
        reader = _ShellReader(shell.offset)
        shell.clients.add(reader.wake)
        hosted.clients += 1
        await _send(
            ws,
            {
                "type": "session",
                "session_id": shell.session_id,
                "name": shell.name,
                "profile": shell.profile,
                "role": role,
            },
        )
        await _send(ws, {"type": "history", "data": text, "offset": first})
        if shell.done.is_set() and reader.offset >= shell.offset:
            await _send(ws, {"type": "exit", "exit_code": shell.exit_code})
            return
        await _until_first(
            _shell_out(ws, shell, reader),
            _shell_in(ws, hosted, shell, reader, role, tracked),
            closed.wait(),
        )
    except (WebSocketDisconnect, RuntimeError):
        pass
    except SandlotError as exc:
        await _fail(ws, exc)
    finally:
        tracked.end()
        if shell is not None and reader is not None and reader.wake in shell.clients:
            shell.clients.discard(reader.wake)
            hosted.clients -= 1
        with contextlib.suppress(Exception):
            await ws.close(1000)


async def _shell_out(ws: WebSocket, shell: RelayShell, reader: _ShellReader) -> None:
    """The shell's output to one client, from its own cursor: what it is too slow for is
    dropped for it alone, and told (a ``gap`` frame); nothing is queued per client."""
    while True:
        reader.wake.clear()
        resume, text, end = shell.since(reader.offset)
        if resume > reader.offset:
            await _send(ws, F.gap_frame("stdout", reader.offset, resume))
            reader.offset = resume
        if text:
            await _send(ws, {"type": "stdout", "data": text, "offset": resume})
            reader.offset = end
            continue
        reader.offset = max(reader.offset, end)
        if shell.done.is_set() and reader.offset >= shell.offset:
            await _send(ws, {"type": "exit", "exit_code": shell.exit_code})
            return
        await reader.wake.wait()


async def _shell_in(
    ws: WebSocket,
    hosted: Hosted,
    shell: RelayShell,
    reader: _ShellReader,
    role: str,
    tracked: Tracked,
) -> None:
    needs = Capability.SHELL if role == "driver" else Capability.SHELL_OBSERVE
    while True:
        try:
            frame = F.parse_client_frame(await receive_frame(ws))
        except ValidationError:
            await _send(ws, F.error_frame("INVALID_REQUEST", "invalid frame"))
            continue
        ctx = tracked.ctx
        if isinstance(frame, F.StdinFrame):
            if role != "driver" or ctx is None or Capability.SHELL not in ctx.caps:
                denied = CapabilityDenied("observers cannot type", metadata={"capability": "shell"})
                await _send(ws, F.error_frame(denied.wire_code, denied.message))
                continue
            await shell.up.send({"type": "input", "data": frame.data})
        elif isinstance(frame, F.AttachFrame):
            # From that offset on (what is no longer kept: a gap frame first).
            reader.offset = min(max(0, frame.offset or 0), shell.offset)
            reader.wake.set()
        elif isinstance(frame, F.PingFrame):
            await _send(ws, F.PONG)
        elif isinstance(frame, F.AuthFrame):
            # A refreshed token: the socket lives on to its expiry.
            tracked.switch(await _relay(ws).authenticate(hosted, frame.token, needs))
            await _send(ws, F.AUTH_OK)
        elif isinstance(frame, F.CloseFrame):
            return
        elif isinstance(frame, F.ResizeFrame):
            continue  # the box's frames have no window size: the PTY keeps its own
        else:
            err = NotSupported("this frame is not available for a sandbox on a hosted service")
            await _send(ws, F.error_frame(err.wire_code, err.message))


@endpoint()
async def shells(request: Request) -> Response:
    hosted, _, _ = await authorize(request, Capability.SHELL_OBSERVE)
    return json_response(
        {
            "shells": [
                {
                    "name": s.name,
                    "session_id": s.session_id,
                    "profile": s.profile,
                    "clients": len(s.clients),
                    "created_at": rfc3339(s.created_at),
                    "offset": s.offset,
                    "state": "exited" if s.done.is_set() else "running",
                }
                for s in hosted.shells.values()
            ]
        }
    )


@endpoint()
async def shell_delete(request: Request) -> Response:
    hosted, _, _ = await authorize(request, Capability.SHELL)
    shell = hosted.shells.get(request.path_params["name"])
    if shell is None:
        raise ResourceNotFound(f"no shell {request.path_params['name']!r}")
    await shell.kill()
    return Response(status_code=204)


# --- events -----------------------------------------------------------------------------------


@endpoint()
async def events_sse(request: Request) -> Response:
    hosted, ctx, _ = await authorize(request, Capability.FS_READ)
    relay = _relay(request)
    raw = request.query_params.get("after") or request.headers.get("last-event-id") or "0"
    try:
        after = int(raw)
        tail = int(request.query_params.get("tail") or -1)
    except ValueError:
        raise InvalidRequest("after and tail must be integers") from None
    if after < 0:
        raise InvalidRequest("after must be >= 0")
    log = hosted.events
    if tail >= 0:
        # At most the latest ``tail``: fewer when the log keeps fewer.
        after = max(after, log.last_sequence - tail, log.oldest_sequence - 1)
    log.since(after)  # 410 before the stream starts

    async def stream() -> AsyncIterator[bytes]:
        cursor = after
        live = False
        wake = asyncio.Event()
        revoked = asyncio.Event()

        async def close_revoked(reason: str) -> None:
            revoked.set()
            wake.set()

        # A stream is a socket of its token's like the WebSockets: revoking the token
        # (its session released) or its expiry ends it, and nothing more is delivered.
        tracked = relay.track(ctx, close_revoked)
        log.listen(wake)
        try:
            if relay.verifier.is_revoked(ctx.jti):
                revoked.set()
            yield b": connected\n\n"
            while True:
                wake.clear()
                if revoked.is_set():
                    yield b'event: error\ndata: {"code":"UNAUTHENTICATED"}\n\n'
                    return
                try:
                    batch = log.since(cursor)
                except SequenceExpired as exc:
                    yield expired_event(exc)
                    return
                if batch:
                    cursor = batch[-1][0]
                    yield "".join(
                        f"id: {seq}\nevent: {etype}\ndata: {data}\n\n" for seq, etype, data in batch
                    ).encode()
                    continue
                if not live:
                    # Caught up, as the dataplane says it: what follows is live.
                    live = True
                    yield b": live\n\n"
                try:
                    await asyncio.wait_for(wake.wait(), 15.0)
                except TimeoutError:
                    yield b": keep-alive\n\n"
        finally:
            log.unlisten(wake)
            tracked.end()

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def events_ws(ws: WebSocket) -> None:
    opened = await _open(ws, Capability.FS_READ)
    if opened is None:
        return
    await _fail(ws, NotSupported("the event log of a hosted sandbox is served at GET /events"))


__all__ = ["events_sse", "events_ws", "exec_ws", "run_with_stdin", "shell_delete", "shell_ws"]

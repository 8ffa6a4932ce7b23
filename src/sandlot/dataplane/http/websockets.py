"""WebSocket endpoints: ``/exec/ws``, ``/shell/ws``, ``/events/ws``, ``/execute/ws``.

Each socket runs two tasks: a reader of client frames and a pump that copies
output from the shared stream buffers at the client's own pace (see
:mod:`sandlot.dataplane.services.streams`). Auth: the header, or a first
``{"type": "auth"}`` frame answered by ``auth_ok`` (also accepted later to
refresh the token of a long-lived socket). Close codes: 4401 unauthenticated
or revoked, 4403 capability denied, 4404 unknown sandbox/exec/shell, 4429 too many
sockets (see :mod:`sandlot.dataplane.services.socketlimits`).

Only a driver (``shell``) creates a shell: an observer of a shell that does not run
gets 4404, whatever its ``create`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from sandlot.dataplane.http.web import Host, as_sandlot_error, dumps_text, host_of, sandbox_of
from sandlot.dataplane.services.auth import AuthContext, bearer_from_header
from sandlot.dataplane.services.execs import Exec, parse_signal
from sandlot.dataplane.services.sandbox import SandboxEntry
from sandlot.dataplane.services.socketlimits import Place
from sandlot.dataplane.services.streams import Cursor, check_offsets
from sandlot.protocol import frames as F
from sandlot.protocol.common import Capability, new_id
from sandlot.protocol.errors import (
    CapabilityDenied,
    Forbidden,
    InvalidRequest,
    NotFound,
    RateLimited,
    SandlotError,
    Unauthenticated,
)
from sandlot.protocol.states import ExecState

CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_TOO_MANY = 4429
CLOSE_TRY_AGAIN = 1013


async def receive_frame(ws: WebSocket) -> str | bytes:
    """The next client message, text or binary (both parse as JSON frames)."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    text = message.get("text")
    if text is not None:
        return str(text)
    return bytes(message.get("bytes") or b"")


def close_code_for(exc: SandlotError) -> int:
    if isinstance(exc, Unauthenticated):
        return CLOSE_UNAUTHENTICATED
    if isinstance(exc, (CapabilityDenied, Forbidden)):
        return CLOSE_FORBIDDEN
    if isinstance(exc, NotFound):
        return CLOSE_NOT_FOUND
    if isinstance(exc, RateLimited):
        return CLOSE_TOO_MANY
    if exc.retryable:
        return CLOSE_TRY_AGAIN
    return 1008


class Socket:
    """One accepted WebSocket with its auth, send lock, registration and place."""

    def __init__(self, host: Host, ws: WebSocket, entry: SandboxEntry, place: Place) -> None:
        self.host = host
        self.ws = ws
        self.entry = entry
        self.place = place
        self.ctx: AuthContext | None = None
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.conn: Any = None

    async def send(self, frame: dict[str, Any]) -> None:
        await self.send_text(dumps_text(frame))

    async def send_text(self, text: str) -> None:
        """A frame already serialised (the event log keeps its events as JSON text)."""
        async with self._send_lock:
            await self.ws.send_text(text)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed.set()
        if self.ws.application_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.ws.close(code, reason[:120])

    async def fail(self, exc: SandlotError, *, langsmith: bool = False) -> None:
        self.host.metrics.error(exc.wire_code)
        if langsmith:
            # LangSmith clients dispatch on these error types.
            error_type = "CommandNotFound" if isinstance(exc, NotFound) else exc.wire_code
            frame = F.langsmith_error_frame(error_type, exc.message)
        else:
            frame = F.error_frame(exc.wire_code, exc.message, exc.retryable)
            if exc.metadata:
                # What the client needs to act on it (an event log's oldest sequence).
                frame["metadata"] = exc.metadata
        with contextlib.suppress(Exception):
            await self.send(frame)
        await self.close(close_code_for(exc), exc.message)

    async def authenticate(self, capability: Capability) -> bool:
        """Header credentials, or wait for the ``auth`` frame. False when closed."""
        entry = self.entry
        host = self.host
        try:
            bearer = bearer_from_header(self.ws.headers.get("authorization"))
            api_key = self.ws.headers.get("x-api-key")
            if bearer is None and api_key is None:
                try:
                    raw = await asyncio.wait_for(
                        receive_frame(self.ws), host.settings.auth_timeout_seconds
                    )
                except TimeoutError:
                    raise Unauthenticated("no auth frame") from None
                frame = F.parse_client_frame(raw)
                if not isinstance(frame, F.AuthFrame):
                    raise Unauthenticated("first frame must be auth")
                bearer = frame.token
                ctx = await self._verify(bearer, None, capability)
                self.place.claim(ctx)
                await self.send(F.AUTH_OK)
            else:
                ctx = await self._verify(bearer, api_key, capability)
                self.place.claim(ctx)
        except (WebSocketDisconnect, RuntimeError):
            return False
        except (ValidationError, ValueError):
            await self.fail(Unauthenticated("first frame must be auth"))
            return False
        except SandlotError as exc:
            await self.fail(exc)
            return False
        self.ctx = ctx
        entry.touch()
        self.conn = host.track(entry, ctx, self.closed, self)
        return True

    async def _verify(
        self, bearer: str | None, api_key: str | None, capability: Capability
    ) -> AuthContext:
        return await self.host.authenticator.authenticate(
            bearer=bearer,
            api_key=api_key,
            sandbox_id=self.entry.sandbox_id,
            generation=self.entry.generation,
            capability=capability,
        )

    async def reauth(self, token: str, capability: Capability) -> None:
        """A later ``auth`` frame: switch the socket to a refreshed token."""
        ctx = await self._verify(token, None, capability)
        self.place.switch(ctx)
        host = self.host
        if self.conn is not None:
            host.untrack(self.entry, self.conn)
        self.ctx = ctx
        self.conn = host.track(self.entry, ctx, self.closed, self)
        await self.send(F.AUTH_OK)

    def release(self) -> None:
        """Once the socket's handler is done: untracked, its place given back."""
        if self.conn is not None:
            self.host.untrack(self.entry, self.conn)
            self.conn = None
        self.place.release()


async def open_socket(ws: WebSocket, capability: Capability, route: str) -> Socket | None:
    """The socket accepted and authenticated, or ``None`` once it has been closed.

    Its place (:mod:`~sandlot.dataplane.services.socketlimits`) is taken before it is accepted;
    the caller gives it back with :meth:`Socket.release` when it is done.
    """
    host = host_of(ws)
    try:
        entry = sandbox_of(ws)
        headers = ws.headers
        authenticated = "authorization" in headers or "x-api-key" in headers
        place = host.sockets.admit(entry.sandbox_id, route, authenticated=authenticated)
    except SandlotError as exc:
        host.metrics.error(exc.wire_code)
        with contextlib.suppress(Exception):
            await ws.accept()
            await ws.send_text(dumps_text(F.error_frame(exc.wire_code, exc.message, exc.retryable)))
            await ws.close(close_code_for(exc), exc.message[:120])
        return None
    sock = Socket(host, ws, entry, place)
    try:
        await ws.accept()
        if await sock.authenticate(capability):
            return sock
    except BaseException:
        sock.release()
        raise
    sock.release()
    return None


async def run_until_closed(sock: Socket, reader: Awaitable[None], pump: Awaitable[None]) -> None:
    """Run the frame reader and the output pump until either ends or the socket is closed."""
    tasks = [
        asyncio.ensure_future(reader),
        asyncio.ensure_future(pump),
        asyncio.ensure_future(sock.closed.wait()),
    ]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if not isinstance(exc, (WebSocketDisconnect, RuntimeError, OSError)):
                    await sock.fail(as_sandlot_error(exc))  # type: ignore[arg-type]
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def pump_output(
    sock: Socket,
    cursor: Cursor,
    done: asyncio.Event | None,
    watch: Callable[[asyncio.Event], None],
    exit_frame: Callable[[], dict[str, Any]] | None,
) -> None:
    """Send output from the cursor on until the producer is done; then the exit frame."""
    max_frame = sock.host.settings.max_frame_bytes
    watch(cursor.event)
    while True:
        await cursor.flush(sock.send, max_frame)
        if done is not None and done.is_set() and cursor.drained:
            break
        await cursor.event.wait()
    if exit_frame is not None:
        await sock.send(exit_frame())


def exec_exit_frame(ex: Exec) -> dict[str, Any]:
    return {
        "type": "exit",
        "exec_id": ex.exec_id,
        "exit_code": ex.exit_code,
        "signal": ex.status.signal if ex.status else None,
        "timed_out": ex.timed_out,
        "oom_killed": ex.oom_killed,
    }


async def _start_or_attach(sock: Socket, first: Any, *, langsmith: bool) -> tuple[Exec, list[int]]:
    entry = sock.entry
    runtime = entry.ready().runtime
    assert sock.ctx is not None
    if isinstance(first, (F.StartFrame, F.ExecuteFrame)):
        command_id = first.command_id
        if command_id is not None:
            existing = await entry.execs.by_command_id(command_id)
            if existing is not None:
                return existing, [0, 0]
        elif langsmith:
            # LangSmith clients reconnect by the command_id of ``started``: always have one.
            command_id = new_id("cmd", 8)
        ex = await entry.execs.start(
            runtime,
            command=first.command,
            shell=first.shell,
            env=first.env,
            cwd=first.cwd,
            pty=(getattr(first, "cols", 80), getattr(first, "rows", 24)) if first.pty else None,
            timeout=first.timeout_seconds or None,
            command_id=command_id,
            actor=sock.ctx.actor,
            kill_on_disconnect=first.kill_on_disconnect,
        )
        if isinstance(first, F.StartFrame) and first.stdin is not None:
            await ex.feed_stdin(first.stdin.encode())
        if isinstance(first, F.ExecuteFrame) and first.close_stdin:
            await ex.close_stdin()
        return ex, [0, 0]
    if isinstance(first, F.ReconnectFrame):
        ex_found = await entry.execs.by_command_id(first.command_id)
        if ex_found is None and first.command_id.startswith("ex_"):
            with contextlib.suppress(NotFound):
                ex_found = entry.execs.get(first.command_id)
        if ex_found is None:
            raise NotFound(f"no command {first.command_id}")
        return ex_found, [first.stdout_offset, first.stderr_offset]
    assert isinstance(first, F.AttachFrame)
    ex_att: Exec | None = None
    if first.exec_id:
        ex_att = entry.execs.get(first.exec_id)
    elif first.command_id:
        ex_att = await entry.execs.by_command_id(first.command_id)
    if ex_att is None:
        raise NotFound("no such command")
    return ex_att, [first.stdout_offset, first.stderr_offset]


async def exec_socket(ws: WebSocket, *, langsmith: bool) -> None:
    sock = await open_socket(ws, Capability.EXEC, "/execute/ws" if langsmith else "/exec/ws")
    if sock is None:
        return
    entry = sock.entry
    #: The command once this socket counts among its clients (an attach refused, for an
    #: offset it does not have, never did: it must not count as one leaving).
    ex: Exec | None = None
    try:
        first: Any = None
        while first is None:
            frame = F.parse_client_frame(await receive_frame(ws))
            if isinstance(frame, F.AuthFrame):
                await sock.reauth(frame.token, Capability.EXEC)
            elif isinstance(frame, F.PingFrame):
                await sock.send(F.PONG)
            elif isinstance(frame, (F.StartFrame, F.AttachFrame, F.ExecuteFrame, F.ReconnectFrame)):
                first = frame
            elif isinstance(frame, F.CloseFrame):
                await sock.close()
                return
            else:
                raise _Protocol("start or attach first")
        found, offsets = await _start_or_attach(sock, first, langsmith=langsmith)
        check_offsets(found.streams, offsets)
        ex = found
        ex.clients += 1
        # The cursor exists before ``ready`` is sent: it paces the command from its first byte.
        cursor = Cursor(ex.streams, offsets[: len(ex.streams)])
        ex.client_attached()
        try:
            if langsmith:
                await sock.send(
                    {
                        "type": "started",
                        "command_id": ex.command_id or ex.exec_id,
                        "pid": ex.pid,
                        "exec_id": ex.exec_id,
                    }
                )
            else:
                await sock.send(
                    {
                        "type": "ready",
                        "exec_id": ex.exec_id,
                        "command_id": ex.command_id,
                        "pid": ex.pid,
                    }
                )
            await run_until_closed(
                sock,
                _exec_reader(sock, ex, cursor),
                pump_output(sock, cursor, ex.done, ex.watch, lambda: exec_exit_frame(ex)),
            )
        finally:
            cursor.close()
            ex.unwatch(cursor.event)
        await sock.close(1000)
    except (WebSocketDisconnect, RuntimeError):
        pass
    except (ValidationError, ValueError, _Protocol) as exc:
        await sock.fail(invalid_frame(str(exc)), langsmith=langsmith)
    except SandlotError as exc:
        await sock.fail(exc, langsmith=langsmith)
    finally:
        if ex is not None:
            ex.clients -= 1
            if ex.kill_on_disconnect and ex.clients == 0 and ex.state is ExecState.RUNNING:
                ex.signal(9)
        sock.release()
        entry.touch()


class _Protocol(Exception):
    pass


def invalid_frame(message: str) -> SandlotError:

    first_line = message.splitlines()[0] if message else "invalid frame"
    return InvalidRequest(f"invalid frame: {first_line}"[:200])


async def _exec_reader(sock: Socket, ex: Exec, cursor: Cursor) -> None:
    while True:
        raw = await receive_frame(sock.ws)
        try:
            frame = F.parse_client_frame(raw)
        except ValidationError as exc:
            await sock.send(F.error_frame("INVALID_REQUEST", _first_error(exc)))
            continue
        try:
            if isinstance(frame, F.StdinFrame):
                await ex.write_stdin(frame.data.encode())
            elif isinstance(frame, F.CloseStdinFrame):
                await ex.close_stdin()
            elif isinstance(frame, F.ResizeFrame):
                ex.resize(frame.cols, frame.rows)
            elif isinstance(frame, F.SignalFrame):
                ex.signal(parse_signal(frame.signal))
            elif isinstance(frame, F.KillFrame):
                ex.signal(9)
            elif isinstance(frame, F.PingFrame):
                await sock.send(F.PONG)
            elif isinstance(frame, F.AuthFrame):
                await sock.reauth(frame.token, Capability.EXEC)
            elif isinstance(frame, (F.AttachFrame, F.ReconnectFrame)):
                cursor.seek([frame.stdout_offset, frame.stderr_offset][: len(ex.streams)])
            elif isinstance(frame, F.CloseFrame):
                return
            else:
                await sock.send(F.error_frame("INVALID_REQUEST", "unexpected frame"))
        except SandlotError as exc:
            if isinstance(exc, Unauthenticated):
                raise
            await sock.send(F.error_frame(exc.wire_code, exc.message, exc.retryable))


def _first_error(exc: ValidationError) -> str:
    errs = exc.errors()
    if not errs:
        return "invalid frame"
    loc = ".".join(str(p) for p in errs[0].get("loc", ()))
    return f"invalid frame: {loc} {errs[0].get('msg', '')}".strip()[:200]


# --- shells -------------------------------------------------------------------------------


async def shell_socket(ws: WebSocket) -> None:
    q = ws.query_params
    role = q.get("role", "driver")
    if role not in ("driver", "observer"):
        await ws.accept()
        await ws.close(1008, "role must be driver or observer")
        return
    cap = Capability.SHELL if role == "driver" else Capability.SHELL_OBSERVE
    sock = await open_socket(ws, cap, "/shell/ws")
    if sock is None:
        return
    entry = sock.entry
    assert sock.ctx is not None
    shell = None
    try:
        name = q.get("session") or q.get("name") or "default"
        if len(name) > 200 or "\x00" in name:
            raise invalid_frame("bad session name")
        profile = q.get("profile", "default")
        cols = _int(q.get("cols"), 80)
        rows = _int(q.get("rows"), 24)
        # Only a driver starts a shell: an observer watches one that runs, or gets 4404.
        create = role == "driver" and q.get("create", "true").lower() not in ("0", "false", "no")
        runtime = entry.ready().runtime
        shell = await entry.shells.open(
            runtime,
            name=name,
            profile=profile,
            cols=cols,
            rows=rows,
            create=create,
            actor=sock.ctx.actor,
        )
        if role == "driver" and (q.get("cols") or q.get("rows")):
            shell.resize(cols, rows)
        entry.shells.attached(shell, sock.ctx.actor, role)
        await sock.send(
            {
                "type": "session",
                "session_id": shell.session_id,
                "name": shell.name,
                "profile": shell.profile,
                "role": role,
            }
        )
        hist_off, hist = shell.stream.tail(sock.host.settings.shell_history_bytes)
        from sandlot.dataplane.services.streams import decode

        text, _ = decode(hist)
        await sock.send({"type": "history", "data": text, "offset": hist_off})
        cursor = Cursor([shell.stream], [hist_off + len(hist)])
        sh = shell

        def exit_frame() -> dict[str, Any]:
            return {"type": "exit", "exit_code": sh.status.exit_code if sh.status else None}

        async def reader() -> None:
            while True:
                raw = await receive_frame(ws)
                try:
                    frame = F.parse_client_frame(raw)
                except ValidationError as exc:
                    await sock.send(F.error_frame("INVALID_REQUEST", _first_error(exc)))
                    continue
                try:
                    if isinstance(frame, (F.StdinFrame, F.ResizeFrame, F.SignalFrame)):
                        if (
                            role != "driver"
                            or sock.ctx is None
                            or (Capability.SHELL not in sock.ctx.caps)
                        ):
                            raise CapabilityDenied(
                                "observers cannot type", metadata={"capability": "shell"}
                            )
                        if isinstance(frame, F.StdinFrame):
                            await sh.write(frame.data.encode())
                        elif isinstance(frame, F.ResizeFrame):
                            sh.resize(frame.cols, frame.rows)
                        else:
                            sh.signal(parse_signal(frame.signal))
                    elif isinstance(frame, F.AttachFrame):
                        cursor.seek([frame.offset or 0])
                    elif isinstance(frame, F.PingFrame):
                        await sock.send(F.PONG)
                    elif isinstance(frame, F.AuthFrame):
                        await sock.reauth(frame.token, cap)
                    elif isinstance(frame, F.CloseFrame):
                        return
                    else:
                        await sock.send(F.error_frame("INVALID_REQUEST", "unexpected frame"))
                except SandlotError as exc:
                    if isinstance(exc, Unauthenticated):
                        raise
                    await sock.send(F.error_frame(exc.wire_code, exc.message, exc.retryable))

        try:
            await run_until_closed(
                sock, reader(), pump_output(sock, cursor, sh.done, sh.watch, exit_frame)
            )
        finally:
            cursor.close()
            sh.unwatch(cursor.event)
        await sock.close(1000)
    except (WebSocketDisconnect, RuntimeError):
        pass
    except SandlotError as exc:
        await sock.fail(exc)
    finally:
        if shell is not None and sock.ctx is not None:
            entry.shells.detached(shell, sock.ctx.actor, role)
        sock.release()
        entry.touch()


def _int(raw: str | None, default: int) -> int:
    try:
        value = int(raw) if raw else default
    except ValueError:
        return default
    return min(max(value, 1), 1000)


# --- events -------------------------------------------------------------------------------


async def events_socket(ws: WebSocket) -> None:
    sock = await open_socket(ws, Capability.FS_READ, "/events/ws")
    if sock is None:
        return
    entry = sock.entry
    try:
        after = int(ws.query_params.get("after") or 0)
        if after < 0:
            raise InvalidRequest("after must be >= 0")
        entry.events.since(after)
        wake = asyncio.Event()
        entry.events.listen(wake)

        async def pump() -> None:
            cursor = after
            while True:
                wake.clear()
                batch = entry.events.since(cursor)
                for seq, _etype, data in batch:
                    await sock.send_text(data)
                    cursor = seq
                if not batch:
                    await wake.wait()

        async def reader() -> None:
            while True:
                raw = await receive_frame(ws)
                with contextlib.suppress(ValidationError):
                    frame = F.parse_client_frame(raw)
                    if isinstance(frame, F.PingFrame):
                        await sock.send(F.PONG)
                    elif isinstance(frame, F.AuthFrame):
                        await sock.reauth(frame.token, Capability.FS_READ)
                    elif isinstance(frame, F.CloseFrame):
                        return

        try:
            await run_until_closed(sock, reader(), pump())
        finally:
            entry.events.unlisten(wake)
        await sock.close(1000)
    except (WebSocketDisconnect, RuntimeError):
        pass
    except ValueError:
        await sock.fail(invalid_frame("after must be an integer"))
    except SandlotError as exc:
        await sock.fail(exc)
    finally:
        sock.release()


async def exec_ws(ws: WebSocket) -> None:
    """``/exec/ws``: start or attach to a command, stream its output (PROTOCOL.md 3.3)."""
    await exec_socket(ws, langsmith=False)


async def execute_ws(ws: WebSocket) -> None:
    """``/execute/ws``: the same in LangSmith's frames (PROTOCOL.md 3.9)."""
    await exec_socket(ws, langsmith=True)


async def shell_ws(ws: WebSocket) -> None:
    """``/shell/ws``: a shared shell (PROTOCOL.md 3.4)."""
    await shell_socket(ws)


async def events_ws(ws: WebSocket) -> None:
    """``/events/ws``: the event log, then live (PROTOCOL.md 3.7)."""
    await events_socket(ws)

"""Commands of one sandbox: one-shot and streaming, detached, attachable again.

An :class:`Exec` owns its process, one :class:`OutputStream` per stream
(``stdout`` and ``stderr``, or a single ``stdout`` under a PTY) and its
lifecycle (``running`` → ``exited``/``killed``/``failed``). Clients come and
go (:class:`~sandlot.dataplane.streams.Cursor`); the command does not care.
Finished commands stay attachable for the reattach window. A ``command_id``
names one command: while it is being started, a second start with the same id
(a client resending ``start`` after a broken connection) waits for the first
and attaches to it instead of spawning the command again.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal as signals
import time
from collections.abc import Callable
from typing import Any

from sandlot.dataplane.procio import PACING_HEADROOM, FdReader, close_fd, write_all
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.dataplane.streams import OutputStream
from sandlot.protocol.common import Actor, new_id, rfc3339
from sandlot.protocol.errors import ExecNotFound, InvalidRequest, ResourceConflict
from sandlot.protocol.states import ExecState, check_transition
from sandlot.runtime.base import WORKSPACE, ExitStatus, ProcessSpec, SandboxProcess, SandboxRuntime
from sandlot.runtime.direct import set_winsize

#: Seconds to wait for pipes to reach EOF after the process exits (background children).
EOF_GRACE = 1.0
TIMEOUT_EXIT_CODE = 124

EventSink = Callable[[str, str, dict[str, Any], Actor | None], int]


def parse_signal(name: str) -> int:
    key = name.upper()
    if not key.startswith("SIG"):
        key = "SIG" + key
    try:
        return int(signals.Signals[key])
    except KeyError:
        try:
            return int(signals.Signals(int(name)))
        except (ValueError, KeyError):
            raise InvalidRequest(f"unknown signal {name!r}") from None


def sandbox_cwd(cwd: str | None) -> str:
    from sandlot.dataplane.paths import normalize

    return normalize(cwd) if cwd else WORKSPACE


class Exec:
    def __init__(
        self,
        *,
        command: str | list[str],
        command_id: str | None,
        actor: Actor | None,
        pty: bool,
        settings: DataplaneSettings,
        collect: bool,
    ) -> None:
        self.exec_id = new_id("ex", 8)
        self.command = command
        self.command_id = command_id
        self.actor = actor
        self.pty = pty
        self.state = ExecState.RUNNING
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.status: ExitStatus | None = None
        self.timed_out = False
        self.clients = 0
        self.pid: int | None = None
        self.process: SandboxProcess | None = None
        limit = settings.max_output_bytes if collect else None
        cap = settings.stream_buffer_bytes
        # Streamed commands are paced by their leading client; a collected one (POST /exec)
        # keeps everything anyway, and a client watching it must not slow its answer.
        headroom = None if collect else PACING_HEADROOM
        self.stdout = OutputStream("stdout", cap, collect_limit=limit, headroom=headroom)
        self.stderr = OutputStream("stderr", cap, collect_limit=limit, headroom=headroom)
        self.streams = [self.stdout] if pty else [self.stdout, self.stderr]
        self.done = asyncio.Event()
        self._watchers: set[asyncio.Event] = set()
        self._readers: list[FdReader] = []
        self._stdin_lock = asyncio.Lock()
        self._stdin_closed = False
        self._timeout_handle: asyncio.TimerHandle | None = None
        self.kill_on_disconnect = False

    # --- watching ---------------------------------------------------------------------

    def watch(self, event: asyncio.Event) -> None:
        self._watchers.add(event)

    def unwatch(self, event: asyncio.Event) -> None:
        self._watchers.discard(event)

    @property
    def retained_bytes(self) -> int:
        total = 0
        for s in (self.stdout, self.stderr):
            total += s.end - s.start + (len(s.collected) if s.collected is not None else 0)
        return total

    def release_collected(self) -> None:
        """Forget the one-shot copy of the output (the replay buffers stay)."""
        self.stdout.collected = None
        self.stderr.collected = None

    @property
    def exit_code(self) -> int | None:
        if self.status is None:
            return None
        return TIMEOUT_EXIT_CODE if self.timed_out else self.status.exit_code

    def snapshot(self, last_event_sequence: int) -> dict[str, Any]:
        return {
            "exec_id": self.exec_id,
            "command_id": self.command_id,
            "command": self.command,
            "actor": self.actor.model_dump(mode="json") if self.actor else None,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "signal": self.status.signal if self.status else None,
            "pty": self.pty,
            "started_at": rfc3339(self.started_at),
            "ended_at": rfc3339(self.ended_at),
            "stdout_offset": self.stdout.end,
            "stderr_offset": self.stderr.end,
            "clients": self.clients,
            "last_event_sequence": last_event_sequence,
        }

    # --- input ------------------------------------------------------------------------

    def _input_fd(self) -> int | None:
        assert self.process is not None
        return self.process.pty_fd if self.pty else self.process.stdin_fd

    async def write_stdin(self, data: bytes) -> None:
        if self.state is not ExecState.RUNNING or self._stdin_closed:
            raise ResourceConflict("stdin is closed")
        fd = self._input_fd()
        if fd is None:
            raise ResourceConflict("stdin is closed")
        async with self._stdin_lock:
            try:
                await write_all(fd, data)
            except OSError:
                raise ResourceConflict("stdin is closed") from None

    async def close_stdin(self) -> None:
        if self._stdin_closed or self.process is None:
            return
        if self.pty:
            # A PTY has no separate stdin to close: send end-of-file (^D) instead.
            with contextlib.suppress(ResourceConflict):
                await self.write_stdin(b"\x04")
            return
        async with self._stdin_lock:
            self._stdin_closed = True
            close_fd(self.process.stdin_fd)
            self.process.stdin_fd = None

    def resize(self, cols: int, rows: int) -> None:
        if self.pty and self.process is not None and self.process.pty_fd is not None:
            with contextlib.suppress(OSError):
                set_winsize(self.process.pty_fd, cols, rows)

    def signal(self, signo: int) -> None:
        if self.process is not None and self.state is ExecState.RUNNING:
            self.process.send_signal(signo)

    # --- lifecycle --------------------------------------------------------------------

    def attach_process(self, process: SandboxProcess, timeout: float | None) -> None:
        self.process = process
        self.pid = process.pid
        if self.pty:
            assert process.pty_fd is not None
            self._readers = [FdReader(process.pty_fd, self.stdout)]
            self.stderr.close()
        else:
            assert process.stdout_fd is not None and process.stderr_fd is not None
            self._readers = [
                FdReader(process.stdout_fd, self.stdout),
                FdReader(process.stderr_fd, self.stderr),
            ]
        if timeout is not None:
            self._timeout_handle = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _expire(self) -> None:
        if self.state is ExecState.RUNNING and self.process is not None:
            self.timed_out = True
            self.process.send_signal(signals.SIGKILL)

    async def supervise(self, on_exit: Callable[[Exec], None]) -> None:
        assert self.process is not None
        try:
            status = await self.process.wait()
        except asyncio.CancelledError:
            self.process.send_signal(signals.SIGKILL)
            raise
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        # Exit is never held back by a client: read what the pipes still hold at full speed.
        for s in self.streams:
            s.stop_pacing()
        waiter = asyncio.Event()
        for s in self.streams:
            s.listen(waiter)
        try:
            deadline = time.monotonic() + EOF_GRACE
            while not all(s.eof for s in self.streams):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                waiter.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wait(), remaining)
        finally:
            for s in self.streams:
                s.unlisten(waiter)
        self.finish(status)
        on_exit(self)

    def finish(self, status: ExitStatus) -> None:
        for reader in self._readers:
            reader.close()
            close_fd(reader.fd)
        self._readers = []
        self.stdout.close()
        self.stderr.close()
        if self.process is not None and self.process.stdin_fd is not None:
            close_fd(self.process.stdin_fd)
            self.process.stdin_fd = None
        self.status = status
        killed = self.timed_out or status.signal is not None
        self.state = check_transition(self.state, ExecState.KILLED if killed else ExecState.EXITED)
        self.ended_at = time.time()
        self.done.set()
        for ev in self._watchers:
            ev.set()

    def fail(self) -> None:
        self.stdout.close()
        self.stderr.close()
        self.state = check_transition(self.state, ExecState.FAILED)
        self.ended_at = time.time()
        self.done.set()
        for ev in self._watchers:
            ev.set()


class ExecManager:
    """The commands of one sandbox."""

    def __init__(self, settings: DataplaneSettings, emit: EventSink) -> None:
        self.settings = settings
        self._emit = emit
        self._execs: dict[str, Exec] = {}
        self._by_command: dict[str, Exec] = {}
        #: command_ids of commands being spawned; set once the spawn succeeded or failed.
        self._starting: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0
        self._pruned_at = 0.0

    @property
    def running(self) -> int:
        return self._running

    @property
    def clients(self) -> int:
        return sum(e.clients for e in self._execs.values())

    def get(self, exec_id: str) -> Exec:
        ex = self._execs.get(exec_id)
        if ex is None:
            raise ExecNotFound(f"no command {exec_id}")
        return ex

    async def by_command_id(self, command_id: str) -> Exec | None:
        """The command started with ``command_id``; one being started is waited for."""
        starting = self._starting.get(command_id)
        if starting is not None:
            await starting.wait()
        return self._by_command.get(command_id)

    def all(self) -> list[Exec]:
        self._prune(force=True)
        return list(self._execs.values())

    def _prune(self, *, force: bool = False) -> None:
        # A full pass is O(execs): run it at most once a second, or when over the cap.
        now = time.monotonic()
        if not force and len(self._execs) < self.settings.max_execs and now - self._pruned_at < 1:
            return
        self._pruned_at = now
        horizon = time.time() - self.settings.reattach_window_seconds
        finished = [e for e in self._execs.values() if e.ended_at is not None and e.clients == 0]
        drop = [e for e in finished if e.ended_at is not None and e.ended_at < horizon]
        dropped = {e.exec_id for e in drop}
        rest = sorted(
            (e for e in finished if e.exec_id not in dropped), key=lambda e: e.ended_at or 0
        )
        excess = len(self._execs) - len(drop) - self.settings.max_execs
        if excess > 0:
            drop += rest[:excess]
            rest = rest[excess:]
        # Bound the memory of finished commands as a whole, oldest first.
        retained = sum(e.retained_bytes for e in rest)
        for e in rest:
            if retained <= self.settings.max_retained_output_bytes:
                break
            retained -= e.retained_bytes
            drop.append(e)
        for e in drop:
            self._execs.pop(e.exec_id, None)
            if e.command_id is not None and self._by_command.get(e.command_id) is e:
                del self._by_command[e.command_id]

    async def start(
        self,
        runtime: SandboxRuntime,
        *,
        command: str | list[str],
        shell: str,
        env: dict[str, str],
        cwd: str | None,
        pty: tuple[int, int] | None,
        timeout: float | None,
        command_id: str | None,
        actor: Actor | None,
        collect: bool = False,
        stdin: bytes | None = None,
    ) -> Exec:
        self._prune()
        if command_id is not None and (
            command_id in self._by_command or command_id in self._starting
        ):
            raise ResourceConflict("command_id already used", metadata={"command_id": command_id})
        if self.running >= self.settings.max_execs:
            raise ResourceConflict("too many running commands")
        if command_id is not None:
            self._starting[command_id] = asyncio.Event()
        try:
            argv = [shell, "-c", command] if isinstance(command, str) else list(command)
            ex = Exec(
                command=command,
                command_id=command_id,
                actor=actor,
                pty=pty is not None,
                settings=self.settings,
                collect=collect,
            )
            spec = ProcessSpec(argv=argv, env=env, cwd=sandbox_cwd(cwd), pty=pty)
            try:
                process = await runtime.spawn(spec)
            except FileNotFoundError:
                raise InvalidRequest("command or working directory not found") from None
            except PermissionError:
                raise InvalidRequest("command is not executable") from None
            except OSError as exc:
                raise InvalidRequest(f"cannot start command: {exc.strerror}") from None
            ex.attach_process(process, timeout)
            self._running += 1
            self._execs[ex.exec_id] = ex
            if command_id is not None:
                self._by_command[command_id] = ex
            self._emit(
                "exec.started",
                "exec",
                {
                    "exec_id": ex.exec_id,
                    "command_id": command_id,
                    "pid": ex.pid,
                    "pty": ex.pty,
                    "status": "started",
                },
                actor,
            )
            task = asyncio.get_running_loop().create_task(ex.supervise(self._exited))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if stdin is not None:
                if stdin:
                    await ex.write_stdin(stdin)
                await ex.close_stdin()
            return ex
        finally:
            if command_id is not None:
                self._starting.pop(command_id).set()

    def _exited(self, ex: Exec) -> None:
        self._running -= 1
        status = "killed" if ex.state is ExecState.KILLED else "exited"
        self._emit(
            f"exec.{status}",
            "exec",
            {
                "exec_id": ex.exec_id,
                "command_id": ex.command_id,
                "exit_code": ex.exit_code,
                "signal": ex.status.signal if ex.status else None,
                "timed_out": ex.timed_out,
                "status": status,
            },
            ex.actor,
        )

    async def close(self) -> None:
        running = [ex for ex in self._execs.values() if ex.state is ExecState.RUNNING]
        for ex in running:
            ex.signal(signals.SIGKILL)
        # Let the supervisors reap what was killed (no zombie, no Popen left running).
        if running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(ex.done.wait() for ex in running)), EOF_GRACE + 1.0
                )
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for ex in self._execs.values():
            if ex.state is ExecState.RUNNING:
                ex.finish(ExitStatus(exit_code=137, signal="SIGKILL"))

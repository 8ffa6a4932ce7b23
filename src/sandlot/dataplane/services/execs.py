"""Commands of one sandbox: one-shot and streaming, detached, attachable again.

An :class:`Exec` owns its process, one :class:`OutputStream` per stream
(``stdout`` and ``stderr``, or a single ``stdout`` under a PTY) and its
lifecycle (``running`` → ``exited``/``killed``/``failed``). Clients come and
go (:class:`~sandlot.dataplane.services.streams.Cursor`); the command does not care.
Finished commands stay attachable for the reattach window. A ``command_id``
names one command: while it is being started, a second start with the same id
(a client resending ``start`` after a broken connection) waits for the first
and attaches to it instead of spawning the command again.

Where the runtime keeps processes through a restart of the server (the
isolated local runtime), every command is started *kept*: the sandbox's init
holds its pipes and a record of it (id, ``command_id``, actor, deadline…),
and its output is spooled (:mod:`sandlot.dataplane.services.spool`). A server killed
at any instant loses neither the command nor a byte of its output: the next
one takes it over (:meth:`ExecManager.readopt`) with the same id, offsets and replay
buffers, and ``command_id`` still names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import signal as signals
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sandlot.dataplane.services.procio import PACING_HEADROOM, FdReader, close_fd, write_all
from sandlot.dataplane.services.spool import SpoolFile, SpoolReader
from sandlot.dataplane.services.streams import ByteBudget, Cursor, OutputStream
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.common import Actor, new_id, rfc3339
from sandlot.protocol.dataplane import ExecSnapshot
from sandlot.protocol.errors import ExecNotFound, InvalidRequest, ResourceConflict
from sandlot.protocol.states import ExecState, check_transition
from sandlot.runtime.base import (
    WORKSPACE,
    ExitStatus,
    Keep,
    KeptProcess,
    ProcessSpec,
    SandboxProcess,
    SandboxRuntime,
)
from sandlot.runtime.direct import set_winsize

log = logging.getLogger(__name__)

#: Seconds to wait for pipes to reach EOF after the process exits (background children).
EOF_GRACE = 1.0
#: Seconds a command taken over after a restart waits for its client to come back before
#: running unpaced: the client was cut off by the crash, not by choice (the SDK rides out
#: outages of up to 30 s).
READOPT_HOLD_SECONDS = 60.0
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
    from sandlot.dataplane.services.paths import normalize

    return normalize(cwd) if cwd else WORKSPACE


#: The most of a command an ``exec.started`` event carries (a feed shows what ran).
COMMAND_PREVIEW_CHARS = 1000


def command_preview(command: str | list[str]) -> str:
    """The command as a shell would read it, cut at :data:`COMMAND_PREVIEW_CHARS`."""
    text = command if isinstance(command, str) else shlex.join(command)
    if len(text) > COMMAND_PREVIEW_CHARS:
        return text[: COMMAND_PREVIEW_CHARS - 1] + "…"
    return text


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
        exec_id: str | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.exec_id = exec_id or new_id("ex", 8)
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
        self.stdout = OutputStream(
            "stdout", cap, collect_limit=limit, headroom=headroom, budget=budget
        )
        self.stderr = OutputStream(
            "stderr", cap, collect_limit=limit, headroom=headroom, budget=budget
        )
        self.streams = [self.stdout] if pty else [self.stdout, self.stderr]
        self.done = asyncio.Event()
        self._watchers: set[asyncio.Event] = set()
        self._readers: list[FdReader] = []
        self._stdin_lock = asyncio.Lock()
        self._stdin_closed = False
        self._timeout_handle: asyncio.TimerHandle | None = None
        self.kill_on_disconnect = False
        self.collect = collect
        #: Wall-clock time the command is killed at (its timeout), if any.
        self.deadline: float | None = None
        #: Of a kept command: the init's tag for it, and its spool files.
        self.tag: int | None = None
        self.spools: list[SpoolFile] = []
        self._detached = False
        #: Paces a command taken over after a restart until a client is back.
        self._hold: Cursor | None = None
        self._hold_timer: asyncio.TimerHandle | None = None

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
    def oom_killed(self) -> bool:
        return self.status is not None and self.status.oom_killed

    def record(self) -> bytes:
        """What the init keeps for this command (see :meth:`ExecManager.readopt`)."""
        return json.dumps(
            {
                "kind": "exec",
                "exec_id": self.exec_id,
                "command_id": self.command_id,
                "command": self.command,
                "actor": self.actor.model_dump(mode="json") if self.actor else None,
                "pty": self.pty,
                "collect": self.collect,
                "started_at": self.started_at,
                "deadline": self.deadline,
                "kill_on_disconnect": self.kill_on_disconnect,
            },
            separators=(",", ":"),
        ).encode()

    @property
    def exit_code(self) -> int | None:
        if self.status is None:
            return None
        return TIMEOUT_EXIT_CODE if self.timed_out else self.status.exit_code

    def snapshot(self, last_event_sequence: int) -> ExecSnapshot:
        return ExecSnapshot(
            exec_id=self.exec_id,
            command_id=self.command_id,
            command=self.command,
            actor=self.actor,
            state=self.state.value,
            exit_code=self.exit_code,
            signal=self.status.signal if self.status else None,
            oom_killed=self.oom_killed,
            pty=self.pty,
            started_at=rfc3339(self.started_at) or "",
            ended_at=rfc3339(self.ended_at),
            stdout_offset=self.stdout.end,
            stderr_offset=self.stderr.end,
            clients=self.clients,
            last_event_sequence=last_event_sequence,
        )

    def hold_for_client(self, seconds: float) -> None:
        """Pace the output as if the client cut off by a restart were still here, at the
        oldest offset it can be at, until a client attaches or ``seconds`` pass."""
        if self.collect or self.state is not ExecState.RUNNING:
            return
        self._hold = Cursor(self.streams, [s.start for s in self.streams])
        self._hold_timer = asyncio.get_running_loop().call_later(seconds, self.client_attached)

    def client_attached(self) -> None:
        """A client is attached (or none came back in time): it paces the command now."""
        if self._hold is not None:
            self._hold.close()
            self._hold = None
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None

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

    async def feed_stdin(self, data: bytes) -> None:
        """The input a command is started with: what it does not read before it closes
        its stdin or ends (``head -c 5``, a timeout) is left unread, as a pipe's writer
        leaves it, and its result stands."""
        if data:
            with contextlib.suppress(ResourceConflict):
                await self.write_stdin(data)

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
            if self.tag is not None:
                self.process.release(0)  # the init's copy of the write end too: EOF

    def resize(self, cols: int, rows: int) -> None:
        if self.pty and self.process is not None and self.process.pty_fd is not None:
            with contextlib.suppress(OSError):
                set_winsize(self.process.pty_fd, cols, rows)

    def signal(self, signo: int) -> None:
        if self.process is not None and self.state is ExecState.RUNNING:
            self.process.send_signal(signo)

    # --- lifecycle --------------------------------------------------------------------

    def attach_process(
        self, process: SandboxProcess, timeout: float | None, pipe: tuple[int, int] | None = None
    ) -> None:
        """Read the process's output; a kept one's through its spools (``pipe``: see below).

        Under a PTY, a kept command's output goes from the master through ``pipe``
        (read end, write end), which the init holds too.
        """
        self.process = process
        self.pid = process.pid
        if self.pty:
            assert process.pty_fd is not None
            if self.spools and pipe is not None:
                reader: FdReader = SpoolReader(
                    pipe[0], self.stdout, self.spools[0], master=process.pty_fd, pipe_in=pipe[1]
                )
            else:
                reader = FdReader(process.pty_fd, self.stdout)
            self._readers = [reader]
            self.stderr.close()
        else:
            assert process.stdout_fd is not None and process.stderr_fd is not None
            if self.spools:
                self._readers = [
                    SpoolReader(process.stdout_fd, self.stdout, self.spools[0]),
                    SpoolReader(process.stderr_fd, self.stderr, self.spools[1]),
                ]
            else:
                self._readers = [
                    FdReader(process.stdout_fd, self.stdout),
                    FdReader(process.stderr_fd, self.stderr),
                ]
        if timeout is not None:
            self._timeout_handle = asyncio.get_running_loop().call_later(
                max(0.0, timeout), self._expire
            )

    def _expire(self) -> None:
        if self.state is ExecState.RUNNING and self.process is not None:
            self.timed_out = True
            self.process.send_signal(signals.SIGKILL)

    async def supervise(self, on_exit: Callable[[Exec], None]) -> None:
        assert self.process is not None
        try:
            status = await self.process.wait()
        except asyncio.CancelledError:
            if not self._detached:
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
        self.client_attached()
        self._close_readers()
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

    def _close_readers(self) -> None:
        for reader in self._readers:
            reader.close()
            close_fd(reader.fd)
            if isinstance(reader, SpoolReader):
                if reader.master is not None:
                    close_fd(reader.pipe)
                close_fd(reader.pipe_in)
        self._readers = []
        for spool in self.spools:
            spool.close()

    def detach(self) -> None:
        """Let go of a kept command without ending it (the server is stopping)."""
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        self._close_readers()
        self._detached = True
        if self.process is not None:
            close_fd(self.process.stdin_fd)
            self.process.stdin_fd = None

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
        #: What the one-shot copies of the running commands may keep, all together.
        self._collecting = ByteBudget(settings.max_collecting_bytes)
        self._emit = emit
        self._execs: dict[str, Exec] = {}
        self._by_command: dict[str, Exec] = {}
        #: command_ids of commands being spawned; set once the spawn succeeded or failed.
        self._starting: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0
        self._pruned_at = 0.0
        #: The runtime of the kept commands (to forget them once pruned).
        self._runtime: SandboxRuntime | None = None

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
            self._discard(e)

    def _discard(self, ex: Exec) -> None:
        """A pruned command: its spool files go, and the init forgets it."""
        for spool in ex.spools:
            spool.remove()
        if ex.tag is not None and self._runtime is not None:
            self._background(self._runtime.forget(ex.tag))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:  # the sandbox may be gone meanwhile
                log.debug("kept command bookkeeping failed: %s", exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        kill_on_disconnect: bool = False,
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
                budget=self._collecting,
            )
            spec = ProcessSpec(argv=argv, env=env, cwd=sandbox_cwd(cwd), pty=pty)
            ex.kill_on_disconnect = kill_on_disconnect
            if timeout is not None:
                ex.deadline = time.time() + timeout
            keep, pipe = self._prepare_keep(runtime, ex)
            try:
                process = await runtime.spawn(spec, keep)
            except FileNotFoundError:
                self._abandon(ex, pipe)
                raise InvalidRequest("command or working directory not found") from None
            except PermissionError:
                self._abandon(ex, pipe)
                raise InvalidRequest("command is not executable") from None
            except OSError as exc:
                self._abandon(ex, pipe)
                raise InvalidRequest(f"cannot start command: {exc.strerror}") from None
            except BaseException:
                self._abandon(ex, pipe)
                raise
            ex.attach_process(process, timeout, pipe)
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
                    "command": command_preview(ex.command),
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
                await ex.feed_stdin(stdin)
                await ex.close_stdin()
            return ex
        finally:
            if command_id is not None:
                self._starting.pop(command_id).set()

    def _prepare_keep(
        self, runtime: SandboxRuntime, ex: Exec
    ) -> tuple[Keep | None, tuple[int, int] | None]:
        """Spool files and the init's part for a command that must outlive the server."""
        spool_dir = runtime.spool_dir
        if not runtime.keeps_processes or spool_dir is None:
            return None, None
        self._runtime = runtime
        spool_dir.mkdir(mode=0o700, exist_ok=True)
        ex.spools = self._spools(spool_dir, ex, create=True)
        ex.tag = secrets.randbits(63) or 1
        pipe = None
        hold: tuple[int, ...] = ()
        if ex.pty:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            pipe, hold = (r, w), (r, w)
        return Keep(ex.tag, ex.record(), hold), pipe

    def _spools(self, spool_dir: Path, ex: Exec, *, create: bool) -> list[SpoolFile]:
        """The spool file of each output stream of ``ex`` (made, or left by a previous server)."""
        head = self.settings.max_output_bytes if ex.collect else 0
        tail = self.settings.stream_buffer_bytes + 2 * PACING_HEADROOM
        names = ["pty"] if ex.pty else ["stdout", "stderr"]
        return [
            SpoolFile(
                spool_dir / f"{ex.exec_id}.{n}", keep_head=head, keep_tail=tail, create=create
            )
            for n in names
        ]

    @staticmethod
    def _abandon(ex: Exec, pipe: tuple[int, int] | None) -> None:
        for spool in ex.spools:
            spool.remove()
        ex.spools = []
        if pipe is not None:
            close_fd(pipe[0])
            close_fd(pipe[1])

    async def readopt(self, runtime: SandboxRuntime, kept: list[KeptProcess]) -> None:
        """Take over the commands a previous server started in this sandbox."""
        spool_dir = runtime.spool_dir
        if spool_dir is None:
            return
        self._runtime = runtime
        for k in kept:
            try:
                info = json.loads(k.record)
            except ValueError:
                continue
            if not isinstance(info, dict) or info.get("kind") != "exec":
                continue
            try:
                await self._readopt_one(runtime, spool_dir, k, info)
            except (OSError, LookupError, KeyError, TypeError, ValueError) as exc:
                log.warning("could not take over command %s: %s", info.get("exec_id"), exc)

    async def _readopt_one(
        self, runtime: SandboxRuntime, spool_dir: Path, k: KeptProcess, info: dict[str, Any]
    ) -> None:
        if str(info["exec_id"]) in self._execs:
            return  # ours already (a sandbox resumed by the server that started it)
        actor = Actor.model_validate(info["actor"]) if info.get("actor") else None
        ex = Exec(
            command=info["command"],
            command_id=info.get("command_id"),
            actor=actor,
            pty=bool(info.get("pty")),
            settings=self.settings,
            collect=bool(info.get("collect")),
            exec_id=str(info["exec_id"]),
            budget=self._collecting,
        )
        ex.started_at = float(info["started_at"])
        ex.deadline = info.get("deadline")
        ex.kill_on_disconnect = bool(info.get("kill_on_disconnect"))
        ex.tag = k.tag
        ex.spools = self._spools(spool_dir, ex, create=False)
        for spool, stream in zip(ex.spools, ex.streams, strict=True):
            spool.restore(stream)
        process = await runtime.adopt(k.tag)
        held = process.held + [-1] * 4

        def own(fd: int) -> int | None:
            return fd if fd >= 0 else None

        pipe: tuple[int, int] | None = None
        if ex.pty:
            # Held: the pipe (read, write) the master's output goes through, then the master.
            process.pty_fd = own(held[2])
            if held[0] >= 0 and held[1] >= 0:
                pipe = (held[0], held[1])
        else:
            process.stdin_fd = own(held[0])
            process.stdout_fd = own(held[1])
            process.stderr_fd = own(held[2])
        if ex.command_id is not None:
            self._by_command[ex.command_id] = ex
        self._execs[ex.exec_id] = ex
        ex.process = process
        ex.pid = process.pid
        readable = (
            process.pty_fd is not None and pipe is not None
            if ex.pty
            else process.stdout_fd is not None and process.stderr_fd is not None
        )
        if readable:
            remaining = None if ex.deadline is None else ex.deadline - time.time()
            ex.hold_for_client(READOPT_HOLD_SECONDS)
            ex.attach_process(process, remaining, pipe)
        else:
            # Its output was all spooled before the previous server let go of the pipes.
            for stream in ex.streams:
                stream.close()
        self._running += 1
        task = asyncio.get_running_loop().create_task(ex.supervise(self._exited))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if ex.kill_on_disconnect and ex.clients == 0:
            ex.signal(signals.SIGKILL)

    def _exited(self, ex: Exec) -> None:
        self._running -= 1
        if ex.tag is not None and self._runtime is not None:
            # Everything is spooled: the init need not hold the pipes any longer.
            self._background(self._runtime.release_held(ex.tag))
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
                "oom_killed": ex.oom_killed,
                "status": status,
            },
            ex.actor,
        )

    async def close(self, *, detach: bool = False) -> None:
        """End the sandbox's commands; with ``detach``, kept ones are let go instead."""
        if detach:
            for ex in self._execs.values():
                if ex.tag is not None and ex.state is ExecState.RUNNING:
                    ex.detach()
        running = [
            ex for ex in self._execs.values() if ex.state is ExecState.RUNNING and not ex._detached
        ]
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
            if ex.state is ExecState.RUNNING and not ex._detached:
                ex.finish(ExitStatus(exit_code=137, signal="SIGKILL"))

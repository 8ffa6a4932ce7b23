"""Named, persistent PTY shells shared by several clients (PROTOCOL.md 3.4).

A shell runs one of the template's shell profiles under a PTY and outlives
its clients. Its output goes to one bounded :class:`OutputStream`; each client
reads it through its own cursor, so a slow client only ever loses its own
bytes (``gap``) and costs no memory. Drivers type; observers only watch.

Once a profile has been opened in a sandbox, the manager keeps one *spare*
of it started in the background (``spare_shells``): the next shell of that
profile is the spare, renamed and resized, so opening it costs no process
start. A spare is not listed, emits no event and is not activity; if it
exits unclaimed it is dropped, and an open without one starts its program
as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal as signals
import time
from collections.abc import Coroutine
from typing import Any

from sandlot.dataplane.execs import EventSink
from sandlot.dataplane.procio import FdReader, close_fd, write_all
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.dataplane.streams import OutputStream
from sandlot.protocol.common import Actor, new_id, rfc3339
from sandlot.protocol.errors import InvalidRequest, ResourceConflict, ResourceNotFound
from sandlot.protocol.states import ShellState, check_transition
from sandlot.runtime.base import WORKSPACE, ExitStatus, ProcessSpec, SandboxProcess, SandboxRuntime
from sandlot.runtime.direct import set_winsize

log = logging.getLogger(__name__)


class Shell:
    def __init__(
        self, name: str, profile: str, settings: DataplaneSettings, runtime: SandboxRuntime
    ) -> None:
        self.name = name
        self.runtime = runtime
        self.profile = profile
        self.session_id = new_id("sh", 8)
        self.created_at = time.time()
        self.state = ShellState.RUNNING
        self.stream = OutputStream("stdout", settings.shell_buffer_bytes)
        self.clients = 0
        self.process: SandboxProcess | None = None
        self.status: ExitStatus | None = None
        self.done = asyncio.Event()
        self._watchers: set[asyncio.Event] = set()
        self._reader: FdReader | None = None
        self._lock = asyncio.Lock()

    def watch(self, event: asyncio.Event) -> None:
        self._watchers.add(event)

    def unwatch(self, event: asyncio.Event) -> None:
        self._watchers.discard(event)

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "session_id": self.session_id,
            "profile": self.profile,
            "clients": self.clients,
            "created_at": rfc3339(self.created_at),
            "offset": self.stream.end,
            "state": self.state.value,
        }

    async def write(self, data: bytes) -> None:
        if self.state is not ShellState.RUNNING or self.process is None:
            raise ResourceConflict("shell has exited")
        assert self.process.pty_fd is not None
        async with self._lock:
            try:
                await write_all(self.process.pty_fd, data)
            except OSError:
                raise ResourceConflict("shell has exited") from None

    def resize(self, cols: int, rows: int) -> None:
        if self.process is not None and self.process.pty_fd is not None:
            with contextlib.suppress(OSError):
                set_winsize(self.process.pty_fd, cols, rows)

    def signal(self, signo: int) -> None:
        if self.process is not None and self.state is ShellState.RUNNING:
            self.process.send_signal(signo)

    def finish(self, status: ExitStatus) -> None:
        if self.state is ShellState.EXITED:
            return
        if self._reader is not None:
            self._reader.close()
        if self.process is not None:
            close_fd(self.process.pty_fd)
            self.process.pty_fd = None
        self.stream.close()
        self.status = status
        self.state = check_transition(self.state, ShellState.EXITED)
        self.done.set()
        for ev in self._watchers:
            ev.set()


class ShellManager:
    def __init__(self, settings: DataplaneSettings, emit: EventSink) -> None:
        self.settings = settings
        self._emit = emit
        self._shells: dict[str, Shell] = {}
        self._starting: dict[str, asyncio.Future[Shell]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: profile → a started, unclaimed shell of it; profiles with a spare being started.
        self._spares: dict[str, Shell] = {}
        self._sparing: set[str] = set()
        self._closed = False

    @property
    def clients(self) -> int:
        return sum(s.clients for s in self._shells.values())

    def all(self) -> list[Shell]:
        return list(self._shells.values())

    def get(self, name: str) -> Shell | None:
        return self._shells.get(name)

    async def open(
        self,
        runtime: SandboxRuntime,
        *,
        name: str,
        profile: str,
        cols: int,
        rows: int,
        create: bool,
        actor: Actor | None,
    ) -> Shell:
        shell = self._shells.get(name)
        if shell is not None and shell.state is ShellState.RUNNING:
            return shell
        pending = self._starting.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        if not create:
            raise ResourceNotFound(f"no shell named {name}")
        if len(self._shells) + len(self._starting) >= self.settings.max_shells:
            raise ResourceConflict("too many shells in this sandbox")
        argv = runtime.template.shells.get(profile)
        if argv is None:
            raise InvalidRequest(f"unknown shell profile {profile!r}")
        fut: asyncio.Future[Shell] = asyncio.get_running_loop().create_future()
        self._starting[name] = fut
        try:
            shell = self._claim_spare(runtime, profile, cols, rows)
            if shell is None:
                try:
                    shell = await self._start(runtime, profile, argv, cols, rows)
                except OSError as exc:
                    raise InvalidRequest(f"cannot start shell: {exc.strerror}") from None
            shell.name = name
            shell.created_at = time.time()
            self._shells[name] = shell
            self._emit(
                "shell.created",
                "shell",
                {
                    "name": name,
                    "session_id": shell.session_id,
                    "profile": profile,
                    "status": "created",
                },
                actor,
            )
            fut.set_result(shell)
            self._replenish(runtime, profile, argv, cols, rows)
            return shell
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: waiters re-raise it themselves
            raise
        finally:
            self._starting.pop(name, None)

    async def _start(
        self, runtime: SandboxRuntime, profile: str, argv: list[str], cols: int, rows: int
    ) -> Shell:
        """Start ``argv`` under a PTY, its output read into a new (still unnamed) shell."""
        process = await runtime.spawn(ProcessSpec(argv=list(argv), cwd=WORKSPACE, pty=(cols, rows)))
        shell = Shell("", profile, self.settings, runtime)
        shell.process = process
        assert process.pty_fd is not None
        shell._reader = FdReader(process.pty_fd, shell.stream)
        self._spawn(self._supervise(shell))
        return shell

    def _claim_spare(
        self, runtime: SandboxRuntime, profile: str, cols: int, rows: int
    ) -> Shell | None:
        shell = self._spares.pop(profile, None)
        if shell is None:
            return None
        process = shell.process
        if (
            shell.runtime is not runtime
            or shell.state is not ShellState.RUNNING
            or process is None
            or process.returncode is not None
        ):
            shell.signal(signals.SIGKILL)
            return None
        shell.resize(cols, rows)
        return shell

    def _replenish(
        self, runtime: SandboxRuntime, profile: str, argv: list[str], cols: int, rows: int
    ) -> None:
        """Start a spare of ``profile`` in the background unless one is there or coming."""
        if (
            not self.settings.spare_shells
            or self._closed
            or profile in self._spares
            or profile in self._sparing
        ):
            return
        self._sparing.add(profile)

        async def start() -> None:
            try:
                shell = await self._start(runtime, profile, argv, cols, rows)
            except Exception as exc:  # the next open starts its own shell and says why
                log.debug("no spare %s shell: %s", profile, exc)
                return
            finally:
                self._sparing.discard(profile)
            if self._closed:
                shell.signal(signals.SIGKILL)
            else:
                self._spares[profile] = shell

        self._spawn(start())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, held until it ends (``close`` cancels it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _supervise(self, shell: Shell) -> None:
        assert shell.process is not None
        status = await shell.process.wait()
        # Let the last output reach the buffer before telling clients.
        with contextlib.suppress(TimeoutError):
            waiter = asyncio.Event()
            shell.stream.listen(waiter)
            try:
                deadline = time.monotonic() + 0.5
                while not shell.stream.eof and time.monotonic() < deadline:
                    waiter.clear()
                    await asyncio.wait_for(waiter.wait(), deadline - time.monotonic())
            finally:
                shell.stream.unlisten(waiter)
        shell.finish(status)
        if not shell.name:  # a spare that exited unclaimed: nobody knew of it
            if self._spares.get(shell.profile) is shell:
                del self._spares[shell.profile]
            return
        if self._shells.get(shell.name) is shell:
            del self._shells[shell.name]
        self._emit(
            "shell.exited",
            "shell",
            {
                "name": shell.name,
                "session_id": shell.session_id,
                "exit_code": status.exit_code,
                "status": "exited",
            },
            None,
        )

    def attached(self, shell: Shell, actor: Actor | None, role: str) -> None:
        shell.clients += 1
        self._emit(
            "shell.attached",
            "shell",
            {
                "name": shell.name,
                "session_id": shell.session_id,
                "role": role,
                "status": "attached",
            },
            actor,
        )

    def detached(self, shell: Shell, actor: Actor | None, role: str) -> None:
        shell.clients -= 1
        self._emit(
            "shell.detached",
            "shell",
            {
                "name": shell.name,
                "session_id": shell.session_id,
                "role": role,
                "status": "detached",
            },
            actor,
        )

    async def delete(self, name: str) -> None:
        shell = self._shells.get(name)
        if shell is None:
            raise ResourceNotFound(f"no shell named {name}")
        shell.signal(signals.SIGHUP)
        shell.signal(signals.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(shell.done.wait(), 2.0)

    async def close(self) -> None:
        self._closed = True
        shells = [*self._shells.values(), *self._spares.values()]
        for shell in shells:
            shell.signal(signals.SIGKILL)
        if shells:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in shells)), 2.0)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for shell in list(self._shells.values()):
            shell.finish(ExitStatus(exit_code=137, signal="SIGKILL"))
        self._shells.clear()

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

Where the runtime keeps processes through a restart of the server, shells
(spares included) are started kept, their output spooled like a command's
(:mod:`sandlot.dataplane.services.spool`): a restarted server takes each named shell
over with its name, session id, offset and history, and ends the spares.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal as signals
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from sandlot.dataplane.services.execs import EventSink
from sandlot.dataplane.services.procio import READ_SIZE, FdReader, close_fd, write_all
from sandlot.dataplane.services.spool import SpoolFile, SpoolReader
from sandlot.dataplane.services.streams import OutputStream
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.common import Actor, new_id, rfc3339
from sandlot.protocol.dataplane import ShellSnapshot
from sandlot.protocol.errors import InvalidRequest, ResourceConflict, ResourceNotFound
from sandlot.protocol.states import ShellState, check_transition
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
        #: Of a kept shell: the init's tag for it, its spool, the pipe its output crosses.
        self.tag: int | None = None
        self.spool: SpoolFile | None = None
        self.pipe: tuple[int, int] | None = None

    def record(self) -> bytes:
        """What the init keeps for this shell (an unnamed one is a spare)."""
        return json.dumps(
            {
                "kind": "shell",
                "name": self.name,
                "session_id": self.session_id,
                "profile": self.profile,
                "created_at": self.created_at,
            },
            separators=(",", ":"),
        ).encode()

    def read_output(self, process: SandboxProcess) -> None:
        assert process.pty_fd is not None
        self.process = process
        if self.spool is not None and self.pipe is not None:
            self._reader = SpoolReader(
                self.pipe[0], self.stream, self.spool, master=process.pty_fd, pipe_in=self.pipe[1]
            )
        else:
            self._reader = FdReader(process.pty_fd, self.stream)

    def release_fds(self) -> None:
        """Close the server's fds of the shell (the process itself is not signalled)."""
        if self._reader is not None:
            self._reader.close()
        if self.process is not None:
            close_fd(self.process.pty_fd)
            self.process.pty_fd = None
        if self.pipe is not None:
            close_fd(self.pipe[0])
            close_fd(self.pipe[1])
            self.pipe = None
        if self.spool is not None:
            self.spool.close()

    def watch(self, event: asyncio.Event) -> None:
        self._watchers.add(event)

    def unwatch(self, event: asyncio.Event) -> None:
        self._watchers.discard(event)

    def snapshot(self) -> ShellSnapshot:
        return ShellSnapshot(
            name=self.name,
            session_id=self.session_id,
            profile=self.profile,
            clients=self.clients,
            created_at=rfc3339(self.created_at) or "",
            offset=self.stream.end,
            state=self.state.value,
        )

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
        self.release_fds()
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
        self._runtime: SandboxRuntime | None = None

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
            if shell.tag is not None:
                # Named before anyone uses it: a restart now finds it by its name.
                try:
                    await runtime.update_record(shell.tag, shell.record())
                except OSError:
                    shell.signal(signals.SIGKILL)
                    raise InvalidRequest("cannot start shell: the sandbox is going away") from None
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
        shell = Shell("", profile, self.settings, runtime)
        keep = self._prepare_keep(runtime, shell)
        spec = ProcessSpec(argv=list(argv), cwd=WORKSPACE, pty=(cols, rows))
        try:
            process = await runtime.spawn(spec, keep)
        except BaseException:
            shell.release_fds()
            if shell.spool is not None:
                shell.spool.remove()
            raise
        shell.read_output(process)
        self._spawn(self._supervise(shell))
        return shell

    def _prepare_keep(self, runtime: SandboxRuntime, shell: Shell) -> Keep | None:
        spool_dir = runtime.spool_dir
        if not runtime.keeps_processes or spool_dir is None:
            return None
        self._runtime = runtime
        spool_dir.mkdir(mode=0o700, exist_ok=True)
        shell.spool = SpoolFile(
            spool_dir / f"{shell.session_id}.pty",
            keep_head=0,
            keep_tail=self.settings.shell_buffer_bytes + 2 * READ_SIZE,
            create=True,
        )
        shell.tag = secrets.randbits(63) or 1
        shell.pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        return Keep(shell.tag, shell.record(), shell.pipe)

    def _discard(self, shell: Shell) -> None:
        """An ended shell: its spool goes, and the init forgets it."""
        if shell.spool is not None:
            shell.spool.remove()
        if shell.tag is not None and self._runtime is not None:
            runtime, tag = self._runtime, shell.tag

            async def forget() -> None:
                try:
                    await runtime.forget(tag)
                except Exception as exc:  # the sandbox may be gone meanwhile
                    log.debug("could not forget shell %s: %s", shell.name, exc)

            self._spawn(forget())

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
        self._discard(shell)
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

    async def readopt(self, runtime: SandboxRuntime, kept: list[KeptProcess]) -> None:
        """Take over the shells a previous server left running in the sandbox."""
        spool_dir = runtime.spool_dir
        if spool_dir is None:
            return
        self._runtime = runtime
        known = {s.session_id for s in self._shells.values()}
        known |= {s.session_id for s in self._spares.values()}
        for k in kept:
            try:
                info = json.loads(k.record)
            except ValueError:
                continue
            if not isinstance(info, dict) or info.get("kind") != "shell":
                continue
            if info.get("session_id") in known:
                continue
            try:
                await self._readopt_one(runtime, spool_dir, k, info)
            except (OSError, LookupError, KeyError, TypeError, ValueError) as exc:
                log.warning("could not take over shell %s: %s", info.get("name"), exc)

    async def _readopt_one(
        self, runtime: SandboxRuntime, spool_dir: Path, k: KeptProcess, info: dict[str, Any]
    ) -> None:
        process = await runtime.adopt(k.tag)
        held = process.held + [-1] * 3
        name = str(info.get("name") or "")
        if not name or name in self._shells:
            # A spare nobody claimed (or a duplicate): end it.
            process.send_signal(signals.SIGKILL)
            for fd in held:
                close_fd(fd if fd >= 0 else None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 2.0)
            await runtime.forget(k.tag)
            with contextlib.suppress(FileNotFoundError):
                (spool_dir / f"{info.get('session_id')}.pty").unlink()
            return
        shell = Shell(name, str(info["profile"]), self.settings, runtime)
        shell.session_id = str(info["session_id"])
        shell.created_at = float(info["created_at"])
        shell.tag = k.tag
        shell.spool = SpoolFile(
            spool_dir / f"{shell.session_id}.pty",
            keep_head=0,
            keep_tail=self.settings.shell_buffer_bytes + 2 * READ_SIZE,
            create=False,
        )
        shell.spool.restore(shell.stream)
        self._shells[name] = shell
        if held[0] >= 0 and held[1] >= 0 and held[2] >= 0:
            shell.pipe = (held[0], held[1])
            process.pty_fd = held[2]
            shell.read_output(process)
        else:
            shell.process = process
            shell.stream.close()
        self._spawn(self._supervise(shell))

    async def close(self, *, detach: bool = False) -> None:
        """End the shells; with ``detach`` (the server stops), kept named ones go on."""
        self._closed = True
        if detach:
            for shell in list(self._shells.values()):
                if shell.tag is not None and shell.state is ShellState.RUNNING:
                    shell.release_fds()
                    del self._shells[shell.name]
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

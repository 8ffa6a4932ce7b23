"""Everything the dataplane keeps for one sandbox, and its open connections.

:class:`SandboxEntry` holds a sandbox's state, event log, commands and shells for as
long as the sandbox is registered; :meth:`SandboxEntry.ready` hands the routes its
:class:`SandboxServices` (the runtime and the file services over it) once it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from sandlot.dataplane.services import native
from sandlot.dataplane.services.archives import TransferPool
from sandlot.dataplane.services.diskfull import DiskMonitor
from sandlot.dataplane.services.events import EventLog, WorkspaceWatcher
from sandlot.dataplane.services.execs import ExecManager
from sandlot.dataplane.services.fsids import FsExecutor, as_server
from sandlot.dataplane.services.fsops import Change, FileOps
from sandlot.dataplane.services.paths import PathResolver
from sandlot.dataplane.services.shells import ShellManager
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.common import Actor
from sandlot.protocol.errors import SandboxNotFound, SandboxStarting
from sandlot.protocol.states import SandboxState
from sandlot.runtime.base import SandboxRuntime

#: Closes one connection with a WebSocket close code (SSE streams just end).
Closer = Callable[[int, str], Coroutine[Any, Any, None]]


class Connection:
    def __init__(self, jti: str | None, closer: Closer) -> None:
        self.jti = jti
        self.closer = closer
        self.timer: asyncio.TimerHandle | None = None
        self.closing = False

    def close(self, code: int, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
        task = asyncio.get_running_loop().create_task(self.closer(code, reason))
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task[Any]] = set()


@dataclass(frozen=True, slots=True)
class SandboxServices:
    """What a running sandbox offers: its runtime, and files served through it."""

    runtime: SandboxRuntime
    #: Sandbox paths to host files, confined to the sandbox's mounts.
    resolver: PathResolver
    #: Threads acting as the sandbox user (``light``: quick calls, ``heavy``: walks).
    executor: FsExecutor
    files: FileOps
    #: Threads of the sandbox's archive transfers (a few at once).
    transfers: TransferPool


class SandboxEntry:
    def __init__(
        self,
        sandbox_id: str,
        generation: int,
        state: SandboxState,
        settings: DataplaneSettings,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.generation = generation
        self.state = state
        self.settings = settings
        self.runtime: SandboxRuntime | None = None
        self.services: SandboxServices | None = None
        self.events = EventLog(sandbox_id, settings.event_retention, lambda: self.state.value)
        self.execs = ExecManager(settings, self.emit)
        self.shells = ShellManager(settings, self.emit)
        self.watcher: WorkspaceWatcher | None = None
        self.disk: DiskMonitor | None = None
        self.connections: set[Connection] = set()
        self.last_active_at: float | None = None
        self.readopted = False

    def emit(
        self, event_type: str, kind: str, details: dict[str, Any], actor: Actor | None = None
    ) -> int:
        return self.events.append(event_type, kind, details, actor)

    def touch(self) -> None:
        self.last_active_at = time.time()

    def set_runtime(self, runtime: SandboxRuntime) -> None:
        native.warm()  # the C file operations (loaded once; the host loads them at start)
        old = self.services
        self.runtime = runtime
        if runtime.spool_dir is not None:
            # The event log outlives this server where the sandbox's work does.
            self.events.attach(runtime.spool_dir)
        resolver = PathResolver(runtime.mounts())
        s = self.settings
        charge = runtime.helper_charge()
        files = FileOps(
            resolver,
            max_read_bytes=s.max_read_bytes,
            max_write_bytes=s.max_write_bytes,
            max_list_entries=s.max_list_entries,
            max_glob_results=s.max_glob_results,
            glob_deadline_seconds=s.glob_deadline_seconds,
            # Called from threads acting as the sandbox user; cgroup files are the server's.
            charge=(as_server(charge.enter), as_server(charge.leave)) if charge else None,
            max_glob_visits=s.max_glob_visits,
        )
        transfers = TransferPool(runtime.fs_ids, s.max_archive_transfers)
        executor = FsExecutor(runtime.fs_ids)
        self.services = SandboxServices(runtime, resolver, executor, files, transfers)
        if old is not None:
            old.resolver.close()
            old.executor.shutdown()
            old.transfers.shutdown()
        if s.watch_fs and self.watcher is None:
            with contextlib.suppress(LookupError):
                self.watcher = WorkspaceWatcher(
                    runtime.workspace,
                    resolver.host_to_sandbox,
                    resolver.sandbox_to_host,
                    self.events,
                    s.watch_debounce_ms,
                )
        if runtime.disk_usage() is not None:
            if self.disk is None:
                self.disk = DiskMonitor(runtime.disk_usage, self.emit)
            self.disk.usage = runtime.disk_usage
        self._start_watcher()

    def _start_watcher(self) -> None:
        # A provider may hand the runtime over before the loop runs: start on first use.
        with contextlib.suppress(RuntimeError):
            if self.watcher is not None:
                self.watcher.start()
            if self.disk is not None:
                self.disk.start()

    def ready(self) -> SandboxServices:
        """The runtime and file services, or 423 SANDBOX_STARTING while provisioning."""
        services = self.services
        if services is None or self.state is SandboxState.PROVISIONING:
            raise SandboxStarting(
                "sandbox is starting", retry_after=self.settings.starting_retry_after
            )
        if not self.state.live:
            raise SandboxNotFound("sandbox is no longer running")
        if self.state is SandboxState.SUSPENDED:
            raise SandboxStarting(
                "sandbox is suspended", retry_after=self.settings.starting_retry_after
            )
        self._start_watcher()
        return services

    def changed(self, change: Change, actor: Actor | None) -> None:
        path, op, extra = change
        if self.watcher is not None:
            self.watcher.api_changed(path)
            if op == "moved" and "from" in extra:
                self.watcher.api_changed(extra["from"])
        self.emit(f"fs.{op}", "fs", {"path": path, "op": op, "source": "api", **extra}, actor)

    def add_connection(self, conn: Connection, expires_at: float | None, leeway: float) -> None:
        self.connections.add(conn)
        if expires_at is not None:
            delay = max(0.0, expires_at + leeway - time.time())
            conn.timer = asyncio.get_running_loop().call_later(
                delay, conn.close, 4401, "token expired"
            )

    def remove_connection(self, conn: Connection) -> None:
        self.connections.discard(conn)
        if conn.timer is not None:
            conn.timer.cancel()

    async def readopt(self) -> None:
        """Take over what a previous server left running here (once; see ``execs``)."""
        runtime = self.runtime
        if self.readopted or runtime is None or not runtime.keeps_processes:
            return
        self.readopted = True
        kept = await runtime.kept()
        await self.execs.readopt(runtime, kept)
        await self.shells.readopt(runtime, kept)

    async def close(self, *, detach: bool = False) -> None:
        """Close connections and end the sandbox's work (``detach``: kept work goes on)."""
        for conn in list(self.connections):
            conn.close(1001, "sandbox closed")
        await self.execs.close(detach=detach)
        await self.shells.close(detach=detach)
        if self.watcher is not None:
            await self.watcher.close()
        if self.disk is not None:
            self.disk.close()
        self.events.close()
        if self.services is not None:
            self.services.resolver.close()
            self.services.executor.shutdown()
            self.services.transfers.shutdown()

"""Everything the dataplane keeps for one sandbox, and its open connections."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

from sandlot.dataplane import native
from sandlot.dataplane.diskfull import DiskMonitor
from sandlot.dataplane.events import EventLog, WorkspaceWatcher
from sandlot.dataplane.execs import ExecManager
from sandlot.dataplane.fsids import FsExecutor, as_server
from sandlot.dataplane.fsops import Change, FileOps
from sandlot.dataplane.paths import PathResolver
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.dataplane.shells import ShellManager
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
        self.resolver: PathResolver | None = None
        self.executor: FsExecutor | None = None
        self.files: FileOps | None = None
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
        native.warm()  # the C file operations, built in the background once
        old_resolver, old_executor = self.resolver, self.executor
        self.runtime = runtime
        if runtime.spool_dir is not None:
            # The event log outlives this server where the sandbox's work does.
            self.events.attach(runtime.spool_dir)
        self.resolver = PathResolver(runtime.mounts())
        self.executor = FsExecutor(runtime.fs_ids)
        s = self.settings
        charge = runtime.helper_charge()
        self.files = FileOps(
            self.resolver,
            max_read_bytes=s.max_read_bytes,
            max_write_bytes=s.max_write_bytes,
            max_list_entries=s.max_list_entries,
            max_glob_results=s.max_glob_results,
            glob_deadline_seconds=s.glob_deadline_seconds,
            # Called from threads acting as the sandbox user; cgroup files are the server's.
            charge=(as_server(charge.enter), as_server(charge.leave)) if charge else None,
            max_glob_visits=s.max_glob_visits,
        )
        if old_resolver is not None:
            old_resolver.close()
        if old_executor is not None:
            old_executor.shutdown()
        if s.watch_fs and self.watcher is None:
            with contextlib.suppress(LookupError):
                self.watcher = WorkspaceWatcher(
                    runtime.workspace,
                    self.resolver.host_to_sandbox,
                    self.resolver.sandbox_to_host,
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

    def ready(self) -> tuple[SandboxRuntime, PathResolver, FsExecutor, FileOps]:
        """The runtime and file services, or 423 SANDBOX_STARTING while provisioning."""
        if (
            self.runtime is None
            or self.resolver is None
            or self.executor is None
            or self.files is None
            or self.state is SandboxState.PROVISIONING
        ):
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
        return self.runtime, self.resolver, self.executor, self.files

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
        if self.resolver is not None:
            self.resolver.close()
        if self.executor is not None:
            self.executor.shutdown()

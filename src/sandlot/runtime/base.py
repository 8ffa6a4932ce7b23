"""The runtime contract: one running sandbox, as the dataplane uses it.

A :class:`SandboxRuntime` knows how to start processes *inside* the sandbox
(namespaces, cgroup, seccomp and uid of the sandbox for the isolated local
runtime; plain subprocesses for the ``unisolated`` mode and for a dataplane
running directly inside a remote container) and how sandbox paths map to host
directories, so that file operations can be done natively and confined.
"""

from __future__ import annotations

import abc
import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.protocol.states import SandboxState
from sandlot.protocol.templates import Template
from sandlot.runtime.tools import LIMIT, TOOLS, TOOLS_DIR, ToolUnavailable, limited_argv

#: The sandbox's home, default working directory, and what relative paths resolve from.
WORKSPACE = "/workspace"


@dataclass(frozen=True)
class Mount:
    """A sandbox path prefix backed by a host directory."""

    sandbox_path: str
    host_path: Path
    writable: bool


@dataclass(frozen=True)
class ProcessSpec:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    #: Absolute path inside the sandbox.
    cwd: str = WORKSPACE
    #: ``(cols, rows)`` to run under a pseudo-terminal; ``None`` for pipes.
    pty: tuple[int, int] | None = None


@dataclass(frozen=True)
class ExitStatus:
    #: Shell convention: 128 + signal number when killed by a signal.
    exit_code: int
    #: Signal name (``SIGKILL``) when killed by one.
    signal: str | None = None
    #: The kernel's OOM killer ended it (cgroup memory limit).
    oom_killed: bool = False


@dataclass(frozen=True)
class Keep:
    """Ask the runtime to keep a process through a restart of the server.

    ``tag`` names it (unique in the sandbox); ``record`` is the server's own
    bookkeeping, handed back by :meth:`SandboxRuntime.kept`; ``hold`` are fds
    of the server's that must stay open while the server is gone (they come
    back, after the process's own pipe ends in pipe mode, in
    :attr:`SandboxProcess.held` of the adopted process).
    """

    tag: int
    record: bytes
    hold: tuple[int, ...] = ()


@dataclass(frozen=True)
class KeptProcess:
    """A kept process as a restarted server finds it: still running, or its exit status."""

    tag: int
    pid: int
    status: ExitStatus | None
    record: bytes


class SandboxProcess(abc.ABC):
    """A process started in a sandbox. File descriptors are owned by the caller.

    Pipes mode: ``stdin_fd`` (write end), ``stdout_fd`` and ``stderr_fd`` (read
    ends). PTY mode: ``pty_fd`` (the master) carries input and output; the
    three others are ``None``. All fds are non-blocking and close-on-exec.
    """

    pid: int
    stdin_fd: int | None
    stdout_fd: int | None
    stderr_fd: int | None
    pty_fd: int | None
    #: Of an adopted kept process: the fds the runtime held for the server.
    held: list[int]

    def release(self, index: int = -1) -> None:  # noqa: B027 - optional
        """Let the runtime close its copy of held fd ``index`` (``-1``: all of them)."""

    @abc.abstractmethod
    async def wait(self) -> ExitStatus:
        """Wait for the exit; may be awaited by several tasks."""

    @abc.abstractmethod
    def send_signal(self, signo: int) -> None:
        """Signal the process group of the process (no error if it is gone)."""

    @property
    @abc.abstractmethod
    def returncode(self) -> int | None: ...


@dataclass(frozen=True)
class HelperCharge:
    """``enter(pid)`` moves a helper process into the sandbox's cgroup, under its CPU, memory
    and pid limits, for the time it works for the sandbox; ``leave(pid)`` moves it back to
    the server's. Either raises ``OSError`` when the move is refused."""

    enter: Callable[[int], None]
    leave: Callable[[int], None]


class SandboxRuntime(abc.ABC):
    """One running sandbox on this host."""

    sandbox_id: str
    generation: int
    template: Template

    @property
    @abc.abstractmethod
    def state(self) -> SandboxState: ...

    @abc.abstractmethod
    def mounts(self) -> list[Mount]:
        """Path mapping for native file operations; the longest prefix wins."""

    @property
    def fs_ids(self) -> tuple[int, int] | None:
        """Host ``(uid, gid)`` file operations must act as (``None``: the server's own)."""
        return None

    @property
    def workspace(self) -> Path:
        for m in self.mounts():
            if m.sandbox_path == WORKSPACE:
                return m.host_path
        raise LookupError("runtime has no workspace mount")

    def disk_usage(self) -> tuple[int, int] | None:
        """``(size, free)`` in bytes of the sandbox's size-limited disk (``None``: no limit)."""
        return None

    def helper_charge(self) -> HelperCharge | None:
        """How a server helper process working for this sandbox (a glob walk) is charged to
        it while it works (``None``: the sandbox has no cgroup to charge)."""
        return None

    @abc.abstractmethod
    async def spawn(self, spec: ProcessSpec, keep: Keep | None = None) -> SandboxProcess:
        """Start a process inside the sandbox, in a new session and process group.

        With ``keep``, where :attr:`keeps_processes`, the process and its pipes
        survive the server (see :class:`Keep`); elsewhere ``keep`` is ignored.
        """

    @property
    def keeps_processes(self) -> bool:
        """Whether processes started with ``keep`` outlive the server."""
        return False

    @property
    def spool_dir(self) -> Path | None:
        """A host directory of the server's, outside the sandbox, kept with it (or ``None``)."""
        return None

    async def kept(self) -> list[KeptProcess]:
        """Processes kept for the server (see :class:`Keep`), running or exited."""
        return []

    async def adopt(self, tag: int) -> SandboxProcess:
        """Take over the kept process ``tag``; its held fds are in ``held``."""
        raise LookupError(f"no kept process {tag}")

    async def forget(self, tag: int) -> None:  # noqa: B027 - optional
        """Drop the kept process ``tag``'s record and held fds."""

    async def release_held(self, tag: int) -> None:  # noqa: B027 - optional
        """Let the runtime close the fds it holds for the kept process ``tag``."""

    async def update_record(self, tag: int, record: bytes) -> None:  # noqa: B027 - optional
        """Replace the record kept with process ``tag``."""

    async def spawn_tool(
        self,
        tool: str,
        args: list[str],
        *,
        cwd: str,
        cwd_fd: int | None = None,
        deadline: float,
    ) -> SandboxProcess:
        """Start the helper program ``tool`` (``"rg"``) on the sandbox's behalf, with pipes.

        It runs where the sandbox's commands run (namespaces, cgroup, uid, limits), in
        ``cwd`` (a sandbox path; ``cwd_fd``, the same directory opened by the server, is
        used instead by a runtime that shares the server's view of files, so that nothing
        swapped in meanwhile redirects it). It is killed ``deadline`` seconds after its
        start, as soon as nobody reads its stdout (the server died or is done with it) and
        with its parent, whether or not the server is there to kill it (``limit.c``).

        This default runs both from :data:`~sandlot.runtime.tools.TOOLS_DIR` through
        :meth:`spawn`, for a runtime that binds them there (the isolated one). Raises
        :class:`~sandlot.runtime.tools.ToolUnavailable` for a tool it does not provide.
        """
        if tool not in TOOLS:
            raise ToolUnavailable(errno.ENOENT, f"no helper program {tool!r}")
        argv = limited_argv(f"{TOOLS_DIR}/{LIMIT}", f"{TOOLS_DIR}/{tool}", args, deadline)
        return await self.spawn(ProcessSpec(argv=argv, cwd=cwd))

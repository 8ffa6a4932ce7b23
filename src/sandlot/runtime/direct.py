"""Direct execution: plain subprocesses in a workspace directory.

Used for the explicit ``unisolated`` mode of the local provider (machines
without namespaces; loud warning on every start) and by a dataplane running
inside a remote container, where the container itself is the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import signal
import struct
import subprocess
import termios
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandlot.protocol.states import SandboxState
from sandlot.protocol.templates import Template
from sandlot.runtime.base import (
    WORKSPACE,
    ExitStatus,
    Keep,
    Mount,
    ProcessSpec,
    SandboxProcess,
    SandboxRuntime,
)
from sandlot.runtime.tools import RIPGREP, ToolUnavailable, host_limit, host_ripgrep, limited_argv


def exit_status_from_returncode(returncode: int) -> ExitStatus:
    if returncode < 0:
        signo = -returncode
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"SIG{signo}"
        return ExitStatus(exit_code=128 + signo, signal=name)
    return ExitStatus(exit_code=returncode)


#: The children this process started (a :class:`DirectProcess` collects its own exit),
#: and a lock held from a fork until its pid is in the set: :func:`reap_orphans` never
#: takes an exit that is another's to read.
_started: set[int] = set()
_spawning = threading.Lock()


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    with _spawning:
        popen = subprocess.Popen(argv, **kwargs)
        _started.add(popen.pid)
    return popen


def reap_orphans() -> int:
    """Collect the children of this process that exited and that it did not start itself.

    When it is its container's init (PID 1), the processes the sandbox's commands leave
    behind become its children, and each that exits stays a zombie, holding one of the
    container's pids, until collected. A child it started is left to whoever waits for it:
    one of :func:`spawn_direct`, or a helper in its own session (a glob worker). Returns
    how many were collected."""
    me, session = os.getpid(), os.getsid(0)
    reaped = 0
    with _spawning:
        for pid in _children(me):
            if pid in _started:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            # After the command's name: state, ppid, process group, session.
            state, ppid, _, sid = stat[stat.rindex(b")") + 2 :].split()[:4]
            if state != b"Z" or int(ppid) != me or int(sid) == session:
                continue
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    reaped += 1
    return reaped


def _children(me: int) -> list[int]:
    """The children of this process's main thread (orphans are given to it), or every
    process where the kernel does not list them."""
    try:
        with open(f"/proc/{me}/task/{me}/children", "rb") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class DirectProcess(SandboxProcess):
    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        *,
        stdin_fd: int | None,
        stdout_fd: int | None,
        stderr_fd: int | None,
        pty_fd: int | None,
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.held = []
        self.stdin_fd, self.stdout_fd, self.stderr_fd, self.pty_fd = (
            stdin_fd,
            stdout_fd,
            stderr_fd,
            pty_fd,
        )
        self._exit: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        #: What the exit status becomes once known (the runtime may add what it knows).
        self.on_exit: Callable[[ExitStatus], ExitStatus] | None = None
        self._pidfd = os.pidfd_open(popen.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        rc = self._popen.poll()
        if rc is None:
            return
        _started.discard(self.pid)
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exit.done():
            status = exit_status_from_returncode(rc)
            self._exit.set_result(self.on_exit(status) if self.on_exit is not None else status)

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self._exit)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def send_signal(self, signo: int) -> None:
        if self._popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signo)


def _nonblocking(fd: int) -> int:
    os.set_blocking(fd, False)
    os.set_inheritable(fd, False)
    return fd


async def spawn_direct(
    spec: ProcessSpec,
    *,
    cwd: Path,
    base_env: dict[str, str],
) -> DirectProcess:
    """Start ``spec`` as a plain subprocess in its own session and process group."""
    env = {**base_env, **spec.env}
    if spec.pty is not None:
        master, slave = os.openpty()
        set_winsize(master, *spec.pty)
        env.setdefault("TERM", "xterm-256color")
        try:
            popen = _popen(
                spec.argv,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                cwd=cwd,
                env=env,
                start_new_session=True,
                # The new session needs the pty as its controlling terminal for job control.
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
                close_fds=True,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return DirectProcess(
            popen, stdin_fd=None, stdout_fd=None, stderr_fd=None, pty_fd=_nonblocking(master)
        )
    return _spawn_pipes(spec.argv, cwd=cwd, env=env)


def _spawn_pipes(
    argv: list[str], *, cwd: Path | str, env: dict[str, str], **popen: Any
) -> DirectProcess:
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = _popen(
            argv,
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            cwd=cwd,
            env=env,
            start_new_session=True,
            close_fds=True,
            **popen,
        )
    except BaseException:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    return DirectProcess(
        proc,
        stdin_fd=_nonblocking(in_w),
        stdout_fd=_nonblocking(out_r),
        stderr_fd=_nonblocking(err_r),
        pty_fd=None,
    )


@functools.cache
def _prctl() -> Any:
    return ctypes.CDLL(None, use_errno=True).prctl


def _die_with_server(server: int) -> Callable[[], None]:
    """For the child, before exec: SIGKILL when the server's thread that started it ends
    (``PR_SET_PDEATHSIG``), or at once if the server is gone already."""
    prctl = _prctl()  # looked up before the fork: nothing to load in the child

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != server:
            os._exit(137)

    return preexec


_launcher_checked = False


async def _launcher() -> str | None:
    """The host's ``sandlot-limit`` (checked on a thread the first time), or ``None``."""
    global _launcher_checked
    if not _launcher_checked:
        await asyncio.to_thread(host_limit)
        _launcher_checked = True
    return host_limit()


def _oom_aware(counter: Callable[[], int], before: int) -> Callable[[ExitStatus], ExitStatus]:
    def on_exit(status: ExitStatus) -> ExitStatus:
        # A shell's child killed is the shell's exit code 137.
        killed = status.signal == "SIGKILL" or status.exit_code == 137
        if killed and counter() > before:
            return ExitStatus(exit_code=status.exit_code, signal=status.signal, oom_killed=True)
        return status

    return on_exit


class DirectRuntime(SandboxRuntime):
    """A 'sandbox' that is only a workspace directory: no isolation at all.

    Sandbox paths under ``/workspace`` map to ``workspace``; every other
    absolute path maps to the same host path (there is nothing to confine to
    but the host itself, which is exactly why this mode warns loudly).
    """

    def __init__(
        self,
        sandbox_id: str,
        generation: int,
        template: Template,
        workspace: Path,
        *,
        tmp: Path | None = None,
        oom_score_adj: int | None = None,
        oom_kills: Callable[[], int] | None = None,
        spool: Path | None = None,
        disk: bool = False,
    ) -> None:
        """``oom_score_adj``: raise the commands' (and tools') score, so that when the
        sandbox runs out of memory the kernel kills them rather than the dataplane that
        shares their cgroup (a container's). ``oom_kills``: how many processes the OOM
        killer ended in that cgroup so far; a command killed by SIGKILL while it rose is
        reported ``oom_killed``. ``spool``: a directory that outlives the process (the
        event log is kept there). ``disk``: the workspace is a size-limited filesystem of
        its own (a container's workspace disk), watched as a local sandbox's disk is."""
        self.oom_score_adj = oom_score_adj
        self._oom_kills = oom_kills
        self._spool = spool
        self._disk = disk
        self.sandbox_id = sandbox_id
        self.generation = generation
        self.template = template
        self._workspace = workspace
        self._tmp = tmp
        self._state = SandboxState.ACTIVE

    @property
    def state(self) -> SandboxState:
        return self._state

    @state.setter
    def state(self, value: SandboxState) -> None:
        self._state = value

    def mounts(self) -> list[Mount]:
        mounts = [Mount(WORKSPACE, self._workspace, True)]
        if self._tmp is not None:
            mounts.append(Mount("/tmp", self._tmp, True))
        return mounts

    def _host_cwd(self, cwd: str) -> Path:
        if cwd == WORKSPACE or cwd.startswith(WORKSPACE + "/"):
            return self._workspace / cwd[len(WORKSPACE) :].lstrip("/")
        return Path(cwd)

    def _base_env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self._workspace),
            "LANG": "C.UTF-8",
            **self.template.env,
        }

    def disk_usage(self) -> tuple[int, int] | None:
        if not self._disk:
            return None
        # As DiskManager.usage, without importing the disk module into a container's
        # dataplane, whose start-up is what a new sandbox waits for.
        st = os.statvfs(self._workspace)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    @property
    def spool_dir(self) -> Path | None:
        return self._spool

    async def spawn(self, spec: ProcessSpec, keep: Keep | None = None) -> SandboxProcess:
        counter = self._oom_kills
        before = counter() if counter is not None else 0
        proc = await spawn_direct(spec, cwd=self._host_cwd(spec.cwd), base_env=self._base_env())
        if counter is not None:
            proc.on_exit = _oom_aware(counter, before)
        self._mark_killable(proc.pid)
        return proc

    def _mark_killable(self, pid: int) -> None:
        if self.oom_score_adj is None:
            return
        # Raising a score needs no privilege; what the child forks later inherits it.
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(self.oom_score_adj))

    async def spawn_tool(
        self,
        tool: str,
        args: list[str],
        *,
        cwd: str,
        cwd_fd: int | None = None,
        deadline: float,
    ) -> SandboxProcess:
        """The host's ripgrep as a plain process, under ``sandlot-limit`` (as the sandbox
        user with ``fs_ids``). Without the launcher (not built: no C compiler): with
        ``PR_SET_PDEATHSIG`` only, the deadline then kept by the caller alone."""
        program = host_ripgrep() if tool == RIPGREP else None
        if program is None:
            raise ToolUnavailable(errno.ENOENT, f"{tool} is not installed")
        ids = self.fs_ids
        host_cwd = f"/proc/self/fd/{cwd_fd}" if cwd_fd is not None else self._host_cwd(cwd)
        limit = await _launcher()
        if limit is not None:
            argv = limited_argv(limit, program, args, deadline)
            if ids is not None:
                argv[1:1] = ["--ids", f"{ids[0]}:{ids[1]}"]
            proc = _spawn_pipes(argv, cwd=host_cwd, env=self._base_env())
        else:
            popen: dict[str, Any] = {"preexec_fn": _die_with_server(os.getpid())}
            if ids is not None:
                popen.update(user=ids[0], group=ids[1], extra_groups=[])
            proc = _spawn_pipes([program, *args], cwd=host_cwd, env=self._base_env(), **popen)
        self._mark_killable(proc.pid)
        return proc

"""Direct execution: plain subprocesses in a workspace directory.

Used for the explicit ``unisolated`` mode of the local provider (machines
without namespaces; loud warning on every start) and by a dataplane running
inside a remote container, where the container itself is the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import termios
from pathlib import Path

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.runtime.base import (
    WORKSPACE,
    ExitStatus,
    Keep,
    Mount,
    ProcessSpec,
    SandboxProcess,
    SandboxRuntime,
)


def exit_status_from_returncode(returncode: int) -> ExitStatus:
    if returncode < 0:
        signo = -returncode
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"SIG{signo}"
        return ExitStatus(exit_code=128 + signo, signal=name)
    return ExitStatus(exit_code=returncode)


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
        self._pidfd = os.pidfd_open(popen.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        rc = self._popen.poll()
        if rc is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exit.done():
            self._exit.set_result(exit_status_from_returncode(rc))

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
            popen = subprocess.Popen(
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
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        popen = subprocess.Popen(
            spec.argv,
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            cwd=cwd,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    except BaseException:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    return DirectProcess(
        popen,
        stdin_fd=_nonblocking(in_w),
        stdout_fd=_nonblocking(out_r),
        stderr_fd=_nonblocking(err_r),
        pty_fd=None,
    )


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
    ) -> None:
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

    async def spawn(self, spec: ProcessSpec, keep: Keep | None = None) -> SandboxProcess:
        base_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self._workspace),
            "LANG": "C.UTF-8",
            **self.template.env,
        }
        return await spawn_direct(spec, cwd=self._host_cwd(spec.cwd), base_env=base_env)

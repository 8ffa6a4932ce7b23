"""The server's side of the init's control socket: start, signal and wait for processes.

One SOCK_SEQPACKET connection per process (see the wire format in ``init.c``):
the request carries argv, env, cwd and, in pipe mode, the child's ends of the
stdio pipes; the init answers with the pid (and the pty master, opened inside
the sandbox so that ``tty`` names it), later with the raw wait status.

A *kept* process (:class:`~sandlot.runtime.base.Keep`) outlives the server: the
init also holds the server's ends of its pipes and a record of the server's,
and a restarted server lists, adopts, releases and forgets them by tag.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path

from sandlot.runtime.base import ExitStatus, Keep, KeptProcess, ProcessSpec, SandboxProcess

#: The control protocol of this ``init.c`` (its MAGIC's last byte); 1 kept no process.
INIT_PROTOCOL = 2
MAGIC = 0x32544C53
_LEGACY_MAGIC = 0x31544C53
REQ_SPAWN = 1
REQ_SIGNAL = 2
REQ_LIST = 3
REQ_ADOPT = 4
REQ_RELEASE = 5
REQ_FORGET = 6
REQ_RECORD = 7
FLAG_PTY = 1
RESP_STARTED = 1
RESP_ERROR = 2
RESP_EXIT = 3
RESP_JOB = 4
RESP_END = 5
CHUNK = 32768
MAX_PAYLOAD = 8 << 20
MAX_RECORD = 16384
MAX_HELD = 6

_REQUEST = struct.Struct("=IIIHHiIIIQII")
_LEGACY_REQUEST = struct.Struct("=IIIHHiIII")
_RESPONSE = struct.Struct("=Iiii")
_TAG = struct.Struct("=Q")


class ControlSocketError(OSError):
    """The sandbox's init did not answer (it is gone, or the sandbox is being destroyed)."""


def _encode(spec: ProcessSpec, env: dict[str, str]) -> tuple[bytes, int, int]:
    parts = [spec.cwd, *spec.argv, *(f"{k}={v}" for k, v in env.items())]
    if any("\x00" in p for p in parts):
        raise ValueError("NUL byte in argv, env or cwd")
    payload = b"".join(p.encode() + b"\x00" for p in parts)
    if len(payload) > MAX_PAYLOAD:
        raise ValueError("argv and env too large")
    return payload, len(spec.argv), len(env)


def status_from_wait(raw: int) -> ExitStatus:
    if os.WIFSIGNALED(raw):
        signo = os.WTERMSIG(raw)
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"SIG{signo}"
        return ExitStatus(exit_code=128 + signo, signal=name)
    return ExitStatus(exit_code=os.WEXITSTATUS(raw))


async def _sendmsg(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    loop = asyncio.get_running_loop()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while True:
        try:
            sock.sendmsg([data], ancillary)
            return
        except BlockingIOError:
            waiter = loop.create_future()
            loop.add_writer(sock.fileno(), waiter.set_result, None)
            try:
                await waiter
            finally:
                loop.remove_writer(sock.fileno())


async def _recv_response(sock: socket.socket) -> tuple[tuple[int, int, int, int], int | None]:
    (head, fds, _) = await _recv_full(sock, 0)
    for extra in fds[1:]:
        os.close(extra)
    return head, (fds[0] if fds else None)


async def _recv_full(
    sock: socket.socket, extra: int
) -> tuple[tuple[int, int, int, int], list[int], bytes]:
    """One response: its header, the fds it carried and up to ``extra`` bytes after it."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, ancdata, _, _ = sock.recvmsg(
                _RESPONSE.size + extra,
                socket.CMSG_SPACE(4 * (MAX_HELD + 1)),
                socket.MSG_CMSG_CLOEXEC,
            )
            break
        except BlockingIOError:
            waiter = loop.create_future()
            loop.add_reader(sock.fileno(), waiter.set_result, None)
            try:
                await waiter
            finally:
                loop.remove_reader(sock.fileno())
    fds: list[int] = []
    for level, kind, blob in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(blob[: len(blob) - len(blob) % 4])
            fds += list(got)
    if len(data) < _RESPONSE.size:
        for fd in fds:
            os.close(fd)
        raise ControlSocketError("the sandbox init closed the connection")
    return _RESPONSE.unpack_from(data), fds, data[_RESPONSE.size :]


class InitProcess(SandboxProcess):
    """A process forked by a sandbox's init; ``pid`` is its pid inside the sandbox."""

    def __init__(
        self,
        sock: socket.socket,
        pid: int,
        *,
        stdin_fd: int | None,
        stdout_fd: int | None,
        stderr_fd: int | None,
        pty_fd: int | None,
        on_exit: Callable[[ExitStatus], ExitStatus],
        held: list[int] | None = None,
        legacy: bool = False,
    ) -> None:
        self.pid = pid
        self.held = held or []
        self._legacy = legacy
        self.stdin_fd, self.stdout_fd, self.stderr_fd, self.pty_fd = (
            stdin_fd,
            stdout_fd,
            stderr_fd,
            pty_fd,
        )
        self._sock = sock
        self._on_exit = on_exit
        self._status: ExitStatus | None = None
        self._loop = asyncio.get_running_loop()
        self._exit: asyncio.Future[ExitStatus] = self._loop.create_future()
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data = self._sock.recv(_RESPONSE.size)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if len(data) == _RESPONSE.size:
            kind, _, _, raw = _RESPONSE.unpack(data)
            if kind != RESP_EXIT:
                return
            status = status_from_wait(raw)
        else:
            # The init is gone: the sandbox was destroyed (or died) under the process.
            status = ExitStatus(exit_code=128 + signal.SIGKILL, signal="SIGKILL")
        self._finish(self._on_exit(status))

    def _finish(self, status: ExitStatus) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._status = status
        if not self._exit.done():
            self._exit.set_result(status)

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self._exit)

    @property
    def returncode(self) -> int | None:
        return None if self._status is None else self._status.exit_code

    def send_signal(self, signo: int) -> None:
        if self._status is not None:
            return
        if self._legacy:
            request = _LEGACY_REQUEST.pack(_LEGACY_MAGIC, REQ_SIGNAL, 0, 0, 0, signo, 0, 0, 0)
        else:
            request = _REQUEST.pack(MAGIC, REQ_SIGNAL, 0, 0, 0, signo, 0, 0, 0, 0, 0, 0)
        with contextlib.suppress(OSError):
            self._sock.send(request)

    def release(self, index: int = -1) -> None:
        if self._status is not None or self._legacy:
            return
        request = _REQUEST.pack(MAGIC, REQ_RELEASE, 0, 0, 0, index, 0, 0, 0, 0, 0, 0)
        with contextlib.suppress(OSError):
            self._sock.send(request)


def _nonblocking(fd: int) -> int:
    os.set_blocking(fd, False)
    os.set_inheritable(fd, False)
    return fd


async def _connect(control_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, str(control_path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise ControlSocketError(f"sandbox init not reachable: {exc.strerror}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _simple(kind: int, tag: int = 0) -> bytes:
    return _REQUEST.pack(MAGIC, kind, 0, 0, 0, 0, 0, 0, 0, tag, 0, 0)


async def list_kept(control_path: Path) -> list[KeptProcess]:
    """The kept processes the init holds (running or exited, not yet forgotten)."""
    sock = await _connect(control_path)
    kept: list[KeptProcess] = []
    try:
        await _sendmsg(sock, _simple(REQ_LIST), [])
        while True:
            (kind, pid, exited, raw), fds, extra = await _recv_full(sock, _TAG.size + MAX_RECORD)
            for fd in fds:
                os.close(fd)
            if kind != RESP_JOB:
                break
            (tag,) = _TAG.unpack_from(extra)
            status = status_from_wait(raw) if exited else None
            kept.append(KeptProcess(tag, pid, status, extra[_TAG.size :]))
    finally:
        sock.close()
    return kept


async def record_kept(control_path: Path, tag: int, record: bytes) -> None:
    """Replace the record of the kept process ``tag``."""
    if len(record) > MAX_RECORD:
        raise ValueError("record too large")
    header = _REQUEST.pack(MAGIC, REQ_RECORD, 0, 0, 0, 0, 0, 0, 0, tag, len(record), 0)
    sock = await _connect(control_path)
    try:
        await _sendmsg(sock, header + record, [])
        (kind, *_), _, _ = await _recv_full(sock, 0)
        if kind != RESP_END:
            raise ControlSocketError(f"no kept process {tag}")
    finally:
        sock.close()


async def release_kept(control_path: Path, tag: int, index: int = -1) -> None:
    """Let the init close its copy of held fd ``index`` (``-1``: all) of process ``tag``."""
    header = _REQUEST.pack(MAGIC, REQ_RELEASE, 0, 0, 0, index, 0, 0, 0, tag, 0, 0)
    sock = await _connect(control_path)
    try:
        await _sendmsg(sock, header, [])
        await _recv_full(sock, 0)
    finally:
        sock.close()


async def forget_kept(control_path: Path, tag: int) -> None:
    """Tell the init to drop a kept process's record and held fds (no error if unknown)."""
    sock = await _connect(control_path)
    try:
        await _sendmsg(sock, _simple(REQ_FORGET, tag), [])
        await _recv_full(sock, 0)
    finally:
        sock.close()


async def adopt_kept(
    control_path: Path, tag: int, on_exit: Callable[[ExitStatus], ExitStatus]
) -> InitProcess:
    """Take over a kept process: its held fds come back in :attr:`InitProcess.held`."""
    sock = await _connect(control_path)
    try:
        await _sendmsg(sock, _simple(REQ_ADOPT, tag), [])
        (kind, pid, present, _), fds, _ = await _recv_full(sock, 0)
        if kind != RESP_STARTED:
            for fd in fds:
                os.close(fd)
            raise ControlSocketError(f"no kept process {tag}")
    except BaseException:
        sock.close()
        raise
    # The init sends the fds it still holds, in order; ``present`` says which indexes.
    held: list[int] = []
    got = iter(fds)
    for index in range(MAX_HELD + 1):
        if present >> index & 1:
            held.append(_nonblocking(next(got)))
        elif any(present >> later & 1 for later in range(index, MAX_HELD + 1)):
            held.append(-1)
    return InitProcess(
        sock,
        pid,
        stdin_fd=None,
        stdout_fd=None,
        stderr_fd=None,
        pty_fd=None,
        on_exit=on_exit,
        held=held,
    )


async def spawn_via_init(
    control_path: Path,
    spec: ProcessSpec,
    env: dict[str, str],
    on_exit: Callable[[ExitStatus], ExitStatus],
    keep: Keep | None = None,
    *,
    legacy: bool = False,
) -> InitProcess:
    """Ask the init listening at ``control_path`` to start ``spec``; raises ``OSError``.

    ``legacy``: the init of a sandbox started by an older version (protocol 1: no
    tags, records or held fds, so ``keep`` is ignored; a shorter header).
    """
    payload, nargv, nenv = _encode(spec, env)
    flags, cols, rows = 0, 0, 0
    if spec.pty is not None:
        flags, (cols, rows) = FLAG_PTY, spec.pty
    if legacy:
        keep = None
    tag, record, hold = (keep.tag, keep.record, list(keep.hold)) if keep else (0, b"", [])
    # Pipe mode: the init holds the server's ends of the three pipes, then ``hold``.
    nhold = (len(hold) + (3 if spec.pty is None else 0)) if keep else 0
    if len(record) > MAX_RECORD or nhold > MAX_HELD:
        raise ValueError("record or held fds too large")
    payload += record
    if legacy:
        header = _LEGACY_REQUEST.pack(
            _LEGACY_MAGIC, REQ_SPAWN, flags, cols, rows, 0, nargv, nenv, len(payload)
        )
    else:
        header = _REQUEST.pack(
            MAGIC,
            REQ_SPAWN,
            flags,
            cols,
            rows,
            0,
            nargv,
            nenv,
            len(payload),
            tag,
            len(record),
            nhold,
        )
    ours: list[int] = []
    theirs: list[int] = []
    sock = await _connect(control_path)
    try:
        if spec.pty is None:
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            ours, theirs = [in_w, out_r, err_r], [in_r, out_w, err_w]
        first = CHUNK - len(header)
        await _sendmsg(sock, header + payload[:first], theirs + ours + hold if keep else theirs)
        for offset in range(first, len(payload), CHUNK):
            await _sendmsg(sock, payload[offset : offset + CHUNK], [])
        for fd in theirs:
            os.close(fd)
        theirs = []
        (kind, pid, err, _), master = await _recv_response(sock)
        if kind == RESP_ERROR:
            raise OSError(err, os.strerror(err), spec.argv[0] if spec.argv else None)
        if kind != RESP_STARTED:
            raise ControlSocketError(f"unexpected reply {kind} from the sandbox init")
    except BaseException:
        sock.close()
        for fd in ours + theirs:
            os.close(fd)
        raise
    if spec.pty is not None:
        if master is None:
            sock.close()
            raise ControlSocketError("the sandbox init sent no pty master")
        return InitProcess(
            sock,
            pid,
            stdin_fd=None,
            stdout_fd=None,
            stderr_fd=None,
            pty_fd=_nonblocking(master),
            on_exit=on_exit,
            legacy=legacy,
        )
    in_w, out_r, err_r = ours
    return InitProcess(
        sock,
        pid,
        stdin_fd=_nonblocking(in_w),
        stdout_fd=_nonblocking(out_r),
        stderr_fd=_nonblocking(err_r),
        pty_fd=None,
        on_exit=on_exit,
        legacy=legacy,
    )

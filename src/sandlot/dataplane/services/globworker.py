"""Globs run in helper processes, never in the server's interpreter.

A glob walks a tree and matches a user's pattern against every name in it: work
in Python, proportional to the tree, which a tenant chooses. Run on one of the
server's threads, it takes the interpreter lock from the event loop every few
milliseconds for as long as it runs, and every other tenant's requests wait in
line behind it (issue 17). So the server resolves the base directory (path
confinement stays in :mod:`paths`), passes its descriptor over a Unix socket to
a helper process, and waits for the JSON answer without holding the lock.

The helpers:

- run at a lower priority (``nice`` 10 more than the server's, set as they start), so
  the server (its own start too) and other tenants' work come first on the CPU;
- import nothing from the working directory or a user site (``-s -P``), and cannot be
  traced by the sandbox's commands (not dumpable), whose uid they have in a container;
- answer at most :data:`MAX_ANSWER_BYTES`;
- work, for the time of a request, in the cgroup of the sandbox that asked (an
  isolated sandbox's): its CPU, memory and pid limits bound the walk as they bound
  its commands, then move back to the server's;
- act with the filesystem identity of the thread that asked (the sandbox user);
- stop each walk at its deadline, its allowance of entries, ``cap`` results or
  :data:`MAX_DEPTH` levels (``truncated``), and are killed if they overstay it;
- exit when the server goes away (their socket closes, or their parent changes).

A process keeps at most :data:`MAX_WORKERS` of them, started on demand and reused;
one idle beyond :data:`IDLE_SECONDS` exits (one is kept). This module imports
nothing heavy: it is also the helper's program (``python -m
sandlot.dataplane.services.globworker FD``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _jstr
from typing import Any

from sandlot.dataplane.services.globbing import GlobPattern, States

#: Helper processes at most, for the whole server.
MAX_WORKERS = 8
#: How much lower than the server's the helpers' priority is (``nice``).
NICE = 10
#: The largest answer taken from a helper (``cap`` results of the longest paths fit).
MAX_ANSWER_BYTES = 64 << 20
_PR_SET_DUMPABLE = 4
#: An idle helper beyond the first exits after this long.
IDLE_SECONDS = 60.0
#: How long past its deadline a helper may take to answer before it is killed.
GRACE_SECONDS = 5.0
#: Directories a walk descends at most (the helper holds one descriptor per level).
MAX_DEPTH = 256

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HEADER = struct.Struct("!I")


#: ``(enter, leave)``: move a helper (by pid) into the cgroup of the sandbox it works for,
#: under that sandbox's CPU, memory and pid limits, and back out once it answered.
Charge = tuple[Callable[[int], None], Callable[[int], None]]


class Unavailable(Exception):
    """No helper answered: one died or overstayed its deadline."""


class Busy(Unavailable):
    """Every helper stayed busy until the request's deadline."""


# --- the server's side -------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = _spawn(theirs.fileno())
        finally:
            theirs.close()
        self.sock = ours
        self.idle_since = time.monotonic()

    def ask(self, top: int, request: dict[str, Any], deadline: float) -> bytes:
        payload = json.dumps(request).encode()
        frame = _HEADER.pack(len(payload)) + payload
        sent = socket.send_fds(self.sock, [frame], [top])
        if sent < len(frame):
            self.sock.sendall(frame[sent:])
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if size > MAX_ANSWER_BYTES:
            raise Unavailable("the glob helper's answer is too large")
        return self._read(size, deadline)

    def _read(self, size: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        while size:
            left = deadline + GRACE_SECONDS - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise Unavailable("the glob did not finish in time")
            chunk = self.sock.recv(min(size, 1 << 20))
            if not chunk:
                raise Unavailable("the glob helper exited")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()  # the helper reads EOF and exits
        if self.proc.poll() is None:
            try:
                self.proc.wait(1)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.sock.close()


def _spawn(fd: int) -> subprocess.Popen[bytes]:
    # Nothing of the working directory (a container's dataplane runs in /workspace, where
    # commands write) nor of a user site on the helper's import path: ``-m`` put the
    # working directory first, and a command's /workspace/json/ ran in the helper.
    argv = [sys.executable, "-s", "-P", "-m", "sandlot.dataplane.services.globworker", str(fd)]

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(fd,))
        # At its lower priority from its first import on: a helper started with the
        # dataplane must not slow the dataplane's own start (a container has one CPU).
        nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
        with contextlib.suppress(ProcessLookupError):  # it ended already
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
        return proc

    if os.geteuid() != 0:
        return start()
    # The asking thread may act as a sandbox user, who need not be allowed to run the
    # server's interpreter: the helper starts with the server's identity.
    from sandlot.dataplane.services.fsids import run_as

    return run_as(os.geteuid(), os.getegid(), start)


class GlobPool:
    """The helper processes of one server process."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def run(
        self, top: int, request: dict[str, Any], deadline: float, charge: Charge | None = None
    ) -> bytes:
        """The helper's answer for the directory ``top`` (JSON text); blocks until then.

        With ``charge``, the helper works in the sandbox's cgroup (see :data:`Charge`).
        """
        worker = self._acquire(deadline)
        pid = worker.proc.pid
        try:
            if charge is not None:
                charge[0](pid)
            answer = worker.ask(top, request, deadline)
        except BaseException as exc:
            worker.kill()
            self._forget()
            if isinstance(exc, OSError):
                raise Unavailable(f"the glob helper failed: {exc}") from None
            raise
        if charge is not None:
            try:
                charge[1](pid)
            except OSError:
                # Stuck in that sandbox's cgroup: it must not work for another one.
                worker.kill()
                self._forget()
                return answer
        self._release(worker)
        return answer

    def warm(self) -> None:
        """Start one helper now if there is none (its start takes ~0.1 s)."""
        with self._cond:
            if self._count or self._closed:
                return
            self._count += 1
        try:
            worker = _Worker()
        except BaseException:
            self._forget()
            raise
        self._release(worker)

    def _acquire(self, deadline: float) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise Busy("the server is stopping")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    # It ended while idle: a command of the sandbox killed it (a helper of
                    # a container's dataplane runs as the sandbox user), or the OOM killer.
                    worker.sock.close()
                    self._count -= 1
                if self._count < self.max_workers:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy("every glob helper is busy")
                self._cond.wait(left)
            self._count += 1
        try:
            return _Worker()
        except BaseException:
            self._forget()
            raise

    def _release(self, worker: _Worker) -> None:
        now = time.monotonic()
        worker.idle_since = now
        stale: list[_Worker] = []
        with self._cond:
            if self._closed:
                stale.append(worker)
                self._count -= 1
            else:
                self._idle.append(worker)
                while len(self._idle) > 1 and now - self._idle[0].idle_since > IDLE_SECONDS:
                    stale.append(self._idle.pop(0))
                    self._count -= 1
            self._cond.notify()
        for w in stale:
            w.close()

    def _forget(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.close()


_pool = GlobPool()
atexit.register(_pool.close)


def run(top: int, request: dict[str, Any], deadline: float, charge: Charge | None = None) -> bytes:
    """Glob in the directory ``top`` with this server's helpers (see :func:`answer`)."""
    return _pool.run(top, request, deadline, charge)


def warm() -> None:
    """Have one helper ready, started in the background."""
    threading.Thread(target=_pool.warm, name="sandlot-glob-warm", daemon=True).start()


# --- the helper's side -------------------------------------------------------------------


def _iso(ts: float) -> str:
    # As fsops.iso writes it (not imported: fsops's imports would slow the helper's start).
    seconds = int(ts)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return f"{text}.{int((ts - seconds) * 1000):03d}Z"


class GlobWalk:
    """One glob's walk below a directory descriptor.

    Each directory carries the pattern's positions for its path
    (:meth:`GlobPattern.step`), so a directory below which nothing can match is
    never opened. The walk stops, ``truncated``, at ``cap`` results, after ``visits``
    entries, past ``deadline`` (``time.monotonic()``) or :data:`MAX_DEPTH` levels down.
    """

    def __init__(
        self,
        matcher: GlobPattern,
        *,
        include_dirs: bool,
        cap: int,
        deadline: float,
        visits: int,
        size_bytes: bool = False,
    ) -> None:
        self.matcher = matcher
        self.include_dirs = include_dirs
        self.cap = cap
        self.deadline = deadline
        self.visits = visits
        self.size_bytes = size_bytes
        self.parent = os.getppid()
        #: ``(path relative to the base, the entry as JSON with a {} for its path)``
        self.found: list[tuple[str, str]] = []
        self.truncated = False

    def run(self, top: int) -> None:
        m = self.matcher
        # (descriptor, path relative to the base, subdirectories left to visit)
        stack: list[tuple[int, str, list[tuple[str, States]]]] = []
        stack.append((top, "", self._scan(top, "", m.start())))
        try:
            while stack and not self.truncated:
                fd, rel_dir, pending = stack[-1]
                if not pending:
                    stack.pop()
                    if fd != top:
                        os.close(fd)
                    continue
                name, states = pending.pop()
                if len(stack) >= MAX_DEPTH:
                    self.truncated = True
                    break
                try:
                    sub = os.open(name, _O_DIR, dir_fd=fd)
                except OSError:
                    continue
                rel = f"{rel_dir}/{name}" if rel_dir else name
                try:
                    found = self._scan(sub, rel, states)
                except BaseException:
                    os.close(sub)
                    raise
                stack.append((sub, rel, found))
        finally:
            for fd, _, _ in stack:
                if fd != top:
                    os.close(fd)

    def _over(self) -> bool:
        """Past the deadline (checked every 256 entries)."""
        if time.monotonic() > self.deadline:
            return True
        if os.getppid() != self.parent:
            raise SystemExit(0)  # the server is gone: nobody reads the answer
        return False

    def _scan(self, fd: int, rel_dir: str, states: States) -> list[tuple[str, States]]:
        """Match the entries of one directory; answer the subdirectories to descend."""
        m = self.matcher
        names_only = m.names_only
        start = m.start()
        subdirs: list[tuple[str, States]] = []
        with os.scandir(fd) as it:
            for entry in it:
                self.visits -= 1
                if self.visits < 0 or (self.visits & 255 == 0 and self._over()):
                    self.truncated = True
                    break
                name = entry.name
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                hidden = name.startswith(".")
                if is_dir:
                    if hidden and not m.enters_hidden:
                        continue
                    after = m.step(start if names_only else states, name)
                    if self.include_dirs and m.accepts(after) and not self._add(entry, rel_dir):
                        break
                    if names_only:
                        subdirs.append((name, start))
                    elif after:
                        subdirs.append((name, after))
                    continue
                if hidden and not m.matches_hidden_names:
                    continue
                after = m.step(start if names_only else states, name)
                if m.accepts(after) and not self._add(entry, rel_dir):
                    break
        subdirs.reverse()  # taken from the end: visited in directory order
        return subdirs

    def _add(self, entry: os.DirEntry[str], rel_dir: str) -> bool:
        """Record a match (regular files and directories only); False once full."""
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return True
        is_dir = stat.S_ISDIR(st.st_mode)
        if not is_dir and not stat.S_ISREG(st.st_mode):
            return True
        if len(self.found) >= self.cap:
            self.truncated = True
            return False
        size = f',"size_bytes":{st.st_size}' if self.size_bytes else ""
        rest = (
            f',"is_dir":{"true" if is_dir else "false"},"size":{st.st_size},'
            f'"modified_at":"{_iso(st.st_mtime)}"{size}}}'
        )
        self.found.append((f"{rel_dir}/{entry.name}" if rel_dir else entry.name, rest))
        return True

    def json(self, prefix: str) -> bytes:
        """The answer: ``{"matches": [...], "truncated": ...}``, paths under ``prefix``."""
        self.found.sort()
        entries = ",".join(f'{{"path":{_jstr(f"{prefix}/{rel}")}{rest}' for rel, rest in self.found)
        tail = "true" if self.truncated else "false"
        return f'{{"matches":[{entries}],"truncated":{tail}}}'.encode()


def answer(top: int, request: dict[str, Any]) -> bytes:
    """What a helper answers for one request (the fields :meth:`FileOps.glob_json` sends).

    Errors come back as ``{"error": {"code" | "errno", "message"}}``.
    """
    try:
        matcher = GlobPattern(request["pattern"], anchored=request["anchored"])
    except ValueError as exc:
        return _error(code="INVALID_REQUEST", message=str(exc))
    walk = GlobWalk(
        matcher,
        include_dirs=request["include_dirs"],
        cap=request["cap"],
        deadline=time.monotonic() + request["seconds"],
        visits=request["visits"],
        size_bytes=request["size_bytes"],
    )
    try:
        ids = request.get("fs_ids")
        if ids is None:
            walk.run(top)
        else:
            from sandlot.dataplane.services.fsids import run_as

            run_as(ids[0], ids[1], walk.run, top)
    except OSError as exc:
        return _error(errno=exc.errno, message=exc.strerror or str(exc))
    return walk.json(request["prefix"])


def _error(**fields: Any) -> bytes:
    return json.dumps({"error": fields}).encode()


def _receive(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The next request and its descriptor; None at the end."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    if len(fds) != 1:
        raise RuntimeError("a glob request came without its directory")
    while len(data) < _HEADER.size:
        more = sock.recv(1 << 16)
        if not more:
            os.close(fds[0])
            return None
        data += more
    (size,) = _HEADER.unpack_from(data)
    need = _HEADER.size + size
    while len(data) < need:
        more = sock.recv(need - len(data))
        if not more:
            os.close(fds[0])
            return None
        data += more
    return json.loads(data[_HEADER.size : need]), fds[0]


def main(fd: int) -> None:
    # Not traceable by the commands of a container's sandbox (the helper has their uid),
    # which could otherwise make it answer what they like.
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if os.geteuid() == 0:
        # Whatever identity the thread that started us had: each request sets its own.
        from sandlot.dataplane.services.fsids import become

        become(os.geteuid(), os.getegid())
    sock = socket.socket(fileno=fd)
    while True:
        got = _receive(sock)
        if got is None:
            return
        request, top = got
        try:
            body = answer(top, request)
        except Exception:
            traceback.print_exc()
            body = _error(code="INTERNAL", message="the glob failed")
        finally:
            os.close(top)
        sock.sendall(_HEADER.pack(len(body)) + body)


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""Path confinement: sandbox paths to host files, never anything outside.

A sandbox path (absolute, or relative to ``/workspace``) is mapped through the
runtime's mounts and walked one component at a time with
``openat(O_PATH | O_NOFOLLOW)`` from the mount's directory fd. A symlink met on
the way is read and its target resolved again *in the sandbox's view*: an
absolute target restarts from the sandbox root, ``..`` never climbs above it,
and a mount point inside another mount switches to that mount's fd, exactly as
the kernel would inside the sandbox. Nothing is ever resolved through a host
path, so a symlink planted by sandboxed code (``/etc/shadow``,
``/proc/self/root``) can only lead to another sandbox path.

The result is a directory fd plus a final name; callers open the final name
with ``O_NOFOLLOW`` relative to that fd, so swapping a component for a symlink
between resolution and use makes the operation fail instead of escaping.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sandlot.protocol.errors import (
    FileNotFound,
    InvalidRequest,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    ResourceConflict,
    SandlotError,
)
from sandlot.runtime.base import WORKSPACE, Mount

MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
MAX_SYMLINKS = 40

_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_O_STEP = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def split_sandbox_path(path: str) -> list[str]:
    """Validate a client path and return the components of the absolute sandbox path.

    ``.`` and empty components are dropped; ``..`` is kept for the walk to apply
    (it must see symlinks before it). Raises 400 on NUL, over-long paths or names.
    """
    if not isinstance(path, str) or not path:
        raise InvalidRequest("path is required")
    if "\x00" in path:
        raise InvalidRequest("path contains a NUL byte")
    try:
        # surrogateescape: names that are not UTF-8 travel as \udcXX (as listings return them).
        size = len(path.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError as exc:
        raise InvalidRequest("path is not valid UTF-8") from exc
    if size > MAX_PATH_BYTES:
        raise InvalidRequest("path too long")
    if not path.startswith("/"):
        path = f"{WORKSPACE}/{path}"
    parts = [p for p in path.split("/") if p and p != "."]
    for part in parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidRequest("file name too long")
    return parts


def normalize(path: str) -> str:
    """The lexical absolute form of a sandbox path (no symlinks resolved)."""
    out: list[str] = []
    for part in split_sandbox_path(path):
        if part == "..":
            if out:
                out.pop()
        else:
            out.append(part)
    return "/" + "/".join(out)


def os_error(exc: OSError, what: str = "") -> SandlotError:
    """Map an errno to the wire error. Messages never carry host paths."""
    code = exc.errno
    suffix = f": {what}" if what else ""
    if code == errno.ENOENT:
        return FileNotFound(f"no such file or directory{suffix}")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"permission denied{suffix}")
    if code == errno.ELOOP:
        return InvalidRequest(f"too many levels of symbolic links{suffix}")
    if code == errno.ENAMETOOLONG:
        return InvalidRequest(f"file name too long{suffix}")
    if code == errno.ENOTDIR:
        return InvalidRequest(f"not a directory{suffix}")
    if code == errno.EISDIR:
        return InvalidRequest(f"is a directory{suffix}")
    if code == errno.EEXIST:
        return ResourceConflict(f"already exists{suffix}")
    if code == errno.ENOTEMPTY:
        return ResourceConflict(f"directory not empty{suffix}")
    if code == errno.EXDEV:
        return InvalidRequest(f"cannot move across mounts{suffix}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        # The sandbox's disk (template resources.disk_mb) is full: not retryable as is.
        return QuotaExceeded(
            f"no space left on the sandbox's disk{suffix}", metadata={"resource": "disk"}
        )
    if code == errno.EFBIG:
        return PayloadTooLarge(f"file too large{suffix}")
    if code in (errno.ENXIO, errno.ENODEV, errno.ETXTBSY):
        return InvalidRequest(f"not a regular file{suffix}")
    return InvalidRequest(f"{os.strerror(code or 0).lower()}{suffix}")


@dataclass
class Resolved:
    """A confined location: ``name`` inside the directory ``dir_fd`` (owned by this object).

    ``name is None`` when the path is a mount root itself; ``dir_fd`` is then that directory.
    """

    dir_fd: int
    name: str | None
    sandbox_path: str
    mount: Mount
    #: Host path of the result, for tools that take paths (ripgrep) and for display mapping.
    host_path: Path

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> Resolved:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def lstat(self) -> os.stat_result:
        if self.name is None:
            return os.stat(self.dir_fd)
        return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)

    def open(self, flags: int, mode: int = 0o644) -> int:
        """Open the final component (never following a symlink there)."""
        if self.name is None:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=self.dir_fd)
        return os.open(self.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.dir_fd)


class _Level:
    __slots__ = ("fd", "mount", "owned")

    def __init__(self, fd: int | None, mount: Mount | None, owned: bool) -> None:
        self.fd = fd
        self.mount = mount
        self.owned = owned


class PathResolver:
    """Resolves sandbox paths for one runtime's mount table."""

    def __init__(self, mounts: list[Mount]) -> None:
        self.mounts = sorted(mounts, key=lambda m: len(m.sandbox_path), reverse=True)
        self._by_path = {m.sandbox_path.rstrip("/") or "/": m for m in self.mounts}
        # Every ancestor of a mount point is a directory of the sandbox's view even
        # when nothing backs it (``/`` when only ``/workspace`` and ``/tmp`` exist).
        self._virtual: set[str] = set()
        for m in self.mounts:
            parts = [p for p in m.sandbox_path.split("/") if p]
            for i in range(len(parts)):
                self._virtual.add("/" + "/".join(parts[:i]))
        self._fds: dict[str, int] = {}
        # Opened now, with the server's identity: the host directories leading to a
        # mount are none of the sandbox user's business (file operations may run
        # as that user, who need not be able to traverse them).
        for m in self.mounts:
            with contextlib.suppress(SandlotError):
                self._mount_fd(m)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> PathResolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mount_fd(self, m: Mount) -> int:
        fd = self._fds.get(m.sandbox_path)
        if fd is None:
            try:
                fd = os.open(m.host_path, _O_PATH_DIR)
            except OSError as exc:
                raise FileNotFound("sandbox file system is not available") from exc
            self._fds[m.sandbox_path] = fd
        return fd

    def virtual_children(self, sandbox_path: str) -> list[str] | None:
        """Names under a directory that only exists as an ancestor of mount points
        (``/`` when only ``/workspace`` and ``/tmp`` are mounted); ``None`` otherwise."""
        if sandbox_path not in self._virtual or sandbox_path in self._by_path:
            return None
        prefix = sandbox_path.rstrip("/") + "/"
        names = {
            m.sandbox_path[len(prefix) :].split("/", 1)[0]
            for m in self.mounts
            if m.sandbox_path.startswith(prefix)
        }
        return sorted(n for n in names if n)

    def host_to_sandbox(self, host_path: str) -> str | None:
        """Map a host path under a mount back to its sandbox path (for tool output)."""
        for m in self.mounts:
            base = str(m.host_path)
            if host_path == base or host_path.startswith(base.rstrip("/") + "/"):
                rest = host_path[len(base) :].lstrip("/")
                prefix = m.sandbox_path.rstrip("/")
                return f"{prefix}/{rest}" if rest else (prefix or "/")
        return None

    def sandbox_to_host(self, sandbox_path: str) -> str | None:
        """The host path a sandbox path names through its mount, lexically (no link is
        followed: for bookkeeping such as the watcher's, never to open anything)."""
        path = sandbox_path.rstrip("/") or "/"
        holding = [
            m
            for m in self.mounts
            if path == m.sandbox_path.rstrip("/")
            or path.startswith(m.sandbox_path.rstrip("/") + "/")
        ]
        if not holding:
            return None
        mount = max(holding, key=lambda m: len(m.sandbox_path))  # the innermost mount
        rest = path[len(mount.sandbox_path.rstrip("/")) :].lstrip("/")
        base = str(mount.host_path).rstrip("/")
        return f"{base}/{rest}" if rest else (base or "/")

    def _enter(self, spath: str, parent: _Level) -> _Level | None:
        """The level for ``spath`` when a mount decides it (mount point or virtual dir)."""
        m = self._by_path.get(spath)
        if m is not None:
            return _Level(self._mount_fd(m), m, owned=False)
        if parent.fd is None:
            if spath in self._virtual:
                return _Level(None, None, owned=False)
            raise FileNotFound("path is outside the sandbox's file system")
        return None

    def is_mount_point(self, sandbox_path: str) -> bool:
        """Whether ``sandbox_path`` (normalised) is where a mount is attached."""
        return (sandbox_path.rstrip("/") or "/") in self._by_path

    def resolve(
        self,
        path: str,
        *,
        follow_final: bool = True,
        create_parents: bool = False,
        for_write: bool = False,
    ) -> Resolved:
        """Confine ``path``; ``for_write`` refuses read-only mounts (403) whatever the
        host permissions say (the server may be root on a directory the sandbox sees
        read-only)."""
        pending = split_sandbox_path(path)
        pending.reverse()  # a stack: pop() takes the next component
        names: list[str] = []
        root = self._enter("/", _Level(None, None, False)) or _Level(None, None, False)
        stack: list[_Level] = [root]
        links = 0
        try:
            while pending:
                part = pending.pop()
                if part == "..":
                    if names:
                        names.pop()
                        level = stack.pop()
                        if level.owned and level.fd is not None:
                            os.close(level.fd)
                    continue
                parent = stack[-1]
                spath = "/" + "/".join([*names, part])
                entered = self._enter(spath, parent)
                if entered is not None:
                    names.append(part)
                    stack.append(entered)
                    continue
                assert parent.fd is not None
                final = not pending
                if final and not follow_final:
                    return self._result(stack, names, part, for_write)
                try:
                    fd = os.open(part, _O_STEP, dir_fd=parent.fd)
                except FileNotFoundError:
                    if final:
                        return self._result(stack, names, part, for_write)
                    if not create_parents:
                        raise
                    if parent.mount is None or not parent.mount.writable:
                        raise PermissionDenied("read-only file system") from None
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=parent.fd)
                    pending.append(part)
                    continue
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode):
                    try:
                        target = os.readlink(part, dir_fd=parent.fd)
                    finally:
                        os.close(fd)
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise OSError(errno.ELOOP, "symlink loop")
                    if not target:
                        raise OSError(errno.ENOENT, "empty symlink")
                    if "\x00" in target or len(target.encode("utf-8", "surrogateescape")) > 4096:
                        raise OSError(errno.ENOENT, "bad symlink")
                    parts = [p for p in target.split("/") if p and p != "."]
                    if target.startswith("/"):
                        while names:
                            names.pop()
                            level = stack.pop()
                            if level.owned and level.fd is not None:
                                os.close(level.fd)
                    pending.extend(reversed(parts))
                    continue
                if final:
                    os.close(fd)
                    return self._result(stack, names, part, for_write)
                if not stat.S_ISDIR(st.st_mode):
                    os.close(fd)
                    raise OSError(errno.ENOTDIR, "not a directory")
                names.append(part)
                stack.append(_Level(fd, parent.mount, owned=True))
            # The path named a directory reached by the walk itself (a mount root, ``..``).
            top = stack[-1]
            if top.fd is None or top.mount is None:
                raise FileNotFound("path is outside the sandbox's file system")
            if for_write and not top.mount.writable:
                raise PermissionDenied("read-only file system")
            fd = os.dup(top.fd) if not top.owned else top.fd
            top.owned = False
            return Resolved(
                fd, None, "/" + "/".join(names), top.mount, self._host(top.mount, names)
            )
        except OSError as exc:
            raise os_error(exc) from None
        finally:
            for level in stack:
                if level.owned and level.fd is not None:
                    os.close(level.fd)

    def _result(
        self, stack: list[_Level], names: list[str], part: str, for_write: bool
    ) -> Resolved:
        top = stack[-1]
        if top.fd is None or top.mount is None:
            raise FileNotFound("path is outside the sandbox's file system")
        if for_write and not top.mount.writable:
            raise PermissionDenied("read-only file system")
        fd = top.fd if top.owned else os.dup(top.fd)
        top.owned = False
        full = [*names, part]
        return Resolved(fd, part, "/" + "/".join(full), top.mount, self._host(top.mount, full))

    @staticmethod
    def _host(m: Mount, names: list[str]) -> Path:
        base = [p for p in m.sandbox_path.split("/") if p]
        return m.host_path.joinpath(*names[len(base) :])

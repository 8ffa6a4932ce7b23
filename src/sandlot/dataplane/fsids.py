"""Acting as the sandbox user for file operations.

Linux keeps the filesystem uid/gid per *thread* (``setfsuid``/``setfsgid``;
glibc's ``setgroups`` would broadcast to every thread, the raw syscall does
not). So file operations for a sandbox with ``fs_ids`` run on a small pool of
threads that switched identity once at start: permission checks, and the
owner of every file created, are the sandbox user's, while the event loop
thread keeps the server's own identity. Without ``fs_ids`` (direct mode),
cheap operations run inline on the event loop (no thread hop on hot paths)
and only heavy ones (tree walks, archives) go to a plain pool.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def become(uid: int, gid: int) -> None:
    """Switch the calling thread's filesystem identity (and drop supplementary groups)."""
    libc = _libc()
    nr = _SYS_SETGROUPS.get(platform.machine())
    if nr is not None:
        libc.syscall(nr, 0, None)
    libc.setfsgid(gid)
    libc.setfsuid(uid)
    # setfsuid reports the previous id whatever happens: check it took effect.
    if libc.setfsuid(uid) != uid or libc.setfsgid(gid) != gid:
        raise PermissionError("cannot switch filesystem identity")


class FsExecutor:
    """Runs file operations with the right identity."""

    def __init__(self, fs_ids: tuple[int, int] | None, *, threads: int = 4) -> None:
        self.fs_ids = fs_ids
        initializer = (lambda: become(*fs_ids)) if fs_ids is not None else None
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="sandlot-fs", initializer=initializer
        )

    async def light(self, fn: Callable[..., T], *args: object) -> T:
        """A cheap operation: inline unless it must run as another identity."""
        if self.fs_ids is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def heavy(self, fn: Callable[..., T], *args: object) -> T:
        """An operation that may take long: always off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

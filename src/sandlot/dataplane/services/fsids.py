"""Acting as the sandbox user for file operations.

Linux keeps the filesystem uid/gid per *thread* (``setfsuid``/``setfsgid``;
glibc's ``setgroups`` would broadcast to every thread, the raw syscall does
not), so permission checks, and the owner of every file created, can be the
sandbox user's on one thread while the others keep the server's identity.

- Cheap operations (a stat, a read, a rename, one directory listed) run
  inline on the event loop thread: with ``fs_ids``, that thread takes the
  sandbox user's identity for the call and gets its own back before the call
  returns (no ``await`` in between, so no other request runs meanwhile). A
  thread hop would cost more than most of these operations.
- Operations that may take long (tree walks, archives, anything that waits
  for the disk with fsync) run on a small pool of threads; with ``fs_ids``
  they switched identity once, at start.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("sandlot.dataplane")

_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}


@functools.cache
def c_library() -> ctypes.CDLL:
    # The C library the interpreter has loaded (``find_library`` runs ``ldconfig``).
    return ctypes.CDLL(None, use_errno=True)


def become(uid: int, gid: int) -> None:
    """Switch the calling thread's filesystem identity (and drop supplementary groups)."""
    libc = c_library()
    nr = _SYS_SETGROUPS.get(platform.machine())
    if nr is not None:
        libc.syscall(nr, 0, None)
    libc.setfsgid(gid)
    libc.setfsuid(uid)
    # setfsuid reports the previous id whatever happens: check it took effect.
    if libc.setfsuid(uid) != uid or libc.setfsgid(gid) != gid:
        raise PermissionError("cannot switch filesystem identity")


def run_as(uid: int, gid: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the calling thread with the filesystem identity ``uid:gid`` and no
    supplementary groups; the thread's own identity is back when it returns or raises."""
    libc = c_library()
    nr = _SYS_SETGROUPS.get(platform.machine())
    groups = os.getgroups()
    if groups and nr is not None:
        libc.syscall(nr, 0, None)
    own_gid = libc.setfsgid(gid)
    own_uid = libc.setfsuid(uid)
    try:
        # setfsuid(-1) changes nothing and answers the current id.
        if libc.setfsuid(-1) != uid or libc.setfsgid(-1) != gid:
            raise PermissionError("cannot switch filesystem identity")
        return fn(*args)
    finally:
        libc.setfsuid(own_uid)
        libc.setfsgid(own_gid)
        if groups and nr is not None:
            libc.syscall(nr, len(groups), (ctypes.c_uint * len(groups))(*groups))
        if libc.setfsuid(-1) != own_uid or libc.setfsgid(-1) != own_gid:
            # Never happens to a server that could switch in the first place; if it did,
            # this thread would go on serving with a sandbox user's identity.
            log.critical("cannot restore the server's filesystem identity; exiting")
            os._exit(70)


class FsExecutor:
    """Runs file operations with the right identity."""

    def __init__(self, fs_ids: tuple[int, int] | None, *, threads: int = 4) -> None:
        self.fs_ids = fs_ids
        initializer = (lambda: become(*fs_ids)) if fs_ids is not None else None
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="sandlot-fs", initializer=initializer
        )

    async def light(self, fn: Callable[..., T], *args: object) -> T:
        """A cheap operation: inline, as the sandbox user when there is one."""
        if self.fs_ids is None:
            return fn(*args)
        return run_as(*self.fs_ids, fn, *args)

    async def heavy(self, fn: Callable[..., T], *args: object) -> T:
        """An operation that may take long: always off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def run_blocking(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on one of the pool's threads (with its identity), waited for by
        the calling thread (itself a worker thread, never the event loop)."""
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def as_server(fn: Callable[[int], None]) -> Callable[[int], None]:
    """``fn`` run with the server's own filesystem identity, whatever the calling thread
    acts as (a sandbox user's thread writing the server's cgroup files, say)."""

    def call(arg: int) -> None:
        run_as(os.geteuid(), os.getegid(), fn, arg)

    return call

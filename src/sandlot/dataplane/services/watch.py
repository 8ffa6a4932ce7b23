"""Watching workspaces for changes made by commands: one inotify instance, no threads.

A watcher per sandbox that parks a thread (as ``watchfiles.awatch`` does) caps
the number of sandboxes at the size of the thread pool and starves every other
blocking call; one inotify instance per sandbox runs into the per-user limit
on instances (128 by default). So every workspace of this dataplane shares
one inotify file descriptor, read by the event loop when it is readable, and
each directory gets a watch (the per-user limit on watches is large).
Changes are coalesced per path over a short debounce window.

Everything here runs on the event loop that serves every sandbox of the process, so no
step of it does unbounded work: new directories are queued and watched (and listed) at
most :data:`WALK_STEP` directories or entries per loop step, a directory already watched
at the same path is not walked again, and a flush hands at most :data:`FLUSH_STEP`
changes to its sink per step. A tree watches at most :data:`MAX_DIRS_PER_TREE`
directories; when a directory cannot be watched (that bound, or the per-user inotify
limit every sandbox of the host shares) the tree reports it once, as an ``unwatched``
change of that directory.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import logging
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger("sandlot.dataplane.services.watch")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_MASK = (
    IN_MODIFY
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
    | IN_EXCL_UNLINK
)
#: A watch added through ``/proc/self/fd/N`` follows that link (to the directory opened).
_MASK_BY_FD = _MASK & ~IN_DONT_FOLLOW
_HEADER = struct.Struct("iIII")
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: A sandbox may have at most this many watched directories (the rest is not reported).
MAX_DIRS_PER_TREE = 20_000

#: Directories watched or entries listed per event loop step of a tree's walk.
WALK_STEP = 64

#: Changes handed to a tree's sink per event loop step.
FLUSH_STEP = 512

#: ``(host path, op)`` with op ``created`` | ``modified`` | ``deleted``, or ``unwatched``
#: for a directory that could not be watched (nor what is below it).
ChangeSink = Callable[[list[tuple[str, str]]], None]

# The C library the interpreter has loaded (``find_library`` would run ``ldconfig`` to
# find its name: a process started on every import of this module).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


def new_instance() -> int:
    """A new non-blocking inotify instance (its file descriptor)."""
    fd = int(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def remove_watch(fd: int, wd: int) -> None:
    _libc.inotify_rm_watch(fd, wd)


def _open_exact(tree: Tree, path: str) -> int | None:
    """The directory ``path`` of ``tree``, opened; ``None`` when it is not one, or is
    reached through a link. A command may swap any directory of its workspace for a link
    (to a directory of the host, for the local runtime) between the step that listed it
    and the one that watches what was below it: watched and listed by path, that
    directory's subdirectories were watched and listed wherever the link led."""
    try:
        fd = os.open(path, _O_DIR)
    except OSError:
        return None
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        where = ""
    if where != tree.real_path(path):
        os.close(fd)
        return None
    return fd


def read_events(fd: int) -> list[tuple[int, int, bytes]]:
    """``(watch, mask, name)`` of the events one ``read`` of instance ``fd`` returns (none
    when nothing is queued)."""
    try:
        data = os.read(fd, 1 << 16)
    except (BlockingIOError, InterruptedError):
        return []
    return list(_parse_events(data))


def _parse_events(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
        name = data[offset + _HEADER.size : offset + _HEADER.size + length].rstrip(b"\0")
        offset += _HEADER.size + length
        yield wd, mask, name


@dataclass(eq=False)
class Tree:
    """One watched directory tree (a workspace) and where its changes go."""

    root: str
    sink: ChangeSink
    debounce: float
    #: ``root`` with no link in it: what a directory of the tree opened by its path must
    #: turn out to be under (see :meth:`Inotify._open_exact`).
    real_root: str = ""
    wds: set[int] = field(default_factory=set)
    pending: dict[str, str] = field(default_factory=dict)
    flush: asyncio.Handle | None = None
    #: Host directories being written through the API, which reports them itself: events
    #: under them are dropped as they are read (new directories get their watches when
    #: the directory is unmuted: see :meth:`Inotify.unmute`).
    muted: set[str] = field(default_factory=set)
    _muted_prefixes: tuple[str, ...] = ()
    #: Directories to watch and list: whether to report what they hold as created, and
    #: whether to list them even when they are watched already (after an unmute).
    todo: deque[tuple[str, bool, bool]] = field(default_factory=deque)
    #: The directory being listed: what is left of its listing, its path, its two flags.
    listing: tuple[Iterator[os.DirEntry[str]], str, bool, bool] | None = None
    walk: asyncio.Handle | None = None
    #: A directory could not be watched (reported once, until watches are free again).
    full: bool = False

    def real_path(self, path: str) -> str:
        """Where ``path`` (``root`` or below it) is with no link on the way."""
        rest = path[len(self.root) :].lstrip("/")
        return os.path.join(self.real_root, rest) if rest else self.real_root

    def mute(self, host_dir: str) -> None:
        self.muted.add(host_dir)
        self._muted_prefixes = tuple(m + "/" for m in self.muted)

    def unmute(self, host_dir: str) -> None:
        self.muted.discard(host_dir)
        self._muted_prefixes = tuple(m + "/" for m in self.muted)

    def is_muted(self, path: str) -> bool:
        # One C-level call per event: an archive makes tens of thousands of them.
        return path in self.muted or path.startswith(self._muted_prefixes)


def _coalesce(previous: str | None, op: str) -> str | None:
    """What a path's pending change becomes when another one arrives."""
    if previous is None:
        return op
    if previous == "created" and op == "modified":
        return "created"
    if previous == "created" and op == "deleted":
        return None  # came and went within the window: nothing to report
    if previous == "deleted" and op == "created":
        return "modified"
    return op


class Inotify:
    """The shared watcher of this event loop's workspaces."""

    def __init__(self) -> None:
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wds: dict[int, tuple[Tree, str]] = {}

    def _ensure(self) -> None:
        if self._fd >= 0:
            return
        fd = new_instance()
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._read)

    def watch(self, root: str, sink: ChangeSink, debounce: float) -> Tree:
        """Watch ``root`` recursively; changes go to ``sink`` (on the event loop)."""
        self._ensure()
        tree = Tree(root.rstrip("/") or "/", sink, debounce)
        tree.real_root = os.path.realpath(tree.root)
        self._add_tree(tree, tree.root)
        return tree

    def unwatch(self, tree: Tree) -> None:
        if tree.flush is not None:
            tree.flush.cancel()
            tree.flush = None
        self._stop_walk(tree)
        for wd in list(tree.wds):
            self._wds.pop(wd, None)
            remove_watch(self._fd, wd)
        tree.wds.clear()
        if not self._wds and self._fd >= 0 and self._loop is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def mute(self, tree: Tree, host_dir: str) -> None:
        """Drop changes under ``host_dir`` as they are read (the API reports them itself)."""
        tree.mute(host_dir)

    def unmute(self, tree: Tree, host_dir: str) -> None:
        """Report changes under ``host_dir`` again, watching what was made there meanwhile."""
        tree.unmute(host_dir)
        if self._fd >= 0 and tree.wds:
            self._add_tree(tree, host_dir, again=True)

    def _add_dir(self, tree: Tree, path: str, again: bool = False) -> int | None:
        """Watch directory ``path``; it opened, to be listed, or ``None`` when it needs no
        listing (it cannot be watched, or, unless ``again``, it already is, at this
        path)."""
        if len(tree.wds) >= MAX_DIRS_PER_TREE:
            self._full(tree, path)
            return None
        fd = _open_exact(tree, path)
        if fd is None:
            return None
        # The watch is added on the directory opened, not on a path resolved again.
        wd = _libc.inotify_add_watch(self._fd, b"/proc/self/fd/%d" % fd, _MASK_BY_FD)
        if wd < 0:
            if ctypes.get_errno() == errno.ENOSPC:
                self._full(tree, path)  # the per-user limit, shared by the host's sandboxes
            os.close(fd)
            return None
        known = self._wds.get(wd)
        if not again and known is not None and known[0] is tree and known[1] == path:
            os.close(fd)
            return None  # listed when it was first watched: later entries are events
        tree.wds.add(wd)
        self._wds[wd] = (tree, path)
        return fd

    def _full(self, tree: Tree, path: str) -> None:
        if not tree.full:
            tree.full = True
            log.warning("%s: %s is not watched (no watch left for it)", tree.root, path)
            self._queue(tree, path, "unwatched")

    def _add_tree(self, tree: Tree, top: str, *, report: bool = False, again: bool = False) -> None:
        """Watch ``top`` and every directory below it (never following symlinks), in
        bounded steps on the event loop (the first one now); ``again`` lists directories
        that are watched already too (new ones may be below them)."""
        tree.todo.append((top, report, again))
        if tree.walk is None and tree.listing is None and len(tree.todo) == 1:
            if self._loop is not None and report:
                # From an event: its own loop step, not this read's.
                tree.walk = self._loop.call_soon(self._walk, tree)
            else:
                self._walk(tree)

    def _walk(self, tree: Tree) -> None:
        """One step of ``tree``'s walk: at most :data:`WALK_STEP` directories watched or
        entries listed; the next step is scheduled while there is more."""
        tree.walk = None
        budget = WALK_STEP
        while budget > 0:
            if tree.listing is None:
                if not tree.todo:
                    return
                path, report, again = tree.todo.pop()
                budget -= 1
                fd = self._add_dir(tree, path, again)
                if fd is None:
                    continue
                try:
                    tree.listing = (os.scandir(fd), path, report, again)
                except OSError:
                    continue
                finally:
                    os.close(fd)  # the listing reads a copy of it
            it, path, report, again = tree.listing
            try:
                entry = next(it, None)
            except OSError:
                entry = None
            if entry is None:
                it.close()  # type: ignore[attr-defined]
                tree.listing = None
                continue
            budget -= 1
            child = os.path.join(path, entry.name)
            if entry.is_dir(follow_symlinks=False):
                tree.todo.append((child, report, again))
            if report:
                self._queue(tree, child, "created")
        if self._loop is not None:
            tree.walk = self._loop.call_soon(self._walk, tree)

    def _stop_walk(self, tree: Tree) -> None:
        if tree.walk is not None:
            tree.walk.cancel()
            tree.walk = None
        if tree.listing is not None:
            tree.listing[0].close()  # type: ignore[attr-defined]
            tree.listing = None
        tree.todo.clear()

    def _queue(self, tree: Tree, path: str, op: str) -> None:
        merged = _coalesce(tree.pending.pop(path, None), op)
        if merged is not None:
            tree.pending[path] = merged
        if tree.flush is None and self._loop is not None:
            tree.flush = self._loop.call_later(tree.debounce, self._flush, tree)

    def _flush(self, tree: Tree) -> None:
        tree.flush = None
        if len(tree.pending) <= FLUSH_STEP:
            changes = sorted(tree.pending.items())
            tree.pending.clear()
        else:
            # A storm: the oldest changes now, the rest in the next steps.
            changes = sorted(itertools.islice(tree.pending.items(), FLUSH_STEP))
            for path, _op in changes:
                del tree.pending[path]
            if self._loop is not None:
                tree.flush = self._loop.call_soon(self._flush, tree)
        if changes:
            try:
                tree.sink(changes)
            except Exception:
                log.exception("workspace change sink failed")

    def _read(self) -> None:
        for wd, mask, name in read_events(self._fd):
            if mask & IN_Q_OVERFLOW:
                log.warning("inotify queue overflowed; some workspace changes were not reported")
                continue
            entry = self._wds.get(wd)
            if entry is None:
                continue
            tree, directory = entry
            if mask & IN_IGNORED:
                self._wds.pop(wd, None)
                tree.wds.discard(wd)
                if tree.full and len(tree.wds) < MAX_DIRS_PER_TREE * 9 // 10:
                    tree.full = False  # watches are free again: the next shortfall is news
                continue
            if mask & IN_DELETE_SELF or not name:
                continue
            if name.startswith(b".sandlot-") and name.endswith(b".tmp"):
                continue  # the dataplane's own temp files: only their final names matter
            path = os.path.join(directory, os.fsdecode(name))
            if tree.muted and tree.is_muted(path):
                # New directories under it get their watches when it is unmuted: watched
                # now, every file the API writes there would be one more event to drop.
                continue
            if mask & (IN_CREATE | IN_MOVED_TO):
                self._queue(tree, path, "created")
                if mask & IN_ISDIR:
                    # Watch the new directory and report what was made in it before the watch.
                    self._add_tree(tree, path, report=True)
            elif mask & (IN_DELETE | IN_MOVED_FROM):
                self._queue(tree, path, "deleted")
            elif mask & (IN_MODIFY | IN_CLOSE_WRITE) and not mask & IN_ISDIR:
                self._queue(tree, path, "modified")


_instances: dict[asyncio.AbstractEventLoop, Inotify] = {}


def shared() -> Inotify:
    """The watcher of the running event loop."""
    loop = asyncio.get_running_loop()
    inst = _instances.get(loop)
    if inst is None:
        for dead in [lp for lp in _instances if lp.is_closed()]:
            del _instances[dead]
        inst = _instances[loop] = Inotify()
    return inst

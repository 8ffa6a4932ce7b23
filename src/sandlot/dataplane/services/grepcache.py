"""Small trees kept in memory for ``/fs/grep``, kept current by inotify.

An agent greps the same tree again and again, and reading its files is most of
what a small search costs: opening and reading 50 small files takes longer
than the whole HTTP round trip around it. So a search that read a small tree
answers, then has the tree copied in the background on the file pool (a
*pack*, see ``native.c``: each regular file's path, name, kind and text, in
walk order), and later searches read the copy.

The copy is exact, not a guess:

- One inotify instance watches every directory and every file copied, each
  watch taken *before* the directory is listed or the file read.
- The kernel queues an inotify event inside the system call that makes a change
  (a write, a truncate, a create, a rename, an unlink, a chmod, a new hard
  link...), before that call returns. So a change finished before a search
  began is in the queue when the search starts.
- Every lookup first reads the queue (without blocking); an event on any watch
  of a copy drops the copy, and the search reads the tree again. A full queue
  (``IN_Q_OVERFLOW``) drops every copy.
- Files are watched themselves, not only through their directories: a write
  through another hard link, from outside the tree, is seen too.
- A copy is kept only if no event touched its watches while it was being
  taken; a watch that could not be taken (the per-user limit) means no copy.

What inotify does not report: a change made only through a writable shared
memory mapping (``mmap``) of a file. A search sees it once the file is next
written, truncated or closed after writing, or anything else in its tree
changes. ``DataplaneSettings.grep_cache`` off (``SANDLOT_DP_GREP_CACHE=0``) turns the cache off.

Copies are keyed by the searched directory's device and inode and by the
identity that read them, and bounded in bytes (:data:`MAX_BYTES`) and watches
(:data:`MAX_WATCHES`), least recently used first out. The watches of a dropped
copy stay (idle, within the bound): copying the tree again takes them again, at
a quarter of the cost of new ones.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from sandlot.dataplane.services import native
from sandlot.dataplane.services.watch import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    new_instance,
    read_events,
    remove_watch,
)

log = logging.getLogger("sandlot.dataplane.services.grepcache")

#: Everything that changes what a search of a tree finds (contents, names, entries,
#: permissions, link counts). Reads and opens are not events: a search does not drop
#: its own copy.
MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
#: Bytes of copies kept by one dataplane.
MAX_BYTES = 64 << 20
#: inotify watches held by one dataplane, at most: an eighth of the per-user limit,
#: which the workspace watchers (the activity feed) share.
MAX_WATCHES = 16_384

#: Copies taken at once, at most (each on a thread of the file pool).
MAX_COPYING = 2
#: Seconds before a tree whose last copy was not kept is copied again.
REFUSED_BACKOFF = 2.0


#: ``(identity, st_dev, st_ino)`` of a searched directory.
Key = tuple[object, int, int]


class _Copy(NamedTuple):
    pack: bytes
    wds: frozenset[int]


class _Mark(NamedTuple):
    changed: int
    overflows: int


def _user_watch_limit() -> int:
    try:
        return int(Path("/proc/sys/fs/inotify/max_user_watches").read_text())
    except (OSError, ValueError):
        return 8192  # the historical default


class GrepCache:
    """The copies of small trees one dataplane keeps, and their watches.

    Thread-safe: searches run on the event loop thread and on the file pool.
    """

    def __init__(
        self,
        lib: native.Native,
        *,
        max_bytes: int = MAX_BYTES,
        max_watches: int = MAX_WATCHES,
        by_cwd: bool = True,
    ) -> None:
        self._fd = new_instance()
        self._lib = lib
        self.max_bytes = max_bytes
        self.max_watches = min(max_watches, _user_watch_limit() // 8)
        #: Watch files by name from the thread's own working directory (else through
        #: /proc/self/fd, which the C code also falls back to if it cannot have one).
        self.by_cwd = by_cwd
        self._lock = threading.Lock()
        self._copies: OrderedDict[Key, _Copy] = OrderedDict()
        self._users: dict[int, set[Key]] = {}  # watch -> the copies it guards
        self._bytes = 0
        self._fills = 0  # fills under way
        self._changed: list[int] = []  # watches with an event while fills were under way
        self._overflows = 0
        #: Watches that guard no copy any more, kept (up to the budget) because copying
        #: the same tree again then takes them again, at a quarter of the cost of new ones.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._copying: set[Key] = set()
        #: When the last copy of a tree was not kept (see :meth:`start_copy`).
        self._refused: OrderedDict[Key, float] = OrderedDict()
        self.hits = 0
        self.misses = 0

    # -- the copies ------------------------------------------------------------------

    def get(self, key: Key) -> bytes | None:
        """The copy of ``key``'s tree, if it is kept and nothing changed since it was taken."""
        with self._lock:
            self._drain()
            found = self._copies.get(key)
            if found is None:
                self.misses += 1
                return None
            self._copies.move_to_end(key)
            self.hits += 1
            return found.pack

    def start_copy(self, key: Key) -> bool:
        """Whether to copy ``key``'s tree now: no copy of it is under way, nor too many, and
        its last one was not refused just now (a tree that changes all the time, one too
        large to keep, one that cannot be watched: copying it again would be wasted)."""
        with self._lock:
            if key in self._copying or len(self._copying) >= MAX_COPYING:
                return False
            refused = self._refused.get(key)
            if refused is not None and time.monotonic() - refused < REFUSED_BACKOFF:
                return False
            self._copying.add(key)
            return True

    def end_copy(self, key: Key) -> None:
        with self._lock:
            self._copying.discard(key)

    def load(self, key: Key, fd: int, max_files: int, max_bytes: int) -> bytes | int:
        """Copy the tree of directory ``fd`` (and keep it): its pack, or why not
        (:data:`~native.TOO_BIG`, :data:`~native.USE_PYTHON`).

        Only on a thread that uses no relative path (the file pool's): it gets a working
        directory of its own, left at ``/`` (see :meth:`~native.Native.fill`)."""
        with self._lock:
            self._fills += 1
            mark = _Mark(len(self._changed), self._overflows)
        filled: native.Fill | None = None
        try:
            # The identity of the calling thread reads the files and takes the watches.
            filled = self._lib.fill(fd, self._fd, MASK, max_files, max_bytes, by_cwd=self.by_cwd)
        finally:
            with self._lock:
                if filled is not None:
                    self._settle(key, mark, filled)
                self._fills -= 1
                self._trim()
        return filled.pack

    def _settle(self, key: Key, mark: _Mark, filled: native.Fill) -> None:
        self._drain()
        changed = set(self._changed[mark.changed :])
        keep = (
            isinstance(filled.pack, bytes)
            and not filled.unwatched
            and mark.overflows == self._overflows
            and not changed & filled.wds
            and len(filled.pack) <= self.max_bytes
            and len(filled.wds) <= self.max_watches
        )
        if keep:
            assert isinstance(filled.pack, bytes)
            self._drop(key)
            self._copies[key] = _Copy(filled.pack, filled.wds)
            self._bytes += len(filled.pack)
            for wd in filled.wds:
                self._users.setdefault(wd, set()).add(key)
                self._idle.pop(wd, None)
            while self._bytes > self.max_bytes or len(self._users) > self.max_watches:
                self._drop(next(iter(self._copies)))
        else:
            self._refused[key] = time.monotonic()
            self._refused.move_to_end(key)
            if len(self._refused) > 1024:
                self._refused.popitem(last=False)
            for wd in filled.wds:
                if wd not in self._users:
                    self._idle[wd] = None
                    self._idle.move_to_end(wd)

    def _drop(self, key: Key) -> None:
        copy = self._copies.pop(key, None)
        if copy is None:
            return
        self._bytes -= len(copy.pack)
        for wd in copy.wds:
            users = self._users.get(wd)
            if users is not None:
                users.discard(key)
                if not users:
                    del self._users[wd]
                    self._idle[wd] = None

    def _trim(self) -> None:
        """Remove the idle watches beyond the budget, oldest first, unless a copy is being
        taken (it may have taken one of them again: a watch is per inode, and a second
        ``inotify_add_watch`` of it returns the same one)."""
        if self._fills:
            return
        self._changed.clear()
        while self._idle and len(self._users) + len(self._idle) > self.max_watches:
            wd, _ = self._idle.popitem(last=False)
            remove_watch(self._fd, wd)

    # -- the events --------------------------------------------------------------------

    def _drain(self) -> None:
        """Read every queued event; drop the copies they touch."""
        while events := read_events(self._fd):
            for wd, mask, _name in events:
                if mask & IN_Q_OVERFLOW:
                    log.info("grep cache: inotify queue overflowed; every copy dropped")
                    self._overflows += 1
                    for key in list(self._copies):
                        self._drop(key)
                    continue
                if self._fills:
                    self._changed.append(wd)
                for key in list(self._users.get(wd, ())):
                    self._drop(key)
                if mask & IN_IGNORED:  # the watch is gone (its file was deleted)
                    self._idle.pop(wd, None)
        self._trim()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "copies": len(self._copies),
                "bytes": self._bytes,
                "watches": len(self._users),
                "idle_watches": len(self._idle),
                "hits": self.hits,
                "misses": self.misses,
            }

    def close(self) -> None:
        with self._lock:
            self._copies.clear()
            self._users.clear()
            self._idle.clear()
            if self._fd >= 0:
                os.close(self._fd)  # releases every watch
                self._fd = -1


_shared: GrepCache | None = None
_shared_lock = threading.Lock()
_disabled = False


_enabled = True


def configure(enabled: bool) -> None:
    """Whether searches keep trees in memory (``DataplaneSettings.grep_cache``)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    return _enabled


def shared(lib: native.Native) -> GrepCache | None:
    """This process's cache (made on first use); ``None`` when turned off or unavailable."""
    global _shared, _disabled
    if _shared is not None or _disabled:
        return _shared
    with _shared_lock:
        if _shared is None and not _disabled:
            if not enabled():
                _disabled = True
                return None
            try:
                _shared = GrepCache(lib)
            except OSError as exc:
                log.warning("grep cache unavailable: %s", exc)
                _disabled = True
    return _shared

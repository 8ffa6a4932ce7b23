"""The dataplane's file operations in C (``native.c``), loaded with ctypes.

Two operations whose time goes to Python's per-entry objects rather than to
the system calls:

- one directory of a listing (``/fs/list``): a listing of 1,000 files takes
  about a third of the time;
- the search of a small tree (``/fs/grep`` of a literal): 50 files in a
  fifth of the time.

Each writes exactly the JSON text the Python path writes, byte for byte
(tests compare the two on names and contents of random bytes), and hands
back to Python whatever it does not write the same way.

The library (``libsandlot-native.so``) is built with the package (``setup.py``) and
loaded when the dataplane starts (:func:`warm`), once its hash and its source's are found
to be those of its build manifest (``sandlot.runtime.artifacts``). When it was not built
(no C compiler at install time) or is not to be trusted, :func:`library` says why once and
returns ``None``, and both operations take the Python path: the C code is an accelerator,
never a requirement. ``DataplaneSettings.native`` off (``SANDLOT_DP_NATIVE=0``) turns it
off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, NamedTuple

from sandlot.runtime.artifacts import ArtifactUnavailable, verified

log = logging.getLogger(__name__)


class _Result(ctypes.Structure):
    _fields_ = [
        ("json", ctypes.c_void_p),
        ("json_len", ctypes.c_size_t),
        ("subdirs", ctypes.c_void_p),
        ("subdirs_len", ctypes.c_size_t),
        ("count", ctypes.c_long),
        ("truncated", ctypes.c_int),
        ("error", ctypes.c_int),
    ]


class _GrepResult(ctypes.Structure):
    _fields_ = [
        ("json", ctypes.c_void_p),
        ("json_len", ctypes.c_size_t),
        ("count", ctypes.c_long),
        ("status", ctypes.c_int),
    ]


class _PackResult(ctypes.Structure):
    _fields_ = [
        ("pack", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("wds", ctypes.POINTER(ctypes.c_int)),
        ("nwds", ctypes.c_size_t),
        ("unwatched", ctypes.c_int),
        ("status", ctypes.c_int),
    ]


class Fill(NamedTuple):
    """What :meth:`Native.fill` copied of a tree."""

    #: The pack to search (:meth:`Native.grep_pack`), or why not (:data:`TOO_BIG`,
    #: :data:`USE_PYTHON`).
    pack: bytes | int
    #: The inotify watches taken, whatever the outcome (the caller releases them).
    wds: frozenset[int]
    #: A watch could not be taken: the pack is right, but must not be kept.
    unwatched: bool


class Unsupported(Exception):
    """An entry the C code does not format (an mtime beyond ``gmtime``): use Python."""


#: :meth:`Native.grep` found more than its budgets allow (or a UTF-16 file): ripgrep's job.
TOO_BIG = 1
#: :meth:`Native.grep` met what only the Python path writes the same way.
USE_PYTHON = 2


def _declare(fn: Any, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
    """``fn`` with its C signature, so that ctypes converts (and checks) every argument."""
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


class Native:
    """The compiled library: :meth:`scan` (one directory listed), :meth:`grep` (a small tree)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        c = ctypes
        self._scan = _declare(
            lib.sandlot_scan,
            [c.c_int, c.c_char_p, c.c_size_t, c.c_long, c.c_int, c.POINTER(_Result)],
        )
        self._free = _declare(lib.sandlot_scan_free, [c.POINTER(_Result)], None)
        self._grep = _declare(
            lib.sandlot_grep,
            [
                *(c.c_int, c.c_char_p, c.c_size_t),  # directory, its escaped sandbox path
                *(c.c_char_p, c.c_size_t, c.c_char_p, c.c_size_t),  # pattern, glob
                *(c.c_long, c.c_long, c.c_long, c.c_longlong),  # cap and budgets
                c.POINTER(_GrepResult),
            ],
        )
        self._grep_free = _declare(lib.sandlot_grep_free, [c.POINTER(_GrepResult)], None)
        self._fill = _declare(
            lib.sandlot_grep_fill,
            [
                *(c.c_int, c.c_int, c.c_uint32),  # directory, inotify instance, mask
                *(c.c_long, c.c_longlong, c.c_int),  # budgets, by_cwd
                c.POINTER(_PackResult),
            ],
        )
        self._fill_free = _declare(lib.sandlot_grep_fill_free, [c.POINTER(_PackResult)], None)
        self._grep_pack = _declare(
            lib.sandlot_grep_pack,
            [
                *(c.c_char_p, c.c_size_t, c.c_char_p, c.c_size_t),  # pack, escaped base
                *(c.c_char_p, c.c_size_t, c.c_char_p, c.c_size_t),  # pattern, glob
                c.c_long,
                c.POINTER(_GrepResult),
            ],
        )

    def scan(
        self, fd: int, prefix: bytes, limit: int, want_subdirs: bool
    ) -> tuple[str, int, bool, list[str]]:
        """(entries as JSON text joined by commas, their count, truncated, subdirectory names).

        ``prefix`` is the JSON-escaped directory path with its trailing slash.
        Raises ``OSError`` when the directory cannot be read, :class:`Unsupported`
        when an entry needs the Python path.
        """
        res = _Result()
        # ctypes releases the GIL for the call: other requests go on meanwhile.
        rc = self._scan(fd, prefix, len(prefix), limit, 1 if want_subdirs else 0, res)
        try:
            if rc != 0:
                if res.error == -1:
                    raise Unsupported()
                raise OSError(res.error, os.strerror(res.error))
            text = ctypes.string_at(res.json, res.json_len).decode("ascii") if res.json else ""
            subdirs: list[str] = []
            if res.subdirs:
                raw = ctypes.string_at(res.subdirs, res.subdirs_len)
                subdirs = [os.fsdecode(n) for n in raw.split(b"\0")[:-1]]
            return text, int(res.count), bool(res.truncated), subdirs
        finally:
            self._free(res)

    def grep(
        self,
        fd: int,
        base: bytes,
        pattern: bytes,
        glob: bytes | None,
        *,
        cap: int,
        count_limit: int,
        max_files: int,
        max_bytes: int,
    ) -> bytes | int:
        """The ``/fs/grep`` answer for the directory ``fd`` (JSON text), or why not.

        ``base`` is the directory's sandbox path without its trailing slash, JSON-escaped
        as ``json.dumps(..., ensure_ascii=False)`` writes it; ``glob`` holds only literal
        characters, ``*`` and ``?``. A tree with more than ``count_limit`` regular files,
        or more than ``max_files`` / ``max_bytes`` to read, answers :data:`TOO_BIG`;
        :data:`USE_PYTHON` when the Python path must write the answer.
        """
        res = _GrepResult()
        # ctypes releases the GIL for the call: other threads go on meanwhile.
        rc = self._grep(
            fd,
            base,
            len(base),
            pattern,
            len(pattern),
            glob,
            len(glob or b""),
            cap,
            count_limit,
            max_files,
            max_bytes,
            res,
        )
        try:
            if rc < 0:
                raise OSError(-rc, os.strerror(-rc))
            if rc != 0:
                return int(rc)
            return _answer(res, cap)
        finally:
            self._grep_free(res)

    def fill(
        self, fd: int, ifd: int, mask: int, max_files: int, max_bytes: int, *, by_cwd: bool
    ) -> Fill:
        """A copy of the tree below directory ``fd`` for :meth:`grep_pack`, each directory
        and file watched on the inotify instance ``ifd`` (with ``mask``) before it is
        read; :data:`TOO_BIG` past ``max_files`` regular files or ``max_bytes`` bytes.

        ``by_cwd``: watch files by name from the directory as the calling thread's working
        directory (several times cheaper than through ``/proc/self/fd``). The thread then
        gets a working directory of its own, left at ``/``: only for threads that never
        use relative paths (the file pool's), never the event loop's.
        """
        res = _PackResult()
        rc = self._fill(fd, ifd, mask, max_files, max_bytes, 1 if by_cwd else 0, res)
        try:
            wds = frozenset(res.wds[i] for i in range(res.nwds))
            if rc < 0:  # out of memory: the Python path reports it (the watches go back)
                return Fill(USE_PYTHON, wds, True)
            pack: bytes | int = int(rc) if rc else ctypes.string_at(res.pack, res.len)
            return Fill(pack, wds, bool(res.unwatched))
        finally:
            self._fill_free(res)

    def grep_pack(
        self, pack: bytes, base: bytes, pattern: bytes, glob: bytes | None, cap: int
    ) -> bytes | int:
        """What :meth:`grep` answers for the tree ``pack`` was filled from."""
        res = _GrepResult()
        n = len(glob or b"")
        rc = self._grep_pack(
            pack, len(pack), base, len(base), pattern, len(pattern), glob, n, cap, res
        )
        try:
            if rc < 0:
                raise OSError(-rc, os.strerror(-rc))
            if rc != 0:
                return int(rc)
            return _answer(res, cap)
        finally:
            self._grep_free(res)


def _answer(res: _GrepResult, cap: int) -> bytes:
    found = ctypes.string_at(res.json, res.json_len) if res.json else b""
    truncated = b"true" if res.count > cap else b"false"
    return b'{"matches":[' + found + b'],"truncated":' + truncated + b"}"


#: The library's file name in this package (``setup.py`` builds it).
LIBRARY = "libsandlot-native.so"

_lock = threading.Lock()
_loaded = False
_library: Native | None = None


def ready() -> Native | None:
    """The library if it is loaded already (never loads it)."""
    return _library


def warm() -> None:
    """Load the library now (once), so that file operations find it ready."""
    library()


def library() -> Native | None:
    """The library, loaded on the first call; ``None`` when unavailable (said once) or
    not wanted (:func:`configure`)."""
    global _loaded, _library
    with _lock:
        if not _loaded and _wanted:
            try:
                _library = _load()
            except (ArtifactUnavailable, OSError, AttributeError) as exc:
                log.warning(
                    "native file operations unavailable, the pure-Python ones are used: %s", exc
                )
            _loaded = True
    return _library


def configure(enabled: bool) -> None:
    """Whether to use the C file operations at all (``DataplaneSettings.native``); takes
    effect unless they were loaded already."""
    global _wanted
    _wanted = enabled


_wanted = True


def wanted() -> bool:
    """Whether the C file operations are to be used (see :func:`configure`)."""
    return _wanted


def _load() -> Native:
    return Native(ctypes.CDLL(str(verified("sandlot.dataplane.services", LIBRARY))))

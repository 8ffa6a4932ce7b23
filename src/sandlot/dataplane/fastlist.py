"""Directory listings scanned in C (``fastlist.c``), loaded with ctypes.

A listing of 1,000 files spends most of its time in Python's per-entry
objects (``DirEntry``, ``stat_result``, the formatted string), not in the
system calls. ``fastlist.c`` does the same scan and writes the same JSON text
(byte for byte: tests compare the two on names of random bytes), in about a
third of the time.

The library is compiled on first use with the system's C compiler (the one
the local runtime needs for its init), into a private cache directory, named
by the hash of its source. Without a compiler, or when anything about it is
off, :func:`scanner` returns ``None`` and listings take the Python path: the
C code is an accelerator, never a requirement. The dataplane builds it on a
background thread when a sandbox is registered (:func:`warm`); listings use
it once it is there (:func:`ready`). ``SANDLOT_DP_FASTLIST=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import stat
import threading
from importlib import resources
from pathlib import Path

from sandlot.runtime.cbuild import BuildError, build_cached

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


class Unsupported(Exception):
    """An entry the C code does not format (an mtime beyond ``gmtime``): use Python."""


class Scanner:
    """``scan(fd, escaped_prefix, limit, want_subdirs)`` over the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._scan = lib.sandlot_scan
        self._scan.argtypes = [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_long,
            ctypes.c_int,
            ctypes.POINTER(_Result),
        ]
        self._scan.restype = ctypes.c_int
        self._free = lib.sandlot_scan_free
        self._free.argtypes = [ctypes.POINTER(_Result)]
        self._free.restype = None

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


_lock = threading.Lock()
_loaded = False
_warming = False
_scanner: Scanner | None = None


def source() -> bytes:
    return resources.files("sandlot.dataplane").joinpath("fastlist.c").read_bytes()


def cache_dir() -> Path:
    explicit = os.environ.get("SANDLOT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sandlot"


def _private(path: Path) -> bool:
    """Owned by us and writable by nobody else (a library planted there would run as us)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


#: Hardened as distributions build their libraries.
CFLAGS = ("-O2", "-shared", "-fPIC", "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2")


def _build(directory: Path) -> Path | None:
    try:
        lib = build_cached(source(), directory, "fastlist", CFLAGS)
    except BuildError as exc:
        log.warning("fast listings unavailable: %s", exc)
        return None
    if not _private(lib):
        return None
    for old in directory.glob("fastlist-*"):  # builds of earlier sources
        if old != lib:
            with contextlib.suppress(OSError):
                old.unlink()
    return lib


def ready() -> Scanner | None:
    """The scanner if it is built already (never waits for a build)."""
    return _scanner


def warm() -> None:
    """Build (or load) the scanner on a background thread, once."""
    global _warming
    with _lock:
        if _loaded or _warming:
            return
        _warming = True
    threading.Thread(target=scanner, name="sandlot-fastlist", daemon=True).start()


def scanner() -> Scanner | None:
    """The compiled scanner, built on the first call; ``None`` when unavailable."""
    global _loaded, _scanner
    with _lock:
        if not _loaded:
            try:
                _scanner = _load()
            except (OSError, AttributeError) as exc:
                log.warning("fast listings unavailable: %s", exc)
            _loaded = True
    return _scanner


def _load() -> Scanner | None:
    if os.environ.get("SANDLOT_DP_FASTLIST", "1").strip().lower() in ("0", "false", "no"):
        return None
    directory = cache_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(directory):
        log.warning("fast listings unavailable: %s is not private", directory)
        return None
    lib = _build(directory)
    return None if lib is None else Scanner(ctypes.CDLL(str(lib)))

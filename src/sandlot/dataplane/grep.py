"""``/fs/grep`` through ripgrep (PyPI ``ripgrep==14.1.0`` or the system ``rg``).

ripgrep gets the confined directory as ``/proc/self/fd/N`` (an fd the
resolver opened and the child inherits), never a host path that a symlink
swap could redirect, and it does not follow symlinks while walking. Patterns
are literal unless ``regex`` is set. ``.git`` directories are skipped; hidden
files and ignored files are searched (like ``grep -r``).

A search by ripgrep (spawn, read, parse) runs on one worker thread: no child
watcher, no await per output line, and the event loop stays free.

Starting ripgrep costs a few milliseconds, far more than searching the small
trees agents usually grep. A literal, case-sensitive search of a small tree
(at most ``SMALL_TREE_FILES`` files and ``SMALL_TREE_BYTES`` bytes) is done in
process with ripgrep's semantics, on the same confined descriptors (no
symlink followed, hidden files searched, ``.git`` skipped, files with a NUL
byte skipped as binary) and with the same identity as every file operation;
anything else, or a tree found larger while walking, goes to ripgrep.

The in-process search is done by the C library (:mod:`sandlot.dataplane.native`)
when it is built, else in Python (:func:`_search_small`, the reference the C
code is tested against). A tree of at most ``INLINE_FILES`` files and
``INLINE_BYTES`` bytes is searched on the event loop thread, like a stat:
that takes less time than handing it to a thread.

A small tree read by a search is then copied in the background for the next
searches of it (:mod:`sandlot.dataplane.grepcache`), which read the copy for as
long as nothing in the tree changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import itertools
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

from sandlot.dataplane import grepcache, native
from sandlot.dataplane.fsids import FsExecutor
from sandlot.dataplane.paths import PathResolver, Resolved, os_error
from sandlot.dataplane.web import dumps
from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable

log = logging.getLogger("sandlot.dataplane.grep")

MAX_LINE_CHARS = 2000
SMALL_TREE_FILES = 256
SMALL_TREE_BYTES = 4 << 20
#: Directories below the one searched in process; a deeper tree goes to ripgrep.
MAX_DEPTH = 64
#: A tree searched on the event loop thread (by the C library) holds no more than this.
INLINE_FILES = 64
INLINE_BYTES = 1 << 20


@functools.cache
def ripgrep_path() -> str | None:
    local = Path(sys.executable).parent / "rg"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("rg")


async def grep(
    resolver: PathResolver,
    executor: FsExecutor,
    *,
    pattern: str,
    path: str,
    glob: str | None,
    max_count: int | None,
    regex: bool,
    ignore_case: bool,
    limit: int,
) -> bytes:
    """The ``/fs/grep`` answer (JSON text)."""
    rg = ripgrep_path()
    if rg is None:
        raise ProviderUnavailable("ripgrep is not installed")
    if "\x00" in pattern or (glob is not None and "\x00" in glob):
        raise InvalidRequest("pattern contains a NUL byte")
    cap = min(limit, max_count) if max_count else limit
    flags = ["--fixed-strings"] if not regex else []
    if ignore_case:
        flags.append("--ignore-case")
    if glob:
        flags.append(f"--glob={glob}")

    small = (
        not regex and not ignore_case and _simple_glob(glob) and bool(pattern)
        and "\n" not in pattern
    )  # fmt: skip
    fast = _NativeSearch.of(pattern, glob, cap, executor.fs_ids) if small else None
    if fast is not None:
        # A tree small enough to search in less time than a thread hop takes is searched
        # right here (as the sandbox user); a larger one on the pool, below.
        found = await executor.light(fast.run, resolver, path, INLINE_FILES, INLINE_BYTES)
        if isinstance(found, bytes):
            fast.copy_later(executor, resolver, path)
            return found
        if found == native.USE_PYTHON:
            fast = None

    def run() -> bytes:
        try:
            with resolver.resolve(path) as res:
                found: bytes | int = native.USE_PYTHON if small else native.TOO_BIG
                if fast is not None:
                    found = fast.search(res, SMALL_TREE_FILES, SMALL_TREE_BYTES)
                if isinstance(found, bytes):
                    return found
                if found == native.USE_PYTHON:
                    result = _search_small(res, pattern.encode(), glob, cap)
                    if result is not None:
                        return dumps(result)
                return dumps(_search(rg, res, flags, pattern, cap, executor.fs_ids))
        except OSError as exc:
            raise os_error(exc) from None

    answer = await executor.heavy(run)
    if fast is not None:
        fast.copy_later(executor, resolver, path)
    return answer


class _NativeSearch:
    """A small-tree search by the C library (:mod:`sandlot.dataplane.native`)."""

    def __init__(
        self,
        lib: native.Native,
        pattern: bytes,
        glob: bytes | None,
        cap: int,
        identity: tuple[int, int] | None = None,
        cache: grepcache.GrepCache | None = None,
    ) -> None:
        self.lib = lib
        self.pattern = pattern
        self.glob = glob
        self.cap = cap
        #: Whose copies the search reads (``fs_ids``): one user's copy is not another's.
        self.identity = identity
        self.cache = cache
        #: The tree the last search read for want of a copy (see :meth:`copy_later`).
        self.missed: grepcache.Key | None = None

    @classmethod
    def of(
        cls, pattern: str, glob: str | None, cap: int, identity: tuple[int, int] | None
    ) -> _NativeSearch | None:
        """The search if the library is built and takes this pattern and glob."""
        lib = native.ready()
        if lib is None or (glob is not None and "[" in glob):
            return None  # character classes: fnmatch's own syntax, left to Python
        try:
            encoded = None if glob is None else glob.encode()
            return cls(lib, pattern.encode(), encoded, cap, identity, grepcache.shared(lib))
        except UnicodeEncodeError:
            return None

    def run(self, resolver: PathResolver, path: str, files: int, nbytes: int) -> bytes | int:
        try:
            with resolver.resolve(path) as res:
                return self.search(res, files, nbytes)
        except OSError as exc:
            raise os_error(exc) from None

    def search(self, res: Resolved, files: int, nbytes: int) -> bytes | int:
        """The answer, or :data:`~native.TOO_BIG` / :data:`~native.USE_PYTHON`.

        With the grep cache, from its copy of the tree when it has one; else by reading
        the tree, which :meth:`copy_later` then copies.
        """
        try:
            base = json.dumps(res.sandbox_path.rstrip("/"), ensure_ascii=False)[1:-1].encode()
        except UnicodeEncodeError:
            return native.USE_PYTHON
        fd, is_dir = _open_target(res)
        try:
            if not is_dir:
                return native.USE_PYTHON
            if self.cache is not None:
                st = os.fstat(fd)
                key = (self.identity, st.st_dev, st.st_ino)
                kept = self.cache.get(key)
                if kept is not None:
                    if len(kept) > nbytes:
                        return native.TOO_BIG  # too large to search here: on the pool
                    return self.lib.grep_pack(kept, base, self.pattern, self.glob, self.cap)
                self.missed = key
            found = self.lib.grep(
                fd,
                base,
                self.pattern,
                self.glob,
                cap=self.cap,
                count_limit=files,
                max_files=files,
                max_bytes=nbytes,
            )
            if not isinstance(found, bytes):
                self.missed = None  # a tree the cache would not copy either
            return found
        finally:
            os.close(fd)

    def copy_later(self, executor: FsExecutor, resolver: PathResolver, path: str) -> None:
        """After a search that read the tree: copy it for the next ones, on the file pool
        and in the background (the answer does not wait for the copy)."""
        cache, key = self.cache, self.missed
        if cache is None or key is None or not cache.start_copy(key):
            return

        def copy() -> None:
            with resolver.resolve(path) as res:
                fd, is_dir = _open_target(res)
                try:
                    st = os.fstat(fd)
                    if is_dir and (self.identity, st.st_dev, st.st_ino) == key:
                        cache.load(key, fd, SMALL_TREE_FILES, SMALL_TREE_BYTES)
                finally:
                    os.close(fd)

        async def run() -> None:
            try:
                await executor.heavy(copy)
            except Exception as exc:  # a tree gone meanwhile, a pool shut down: no copy
                log.debug("grep cache: no copy of %s: %r", path, exc)
            finally:
                cache.end_copy(key)

        task = asyncio.get_running_loop().create_task(run())
        _copies.add(task)
        task.add_done_callback(_copies.discard)


#: Copies under way (a reference to each task until it ends).
_copies: set[asyncio.Task[None]] = set()


def _search(
    rg: str,
    res: Resolved,
    flags: list[str],
    pattern: str,
    cap: int,
    fs_ids: tuple[int, int] | None,
) -> dict[str, Any]:
    fd, is_dir = _open_target(res)
    # A directory becomes the child's working directory through its fd (one magic-link
    # lookup) and is searched as "."; naming every file through /proc/self/fd/N would
    # pay that lookup per file.
    magic = f"/proc/self/fd/{fd}"
    target = "." if is_dir else magic
    argv = [
        rg,
        "--no-config",
        "--no-heading",
        "--with-filename",
        "--line-number",
        "--null",
        "--color=never",
        "--no-messages",
        "--hidden",
        "--no-ignore",
        "--glob=!.git",
        # Bound what one line can cost (minified files): keep a preview of it.
        "--max-columns=8192",
        "--max-columns-preview",
        *flags,
        "-e",
        pattern,
        "--",
        target,
    ]
    ids: dict[str, Any] = {}
    if fs_ids is not None:
        setpriv = _setpriv()
        if setpriv is not None:
            # Popen(user=…) forks the whole server (no vfork with a uid change), which
            # costs milliseconds; setpriv drops to the sandbox user after a cheap vfork.
            argv = [
                setpriv,
                f"--reuid={fs_ids[0]}",
                f"--regid={fs_ids[1]}",
                "--clear-groups",
                "--",
                *argv,
            ]
        else:
            ids = {"user": fs_ids[0], "group": fs_ids[1], "extra_groups": []}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(fd,),
            cwd=magic if is_dir else None,
            **ids,
        )
    finally:
        os.close(fd)
    matches: list[dict[str, Any]] = []
    truncated = False
    base = res.sandbox_path.rstrip("/")
    skip = len(target.encode())
    paths: dict[bytes, str] = {}
    assert proc.stdout is not None and proc.stderr is not None
    try:
        pending = b""
        while not truncated:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for raw in lines:
                name, sep, rest = raw.partition(b"\x00")
                lineno, _, text = rest.partition(b":")
                if not sep or not lineno.isdigit():
                    continue
                if len(matches) >= cap:
                    truncated = True
                    break
                spath = paths.get(name)
                if spath is None:
                    rel = name[skip:].lstrip(b"/").decode("utf-8", "replace")
                    spath = f"{base}/{rel}" if is_dir and rel else res.sandbox_path
                    paths[name] = spath
                line = text[: MAX_LINE_CHARS * 4].decode("utf-8", "replace")
                matches.append({"path": spath, "line": int(lineno), "text": line[:MAX_LINE_CHARS]})
    finally:
        if truncated:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.stdout.close()
        err = proc.stderr.read(4096)
        proc.stderr.close()
        proc.wait()
    if proc.returncode == 2 and not matches and b"regex" in err.lower():
        raise InvalidRequest("invalid regular expression")
    return {"matches": matches, "truncated": truncated}


def _simple_glob(glob: str | None) -> bool:
    """A glob whose ripgrep meaning is fnmatch's on the file name (no ``/``, braces, ``!``)."""
    return glob is None or not any(c in glob for c in "/{}!\\")


class _TooBig(Exception):
    pass


def _search_small(
    res: Resolved, pattern: bytes, glob: str | None, cap: int
) -> dict[str, Any] | None:
    """Search a small tree in process; ``None`` when ripgrep should do it instead."""
    fd, is_dir = _open_target(res)
    base = res.sandbox_path.rstrip("/")
    matches: list[dict[str, Any]] = []
    budget = [SMALL_TREE_FILES, SMALL_TREE_BYTES]
    try:
        if not is_dir:
            data = _read_small(fd, budget)
            if data is None or b"\x00" in data:
                return None  # ripgrep's own handling of an explicitly named binary file
            _scan(data, pattern, res.sandbox_path, matches, cap)
        elif _few_files(fd, base):
            _walk(fd, base, pattern, glob, matches, cap, budget)
        else:
            return None
    except _TooBig:
        return None
    finally:
        os.close(fd)
    truncated = len(matches) > cap
    return {"matches": matches[:cap], "truncated": truncated}


def _tree_files(
    dfd: int, spath: str, depth: int = 0
) -> Generator[tuple[int, str, str], None, None]:
    """``(directory fd, name, sandbox path)`` of every regular file below ``dfd``, by name,
    from directory entries alone: ``.git`` skipped, symlinks not followed, FIFOs, sockets,
    devices and unreadable directories left out, as ripgrep does with ``--no-messages``.
    A directory's fd stays open until the walk moves past it (close the generator to stop).
    A tree deeper than ``MAX_DEPTH`` raises :class:`_TooBig` (ripgrep walks it without
    recursion).
    """
    if depth > MAX_DEPTH:
        raise _TooBig
    try:
        entries = sorted(os.scandir(dfd), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if name == ".git":
            continue
        child = f"{spath}/{name}"
        try:
            if entry.is_dir(follow_symlinks=False):
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            elif entry.is_file(follow_symlinks=False):
                yield dfd, name, child
                continue
            else:
                continue
        except OSError:
            continue  # raced away or unreadable: skipped
        try:
            yield from _tree_files(sub, child, depth + 1)
        finally:
            os.close(sub)


def _few_files(dfd: int, spath: str) -> bool:
    """Whether the tree holds at most ``SMALL_TREE_FILES`` regular files, counted from
    directory entries before any file is read: a large tree goes to ripgrep at once."""
    with contextlib.closing(_tree_files(dfd, spath)) as files:
        return sum(1 for _ in itertools.islice(files, SMALL_TREE_FILES + 1)) <= SMALL_TREE_FILES


def _walk(
    dfd: int,
    spath: str,
    pattern: bytes,
    glob: str | None,
    matches: list[dict[str, Any]],
    cap: int,
    budget: list[int],
) -> None:
    with contextlib.closing(_tree_files(dfd, spath)) as files:
        for parent, name, child in files:
            if len(matches) > cap:
                return
            if glob is not None and not fnmatch.fnmatchcase(name, glob):
                continue
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
            except OSError:
                continue  # raced away or unreadable: skipped
            try:
                data = _read_small(fd, budget)
            finally:
                os.close(fd)
            if data is None:
                continue
            if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
                raise _TooBig  # UTF-16 with a BOM: ripgrep transcodes it
            if b"\x00" not in data:
                _scan(data, pattern, child, matches, cap)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _read_small(fd: int, budget: list[int]) -> bytes | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return None
    budget[0] -= 1
    if budget[0] < 0 or st.st_size > budget[1]:
        raise _TooBig
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, max(st.st_size + 1, 1 << 12)):
        total += len(chunk)
        if total > budget[1]:
            raise _TooBig  # grew while being read
        chunks.append(chunk)
    budget[1] -= total
    return b"".join(chunks)


def _scan(data: bytes, pattern: bytes, spath: str, matches: list[dict[str, Any]], cap: int) -> None:
    """Every line holding ``pattern``, once per line, with its 1-based number."""
    line_no, counted = 1, 0
    at = data.find(pattern)
    while at >= 0 and len(matches) <= cap:
        start = data.rfind(b"\n", 0, at) + 1
        line_no += data.count(b"\n", counted, start)
        counted = start
        end = data.find(b"\n", at)
        if end < 0:
            end = len(data)
        text = data[start:end][: MAX_LINE_CHARS * 4].decode("utf-8", "replace")
        matches.append({"path": spath, "line": line_no, "text": text[:MAX_LINE_CHARS]})
        at = data.find(pattern, end + 1)


def _open_target(res: Resolved) -> tuple[int, bool]:
    """Open what to search: a directory, or one regular file (FIFOs and devices refused)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
    if res.name is None:
        return res.open(flags | os.O_DIRECTORY), True
    fd = res.open(flags)
    st = os.fstat(fd)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        os.close(fd)
        raise InvalidRequest("not a regular file or directory")
    return fd, stat.S_ISDIR(st.st_mode)


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv", path="/usr/bin:/bin")

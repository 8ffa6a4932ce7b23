"""``/fs/grep``: small trees in process, anything else by ripgrep inside the sandbox.

ripgrep (PyPI ``ripgrep==14.1.0`` or the system ``rg``) is started through the
sandbox's runtime (:meth:`~sandlot.runtime.base.SandboxRuntime.spawn_tool`), like
the sandbox's own commands: in an isolated sandbox it runs in its namespaces,
cgroup and limits, as its user, seeing the sandbox's files only. It is bounded:

- a deadline (``grep_timeout_seconds``, 30 s by default): the search is killed and
  the answer is what it found so far, ``truncated``;
- the regex: ripgrep's engines are linear in the input, and its size limits
  (:data:`REGEX_SIZE_LIMIT`) refuse a pattern whose compiled form would be huge
  (``a{1000}{1000}``) at once: 400 INVALID_REQUEST;
- its output: at most the match cap and :data:`MAX_OUTPUT_BYTES` are read, then it
  is killed (``truncated``);
- it is killed when the request ends early (the client went away) and, by the
  runtime's launcher (``runtime/limit.c``), as soon as nobody reads its output: a
  server that died or stopped leaves no search running.

Its output is read on the event loop as it comes (a chunk per wakeup). Patterns
are literal unless ``regex`` is set. ``.git`` directories are skipped; hidden
files and ignored files are searched (like ``grep -r``); symlinks are not followed
while walking.

Starting ripgrep costs a few milliseconds, far more than searching the small
trees agents usually grep. A literal, case-sensitive search of a small tree
(at most ``SMALL_TREE_FILES`` files and ``SMALL_TREE_BYTES`` bytes) is done in
process with ripgrep's semantics, on confined descriptors (no symlink followed,
hidden files searched, ``.git`` skipped, files with a NUL byte skipped as binary)
and with the same identity as every file operation; anything else, or a tree
found larger while walking, goes to ripgrep. A user's regular expression is never
run in process (Python's ``re`` backtracks): ``regex`` and ``ignore_case`` always
go to ripgrep; the in-process search looks for a literal (``bytes.find`` or
``memmem``, linear) and matches file names with a glob of ``*``, ``?`` and
character classes (linear, see ``native.c``'s ``glob_match`` and ``fnmatch``).

The in-process search is done by the C library (:mod:`sandlot.dataplane.services.native`)
when it is built, else in Python (:func:`_search_small`, the reference the C
code is tested against). A tree of at most ``INLINE_FILES`` files and
``INLINE_BYTES`` bytes is searched on the event loop thread, like a stat:
that takes less time than handing it to a thread.

A small tree read by a search is then copied in the background for the next
searches of it (:mod:`sandlot.dataplane.services.grepcache`), which read the copy for as
long as nothing in the tree changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import itertools
import json
import logging
import os
import posixpath
import re
import signal
import stat
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

from sandlot.dataplane.services import grepcache, native
from sandlot.dataplane.services.fsids import FsExecutor
from sandlot.dataplane.services.paths import PathResolver, Resolved, os_error
from sandlot.protocol.common import json_bytes
from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable
from sandlot.runtime.base import SandboxProcess, SandboxRuntime
from sandlot.runtime.tools import RIPGREP, ToolUnavailable, host_ripgrep

log = logging.getLogger("sandlot.dataplane.services.grep")

MAX_LINE_CHARS = 2000
SMALL_TREE_FILES = 256
#: Entries a directory of a small tree may hold (native.c's ``MAX_DIR_ENTRIES``): one with
#: more is searched by ripgrep, in a process of its own.
MAX_DIR_ENTRIES = 4096
SMALL_TREE_BYTES = 4 << 20
#: Directories below the one searched in process; a deeper tree goes to ripgrep.
MAX_DEPTH = 64
#: A tree searched on the event loop thread (by the C library) holds no more than this.
INLINE_FILES = 64
INLINE_BYTES = 1 << 20
#: How long one search may run unless the caller says otherwise (``grep_timeout_seconds``).
DEFAULT_TIMEOUT = 30.0
#: ripgrep's ``--regex-size-limit`` and ``--dfa-size-limit`` (the regex crate's own default
#: size limit; ripgrep's defaults, 100M and 1000M, let ``a{1000}{1000}`` compile).
REGEX_SIZE_LIMIT = "10M"
#: ripgrep output read per search at most (then ``truncated``).
MAX_OUTPUT_BYTES = 64 << 20
#: A longer output line is skipped (ripgrep's own are under ~12 KiB: ``--max-columns``).
MAX_OUTPUT_LINE = 64 << 10
#: The launcher's own deadline is this much later than the server's: the server is the
#: one that stops a search, unless it is not there any more.
LIMIT_GRACE = 2.0

#: ripgrep on the host (kept for callers that run it directly: the benchmarks).
ripgrep_path = host_ripgrep

_RG_OPTIONS = (
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
    f"--regex-size-limit={REGEX_SIZE_LIMIT}",
    f"--dfa-size-limit={REGEX_SIZE_LIMIT}",
)


async def grep(
    runtime: SandboxRuntime,
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
    timeout: float = DEFAULT_TIMEOUT,
    disconnected: Callable[[], Awaitable[object]] | None = None,
) -> bytes:
    """The ``/fs/grep`` answer (JSON text).

    ``timeout``: how long ripgrep may search; ``disconnected``: resolves when the
    client has gone away (the search then stops).
    """
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

    def run() -> bytes | _Target:
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
                        return json_bytes(result)
                return _Target.of(res)
        except OSError as exc:
            raise os_error(exc) from None

    # Resolving alone is cheap (inline); a small search may read files (on the pool).
    answer = await (executor.heavy(run) if small else executor.light(run))
    if fast is not None:
        fast.copy_later(executor, resolver, path)
    if isinstance(answer, bytes):
        return answer
    result = await _ripgrep(runtime, answer, [*flags, "-e", pattern], cap, timeout, disconnected)
    return json_bytes(result)


class _NativeSearch:
    """A small-tree search by the C library (:mod:`sandlot.dataplane.services.native`)."""

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


@dataclass
class _Target:
    """What ripgrep searches: ``arg`` (``.`` or a file's name) in directory ``cwd``."""

    #: The directory, opened by the server (owned: closed once ripgrep started).
    fd: int
    #: Its sandbox path.
    cwd: str
    arg: str
    #: Sandbox path of the directory or file searched.
    base: str
    is_dir: bool

    @classmethod
    def of(cls, res: Resolved) -> _Target:
        fd, is_dir = _open_target(res)
        if is_dir or res.name is None:
            return cls(fd, res.sandbox_path, ".", res.sandbox_path.rstrip("/"), True)
        os.close(fd)  # a regular file (checked): ripgrep opens it by name in its directory
        parent = os.dup(res.dir_fd)
        return cls(parent, posixpath.dirname(res.sandbox_path), res.name, res.sandbox_path, False)


#: What ripgrep prints after ``path: `` about a binary file: after the file's matches
#: (found while walking) or instead of them (the file named on its command line).
_BINARY_NOTE = re.compile(
    rb"(?:WARNING: stopped searching binary file after match|binary file matches)"
    rb' \(found "[^"\n]*" byte around offset [0-9]+\)\n'
)


class _Output:
    """ripgrep's ``--null`` output, parsed as it comes, bounded in matches and bytes.

    A match is ``path NUL line-number ":" text LF``. A file name may hold a newline but
    never a NUL, and the text never holds a LF (nor a NUL: binary files are not
    printed), so a record is read up to its NUL first, then up to its LF. The one line
    without a NUL is ripgrep's note on a binary file (:data:`_BINARY_NOTE`), which names
    the file whose matches it just printed, or the file it was given: it is skipped.
    """

    def __init__(self, target: _Target, cap: int) -> None:
        self.target = target
        self.cap = cap
        self.matches: list[dict[str, Any]] = []
        #: Stopped before ripgrep finished (cap, size, deadline, client gone).
        self.truncated = False
        self.read = 0
        self._pending = b""
        #: Separators to skip through before the next record (the rest of one too long).
        self._skipping: list[bytes] = []
        arg = os.fsencode(target.arg)
        self._prefix = len(arg)
        #: The path of the file ripgrep printed last (a binary note names it): the file
        #: named on its command line, if one is.
        self._last = b"" if target.is_dir else arg
        self._paths: dict[bytes, str] = {}

    def feed(self, chunk: bytes) -> bool:
        """Take a chunk of output; ``True`` once no more is wanted (``truncated``)."""
        self.read += len(chunk)
        buf = self._pending + chunk
        at = 0
        while at < len(buf):
            if self._skipping:
                end = buf.find(self._skipping[0], at)
                if end < 0:
                    at = len(buf)
                    break
                del self._skipping[0]
                at = end + 1
                continue
            note = self._note(buf, at)
            if note is None:
                break
            if note > at:
                at = note
                continue
            nul = buf.find(b"\x00", at)
            end = buf.find(b"\n", nul + 1) if nul >= 0 else -1
            if end < 0:
                if len(buf) - at > MAX_OUTPUT_LINE:
                    # Dropped, and the rest of it skipped as it comes: its text (or its
                    # path, which cannot be this long, and then its text).
                    self._skipping = [b"\n"] if nul >= 0 else [b"\x00", b"\n"]
                    at = len(buf)
                break
            name = buf[at:nul]
            lineno, _, text = buf[nul + 1 : end].partition(b":")
            at = end + 1
            if not lineno.isdigit():
                continue
            if len(self.matches) >= self.cap:
                self.truncated = True
                return True
            self._last = name
            self.matches.append(
                {"path": self._path(name), "line": int(lineno), "text": _line(text)}
            )
        self._pending = buf[at:]
        if self.read > MAX_OUTPUT_BYTES:
            self.truncated = True
            return True
        return False

    def _note(self, buf: bytes, at: int) -> int | None:
        """Where a binary note starting at ``at`` ends; ``at`` when none starts there,
        ``None`` when the output so far cannot tell."""
        if not self._last:
            return at
        head = self._last + b": "
        if not buf.startswith(head, at):
            cut = len(buf) - at < len(head) and head.startswith(buf[at:])
            return None if cut else at
        start = at + len(head)
        found = _BINARY_NOTE.match(buf, start)
        if found is not None:
            return found.end()
        # A note holds neither NUL nor LF before its end: with neither yet, it may be cut.
        cut = (
            len(buf) - start <= MAX_OUTPUT_LINE
            and buf.find(b"\n", start) < 0
            and buf.find(b"\x00", start) < 0
        )
        return None if cut else at

    def _path(self, name: bytes) -> str:
        spath = self._paths.get(name)
        if spath is None:
            target = self.target
            # A name that is not UTF-8 is told as every file operation tells it (as
            # os.fsdecode does: \udcXX for each byte that is not).
            rel = os.fsdecode(name[self._prefix :].lstrip(b"/"))
            spath = f"{target.base}/{rel}" if target.is_dir and rel else target.base
            self._paths[name] = spath
        return spath


def _line(text: bytes) -> str:
    return text[: MAX_LINE_CHARS * 4].decode("utf-8", "replace")[:MAX_LINE_CHARS]


async def _ripgrep(
    runtime: SandboxRuntime,
    target: _Target,
    args: list[str],
    cap: int,
    timeout: float,
    disconnected: Callable[[], Awaitable[object]] | None,
) -> dict[str, Any]:
    """Run ripgrep for ``target`` through the runtime and collect its matches."""
    argv = [*_RG_OPTIONS, *args, "--", target.arg]
    try:
        try:
            proc = await runtime.spawn_tool(
                RIPGREP, argv, cwd=target.cwd, cwd_fd=target.fd, deadline=timeout + LIMIT_GRACE
            )
        finally:
            os.close(target.fd)
    except (ToolUnavailable, FileNotFoundError):
        raise ProviderUnavailable(
            "ripgrep is not available in this sandbox (a sandbox started by an older "
            "version has none: recreate it)"
        ) from None
    except PermissionError as exc:
        # Its directory became one the sandbox user cannot enter since it was checked.
        raise os_error(exc) from None
    except OSError as exc:
        raise ProviderUnavailable(f"cannot start ripgrep: {exc.strerror or exc}") from None
    out = _Output(target, cap)
    err, stopped = await _collect(proc, out, timeout, disconnected)
    status = None
    if not stopped:
        with contextlib.suppress(TimeoutError):
            status = await asyncio.wait_for(proc.wait(), 5.0)
    if status is None:  # stopped by us (or it lingers after closing its output)
        proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(TimeoutError):  # reaped (a frozen sandbox: later)
            await asyncio.wait_for(proc.wait(), 2.0)
        return {"matches": out.matches, "truncated": True}
    if status.exit_code == 2 and not out.matches:
        _check_usage(err)
    if status.exit_code in (126, 127) and b"sandlot-limit" in err:
        message = err.decode("utf-8", "replace").strip().splitlines()[-1]
        raise ProviderUnavailable(f"cannot run ripgrep in this sandbox: {message}")
    # Exit statuses 0 (matches), 1 (none) and 2 (some files unreadable) are answers; a
    # search ended otherwise (its launcher's deadline, a signal, the sandbox's memory
    # limit) answers what it found.
    truncated = out.truncated or status.exit_code not in (0, 1, 2)
    return {"matches": out.matches, "truncated": truncated}


def _check_usage(err: bytes) -> None:
    """A pattern or glob ripgrep refused: 400 with its reason."""
    text = err.decode("utf-8", "replace")
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    if "exceeds size limit" in text:
        raise InvalidRequest(
            f"regular expression too large: its compiled form exceeds {REGEX_SIZE_LIMIT}B "
            "(bounded repetitions multiply: a{1000}{1000} is a million states)"
        )
    if "regex" in text.lower():
        detail = " ".join(line.strip() for line in text.strip().splitlines()[1:])[:300]
        raise InvalidRequest(f"invalid regular expression: {detail or first}")
    if "glob" in text.lower():
        raise InvalidRequest(f"invalid glob: {first.removeprefix('rg: ')}")


async def _collect(
    proc: SandboxProcess,
    out: _Output,
    timeout: float,
    disconnected: Callable[[], Awaitable[object]] | None,
) -> tuple[bytes, bool]:
    """Read ripgrep's output until it ends, the output is enough, ``timeout`` passes or
    the client goes away; ``(its stderr (the start of it), whether it was stopped)``.
    Whatever ends the wait (a cancellation included), ripgrep is killed unless it ended."""
    assert proc.stdout_fd is not None and proc.stderr_fd is not None
    if proc.stdin_fd is not None:
        os.close(proc.stdin_fd)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    err = bytearray()
    fds = {proc.stdout_fd, proc.stderr_fd}

    def closed(fd: int) -> None:
        loop.remove_reader(fd)
        fds.discard(fd)
        if not fds and not done.done():
            done.set_result(None)

    def read(fd: int) -> bytes | None:
        """The next chunk, ``b""`` once closed (the fd is let go), ``None`` if none yet."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            closed(fd)
        return chunk

    def on_stdout(fd: int) -> None:
        chunk = read(fd)
        if chunk and out.feed(chunk) and not done.done():
            done.set_result(None)  # enough: stopped below

    def on_stderr(fd: int) -> None:
        chunk = read(fd)
        if chunk and len(err) < 4096:
            err.extend(chunk[: 4096 - len(err)])

    loop.add_reader(proc.stdout_fd, on_stdout, proc.stdout_fd)
    loop.add_reader(proc.stderr_fd, on_stderr, proc.stderr_fd)
    gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
    ended = False
    try:
        waiting: set[asyncio.Future[Any]] = {done} if gone is None else {done, gone}
        await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        ended = done.done() and not out.truncated
    finally:
        if gone is not None:
            gone.cancel()
        for fd in (proc.stdout_fd, proc.stderr_fd):
            if fd in fds:
                loop.remove_reader(fd)
            os.close(fd)
        if not ended:
            out.truncated = True
            proc.send_signal(signal.SIGKILL)
    return bytes(err), not ended


def _simple_glob(glob: str | None) -> bool:
    """A glob whose ripgrep meaning is fnmatch's on the file name (no ``/``, braces, ``!``,
    and character classes ripgrep takes: closed, ranges in order). ripgrep refuses the
    others (400), where fnmatch would read an unclosed ``[`` as itself."""
    if glob is None:
        return True
    if any(c in glob for c in "/{}!\\"):
        return False
    at = 0
    while (at := glob.find("[", at)) >= 0:
        end = glob.find("]", at + 2)  # a "]" right after "[" is a member
        if end < 0:
            return False
        members = glob[at + 1 : end]
        for k in range(1, len(members) - 1):
            if members[k] == "-" and members[k - 1] > members[k + 1]:
                return False
        at = end + 1
    return True


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
        # Read no further than a small tree's directory may hold: a directory of a million
        # entries, read and sorted whole, held the event loop for seconds. (Closed, the
        # iterator rewinds the descriptor it shares the offset of.)
        with os.scandir(dfd) as it:
            entries = list(itertools.islice(it, MAX_DIR_ENTRIES + 1))
    except OSError:
        return
    if len(entries) > MAX_DIR_ENTRIES:
        raise _TooBig
    entries.sort(key=lambda e: e.name)
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
        fd, is_dir = res.open(flags | os.O_DIRECTORY), True
    else:
        fd = res.open(flags)
        st = os.fstat(fd)
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            os.close(fd)
            raise InvalidRequest("not a regular file or directory")
        is_dir = stat.S_ISDIR(st.st_mode)
    if is_dir:
        # A directory the sandbox user may list but not enter (mode 0444): its files
        # cannot be opened, nor can ripgrep start in it. Both searches refuse it alike
        # (403), rather than one answering nothing and the other failing to start.
        try:
            os.stat(".", dir_fd=fd, follow_symlinks=False)
        except OSError:
            os.close(fd)
            raise
    return fd, is_dir

"""Native filesystem operations of PROTOCOL.md 3.5/3.6, confined by :mod:`paths`.

Every operation is a plain function of a :class:`~sandlot.dataplane.services.paths.PathResolver`
(no HTTP here). Writes never modify an existing inode: content goes to a
temporary file in the same directory, is fsynced and renamed over the name,
so a hard link planted in the workspace can never be used to write a file
outside it, and a reader never sees half a file. The etag is a hash of the
content (BLAKE2b, 128 bits).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any, Literal

from sandlot.dataplane.services import globworker, native
from sandlot.dataplane.services.globbing import split_base
from sandlot.dataplane.services.paths import PathResolver, Resolved, normalize, os_error
from sandlot.dataplane.services.treewalk import remove_tree
from sandlot.protocol.dataplane import EditResponse, ReadResponse, StatResponse, WriteResponse
from sandlot.protocol.errors import (
    InvalidRequest,
    PayloadTooLarge,
    PreconditionFailed,
    ProviderUnavailable,
    RateLimited,
    ResourceConflict,
    SandlotError,
    exception_for,
)

_O_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
_O_DIR = os.O_RDONLY | os.O_DIRECTORY

#: ``(sandbox path, op, extra)`` reported for every change made through the API.
Change = tuple[str, str, dict[str, Any]]


def _jstr(text: str) -> str:
    """A JSON string literal. ASCII-escaped: a file name that is not valid UTF-8 (a lone
    surrogate from ``os.fsdecode``) still serialises, as ``\\udcXX``."""
    return encode_basestring_ascii(text)


def etag_of(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@functools.lru_cache(maxsize=4096)
def _iso_seconds(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def iso(ts: float) -> str:
    # Files of one directory mostly share their second: cache that part.
    seconds = int(ts)
    return f"{_iso_seconds(seconds)}.{int((ts - seconds) * 1000):03d}Z"


def _join(parent: str, name: str) -> str:
    return f"{parent.rstrip('/')}/{name}"


def open_regular(res: Resolved, flags: int = _O_READ) -> tuple[int, os.stat_result]:
    """Open the final component for reading; FIFOs, devices and sockets are refused.

    ``O_NONBLOCK`` keeps a FIFO from hanging the open; ``fstat`` then refuses it.
    """
    if res.name is None:
        raise InvalidRequest("is a directory")
    fd = res.open(flags)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InvalidRequest("is a directory")
        raise InvalidRequest("not a regular file")
    return fd, st


#: ``stat`` gives the etag of a file up to this size (it reads the file to hash it).
STAT_ETAG_BYTES = 1 << 20

#: Conditional writes and edits of one file take turns, from reading and checking the
#: file to renaming the new content over it: otherwise two of them can both check the
#: same content, both answer 200, and the second rename loses the first change. A fixed
#: set of locks, chosen by the file's host path, keeps memory bounded whatever the
#: number of files; unrelated files that share a lock only wait for each other's short
#: read-write-fsync. One lock per operation at most, so no deadlock is possible.
_FILE_LOCKS = tuple(threading.Lock() for _ in range(64))


def file_lock(res: Resolved) -> threading.Lock:
    return _FILE_LOCKS[hash(str(res.host_path)) % len(_FILE_LOCKS)]


def read_all(fd: int, limit: int, size_hint: int = 0) -> bytes:
    """The content of ``fd`` up to ``limit + 1`` bytes, never more.

    A result longer than ``limit`` means the file holds more than that: callers refuse
    it as they refuse a file whose size is over the limit. The size ``fstat`` reported
    is not enough, as a command in the sandbox may grow the file while it is read (a
    sparse ``ftruncate`` to 1 GiB takes no time). ``size_hint``, that reported size,
    sizes the reads so an unchanged file is read in one call.
    """
    chunks: list[bytes] = []
    remaining = limit + 1
    while remaining > 0:
        chunk = os.read(fd, min(remaining, max(size_hint, 65536)))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def line_range(text: str, start: int, end: int) -> str:
    """Lines ``start`` to ``end`` (exclusive) of ``text``, each with its newline.

    Lines end at "\\n" only, as :meth:`FileOps.read` counts them: ``str.splitlines``
    would also split at \\r, \\f, \\u2028 and others, and disagree with that count.
    """
    lines = text.split("\n")
    content = "\n".join(lines[start:end])
    # Every piece of the split but the last was followed by a newline.
    return content + "\n" if start < end < len(lines) else content


class _Listing:
    """What one listing gathered so far: JSON text and how many entries it holds."""

    __slots__ = ("count", "limit", "out")

    def __init__(self, out: list[str], limit: int) -> None:
        self.out = out
        self.limit = limit
        self.count = 0


def _scan_dir(acc: _Listing, fd: int, base: str, depth: int) -> bool:
    prefix = base.rstrip("/") + "/"
    fast = native.ready()
    subdirs: list[str]
    if fast is None:
        truncated, subdirs = _scan_py(acc, fd, prefix, depth)
    else:
        try:
            text, count, truncated, subdirs = fast.scan(
                fd, _jstr(prefix)[1:-1].encode("ascii"), acc.limit - acc.count, depth > 1
            )
        except native.Unsupported:
            os.lseek(fd, 0, os.SEEK_SET)  # scandir reads on from the shared offset
            truncated, subdirs = _scan_py(acc, fd, prefix, depth)
        else:
            if count:
                acc.out.append(text)
                acc.count += count
    if truncated:
        return True
    for name in subdirs:
        try:
            sub = os.open(name, _O_DIR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            continue
        try:
            if _scan_dir(acc, sub, prefix + name, depth - 1):
                return True
        finally:
            os.close(sub)
    return False


def _scan_py(acc: _Listing, fd: int, prefix: str, depth: int) -> tuple[bool, list[str]]:
    """One directory, the reference way: (truncated, the subdirectories to descend)."""
    room = acc.limit - acc.count
    subdirs: list[str] = []
    parts: list[str] = []
    # Entries that cannot be looked at count towards the bound too (native.c's scan).
    skipped = 0
    try:
        with os.scandir(fd) as it:
            for entry in it:
                if len(parts) + skipped >= room:
                    return True, subdirs
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    skipped += 1
                    continue
                mode = st.st_mode
                is_dir = stat.S_ISDIR(mode)
                link = ',"is_symlink":true' if stat.S_ISLNK(mode) else ""
                parts.append(
                    f'{{"path":{_jstr(prefix + entry.name)},'
                    f'"is_dir":{"true" if is_dir else "false"},"size":{st.st_size},'
                    f'"modified_at":"{iso(st.st_mtime)}"{link}}}'
                )
                if is_dir and depth > 1:
                    subdirs.append(entry.name)
    finally:
        if parts:
            acc.out.extend(parts)
            acc.count += len(parts)
    return False, subdirs


@dataclass
class FileOps:
    resolver: PathResolver
    max_read_bytes: int
    max_write_bytes: int
    max_list_entries: int
    max_glob_results: int
    #: A glob stops (``truncated``) after this long or this many directory entries.
    glob_deadline_seconds: float = 10.0
    max_glob_visits: int = 2_000_000
    #: Where the glob helpers work while they work for this sandbox (its cgroup).
    charge: globworker.Charge | None = None
    #: Globs of this sandbox running at once (the others wait their turn).
    _glob_slots: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(2), repr=False
    )

    def __post_init__(self) -> None:
        globworker.warm()

    # --- reading ----------------------------------------------------------------------

    def read_bytes(self, path: str, limit: int | None = None) -> tuple[str, bytes]:
        limit = self.max_read_bytes if limit is None else limit
        try:
            with self.resolver.resolve(path) as res:
                fd, st = open_regular(res)
                try:
                    if st.st_size > limit:
                        raise PayloadTooLarge(
                            f"file is larger than {limit} bytes; use /files/download",
                            metadata={"size": st.st_size, "limit": limit},
                        )
                    data = read_all(fd, limit, st.st_size)
                finally:
                    os.close(fd)
                if len(data) > limit:
                    # It grew while it was read.
                    raise PayloadTooLarge(
                        f"file is larger than {limit} bytes; use /files/download",
                        metadata={"limit": limit},
                    )
                return res.sandbox_path, data
        except OSError as exc:
            raise os_error(exc) from None

    def size_hint(self, path: str) -> int:
        """The size of the file a read of ``path`` would read; 0 when the read would fail
        (it then says why)."""
        try:
            with self.resolver.resolve(path) as res:
                return 0 if res.name is None else res.lstat().st_size
        except (OSError, SandlotError):
            return 0

    def read(self, path: str, offset: int, limit: int) -> ReadResponse:
        spath, data = self.read_bytes(path)
        etag = etag_of(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return ReadResponse(
                path=spath,
                content=base64.b64encode(data).decode("ascii"),
                encoding="base64",
                total_lines=0,
                start_line=0,
                end_line=0,
                next_offset=None,
                etag=etag,
                size=len(data),
            )
        newlines = text.count("\n")
        total = newlines + (1 if text and not text.endswith("\n") else 0)
        if offset == 0 and limit >= total:
            content, end = text, total
        else:
            start = min(offset, total)
            end = min(total, start + limit)
            content = line_range(text, start, end)
        return ReadResponse(
            path=spath,
            content=content,
            encoding="utf-8",
            total_lines=total,
            start_line=min(offset, total),
            end_line=end,
            next_offset=end if end < total else None,
            etag=etag,
            size=len(data),
        )

    def current_etag(self, res: Resolved) -> str | None:
        try:
            fd, st = open_regular(res)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                return None
            raise
        try:
            if st.st_size > self.max_read_bytes:
                raise PayloadTooLarge("file too large for a conditional write")
            data = read_all(fd, self.max_read_bytes, st.st_size)
        finally:
            os.close(fd)
        if len(data) > self.max_read_bytes:
            raise PayloadTooLarge("file too large for a conditional write")
        return etag_of(data)

    # --- writing ----------------------------------------------------------------------

    def write(
        self,
        path: str,
        data: bytes,
        *,
        if_match: str | None = None,
        if_none_match: str | None = None,
    ) -> tuple[WriteResponse, Change]:
        if len(data) > self.max_write_bytes:
            raise PayloadTooLarge(f"content larger than {self.max_write_bytes} bytes")
        try:
            with self.resolver.resolve(path, create_parents=True, for_write=True) as res:
                if res.name is None:
                    raise InvalidRequest("is a directory")
                # An unconditional write needs no turn: whichever rename comes last wins.
                conditional = if_match is not None or if_none_match == "*"
                guard: contextlib.AbstractContextManager[object] = (
                    file_lock(res) if conditional else contextlib.nullcontext()
                )
                with guard:
                    existing = self._existing_mode(res)
                    if if_none_match == "*" and existing is not None:
                        raise PreconditionFailed("file already exists", metadata={"path": path})
                    if if_match is not None:
                        current = self.current_etag(res)
                        if current != if_match.strip('"'):
                            raise PreconditionFailed(
                                "file changed since it was read",
                                metadata={"etag": current},
                            )
                    replace_file(res, [data], existing)
                op = "modified" if existing is not None else "created"
                etag = etag_of(data)
                return (
                    WriteResponse(path=res.sandbox_path, etag=etag, created=existing is None),
                    (res.sandbox_path, op, {"size": len(data)}),
                )
        except OSError as exc:
            raise os_error(exc) from None

    @staticmethod
    def _existing_mode(res: Resolved) -> int | None:
        try:
            st = res.lstat()
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(st.st_mode):
            raise InvalidRequest("is a directory")
        if stat.S_ISLNK(st.st_mode):
            # A symlink that resolution did not follow (dangling or swapped in): the
            # rename replaces the link itself, never its target.
            return 0o644
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest("not a regular file")
        return stat.S_IMODE(st.st_mode)

    def edit(
        self,
        path: str,
        old: str,
        new: str,
        *,
        replace_all: bool,
        if_match: str | None,
    ) -> tuple[EditResponse, Change]:
        try:
            with self.resolver.resolve(path, for_write=True) as res, file_lock(res):
                fd, st = open_regular(res)
                try:
                    if st.st_size > self.max_write_bytes:
                        raise PayloadTooLarge("file too large to edit")
                    data = read_all(fd, self.max_write_bytes, st.st_size)
                finally:
                    os.close(fd)
                if len(data) > self.max_write_bytes:
                    raise PayloadTooLarge("file too large to edit")  # it grew while read
                if if_match is not None and etag_of(data) != if_match.strip('"'):
                    raise PreconditionFailed(
                        "file changed since it was read", metadata={"etag": etag_of(data)}
                    )
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequest("file is not UTF-8 text") from None
                count = text.count(old)
                if count == 0:
                    raise InvalidRequest("old_string not found", metadata={"occurrences": 0})
                if count > 1 and not replace_all:
                    raise InvalidRequest(
                        f"old_string occurs {count} times; pass replace_all or more context",
                        metadata={"occurrences": count},
                    )
                # The size of the result, known before building it: a short old_string
                # replaced everywhere by a long one would otherwise build gigabytes
                # first. (Occurrences in the UTF-8 bytes are those in the text.)
                grows_by = len(new.encode()) - len(old.encode())
                if len(data) + count * grows_by > self.max_write_bytes:
                    raise PayloadTooLarge("edited file too large")
                out = (
                    text.replace(old, new) if replace_all else text.replace(old, new, 1)
                ).encode()
                replace_file(res, [out], stat.S_IMODE(st.st_mode))
                return (
                    EditResponse(path=res.sandbox_path, occurrences=count, etag=etag_of(out)),
                    (res.sandbox_path, "modified", {"size": len(out)}),
                )
        except OSError as exc:
            raise os_error(exc) from None

    # --- metadata ---------------------------------------------------------------------

    def stat(self, path: str) -> StatResponse:
        try:
            with self.resolver.resolve(path) as res:
                st = res.lstat()
                kind: Literal["file", "directory", "symlink", "other"] = (
                    "directory"
                    if stat.S_ISDIR(st.st_mode)
                    else "file"
                    if stat.S_ISREG(st.st_mode)
                    else "symlink"
                    if stat.S_ISLNK(st.st_mode)
                    else "other"
                )
                etag = None
                if kind == "file" and st.st_size <= STAT_ETAG_BYTES:
                    fd, _ = open_regular(res)
                    try:
                        data = read_all(fd, STAT_ETAG_BYTES, st.st_size)
                    finally:
                        os.close(fd)
                    # A file that grew past the bound while it was read gets none.
                    if len(data) <= STAT_ETAG_BYTES:
                        etag = etag_of(data)
                return StatResponse(
                    path=res.sandbox_path,
                    type=kind,
                    size=st.st_size,
                    mode=stat.S_IMODE(st.st_mode),
                    modified_at=iso(st.st_mtime),
                    etag=etag,
                )
        except OSError as exc:
            raise os_error(exc) from None

    def list_dir(self, path: str, depth: int) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.list_json(path, depth))
        return result

    def list_json(self, path: str, depth: int) -> bytes:
        """The ``/fs/list`` answer, serialised while scanning.

        Listings are the one place where per-entry cost adds up (thousands of
        entries): each entry is formatted straight to JSON text instead of going
        through a dict and ``json.dumps``.
        """
        if not 1 <= depth <= 64:
            raise InvalidRequest("depth must be between 1 and 64")
        parts: list[str] = []
        virtual = self.resolver.virtual_children(normalize(path))
        if virtual is not None:
            # A directory of the sandbox's view that no mount backs: show the mounts in it.
            base = normalize(path).rstrip("/")
            parts = [
                f'{{"path":{_jstr(f"{base}/{name}")},"is_dir":true,"size":0,"modified_at":null}}'
                for name in virtual
            ]
            truncated = False
        else:
            try:
                with self.resolver.resolve(path) as res:
                    fd = res.open(_O_DIR)
                    try:
                        truncated = self._scan(fd, res.sandbox_path, depth, parts)
                    finally:
                        os.close(fd)
            except OSError as exc:
                raise os_error(exc) from None
        tail = "true" if truncated else "false"
        return f'{{"entries":[{",".join(parts)}],"truncated":{tail}}}'.encode()

    def _scan(self, fd: int, base: str, depth: int, out: list[str]) -> bool:
        """Append the entries under ``fd`` (``depth`` levels) to ``out``; True if truncated.

        ``out`` gets JSON text: one entry per element from the Python path, a whole
        directory's entries joined by commas from the C one (:mod:`native`).
        """
        return _scan_dir(_Listing(out, self.max_list_entries), fd, base, depth)

    # --- changing the tree ------------------------------------------------------------

    def delete(self, path: str, recursive: bool) -> Change:
        try:
            with self.resolver.resolve(path, follow_final=False, for_write=True) as res:
                if res.name is None:
                    raise InvalidRequest("cannot delete a mount point")
                st = res.lstat()
                if stat.S_ISDIR(st.st_mode):
                    if recursive:
                        remove_tree(res.dir_fd, res.name)
                    else:
                        os.rmdir(res.name, dir_fd=res.dir_fd)
                else:
                    os.unlink(res.name, dir_fd=res.dir_fd)
                return (res.sandbox_path, "deleted", {"is_dir": stat.S_ISDIR(st.st_mode)})
        except OSError as exc:
            raise os_error(exc) from None

    def mkdir(self, path: str, *, parents: bool, exist_ok: bool) -> tuple[str, Change | None]:
        try:
            with self.resolver.resolve(path, create_parents=parents, for_write=True) as res:
                if res.name is None:
                    if exist_ok:
                        return res.sandbox_path, None
                    raise ResourceConflict("already exists")
                try:
                    os.mkdir(res.name, 0o755, dir_fd=res.dir_fd)
                except FileExistsError:
                    st = res.lstat()
                    if exist_ok and stat.S_ISDIR(st.st_mode):
                        return res.sandbox_path, None
                    raise
                return res.sandbox_path, (res.sandbox_path, "created", {"is_dir": True})
        except OSError as exc:
            raise os_error(exc) from None

    def move(self, src: str, dst: str, *, overwrite: bool) -> Change:
        try:
            with (
                self.resolver.resolve(src, follow_final=False, for_write=True) as s,
                self.resolver.resolve(
                    dst, follow_final=False, create_parents=True, for_write=True
                ) as d,
            ):
                if s.name is None or d.name is None:
                    raise InvalidRequest("cannot move a mount point")
                s.lstat()
                if overwrite:
                    os.rename(s.name, d.name, src_dir_fd=s.dir_fd, dst_dir_fd=d.dir_fd)
                else:
                    rename_noreplace(s.dir_fd, s.name, d.dir_fd, d.name)
                return (d.sandbox_path, "moved", {"from": s.sandbox_path})
        except OSError as exc:
            raise os_error(exc) from None

    # --- searching --------------------------------------------------------------------

    def glob(
        self,
        pattern: str,
        path: str,
        *,
        relative: bool = False,
        include_dirs: bool = False,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """:meth:`glob_json`, parsed."""
        body = self.glob_json(
            pattern, path, relative=relative, include_dirs=include_dirs, limit=limit
        )
        result: dict[str, Any] = json.loads(body)
        return result

    def glob_json(
        self,
        pattern: str,
        path: str,
        *,
        relative: bool = False,
        include_dirs: bool = False,
        limit: int | None = None,
        size_bytes: bool = False,
    ) -> bytes:
        """The ``/fs/glob`` answer as JSON text, walked by a helper process
        (:mod:`globworker`) as the calling thread's filesystem identity.

        deepagents semantics by default; ``relative`` (LangSmith): the pattern always
        matches the path relative to ``path`` (``*`` lists one level) and directories
        are included with ``include_dirs``; ``size_bytes`` repeats ``size`` under
        LangSmith's name. Stops, ``truncated``, after :attr:`glob_deadline_seconds`
        or :attr:`max_glob_visits` entries.
        """
        if "\x00" in pattern:
            raise InvalidRequest("pattern contains a NUL byte")
        deadline = time.monotonic() + self.glob_deadline_seconds
        base, rest = split_base(pattern)
        root = normalize(base if base.startswith("/") else _join(normalize(path), base))
        request: dict[str, Any] = {
            "pattern": rest,
            "anchored": "/" in pattern or relative,
            "include_dirs": include_dirs,
            "size_bytes": size_bytes,
            "cap": min(limit, self.max_glob_results) if limit else self.max_glob_results,
            "visits": self.max_glob_visits,
            "fs_ids": current_fs_ids(),
        }
        if not self._glob_slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RateLimited("too many globs running in this sandbox", retry_after=1.0)
        try:
            with self.resolver.resolve(root) as res:
                top = res.open(_O_DIR)
                try:
                    request["prefix"] = res.sandbox_path.rstrip("/")
                    request["seconds"] = max(0.0, deadline - time.monotonic())
                    answer = globworker.run(top, request, deadline, self.charge)
                finally:
                    os.close(top)
        except OSError as exc:
            raise os_error(exc) from None
        except globworker.Busy as exc:
            raise RateLimited(str(exc), retry_after=1.0) from None
        except globworker.Unavailable as exc:
            raise ProviderUnavailable(str(exc), retry_after=1.0) from None
        finally:
            self._glob_slots.release()
        if answer.startswith(b'{"error"'):
            err = json.loads(answer)["error"]
            if "errno" in err:
                raise os_error(OSError(err["errno"], err["message"]))
            raise exception_for(err["code"])(err["message"])
        return answer


def current_fs_ids() -> tuple[int, int] | None:
    """The calling thread's filesystem identity, when the server may switch identities."""
    if os.geteuid() != 0:
        return None
    from sandlot.dataplane.services.fsids import c_library

    libc = c_library()
    return libc.setfsuid(-1), libc.setfsgid(-1)


def replace_file(res: Resolved, chunks: list[bytes], mode: int | None) -> None:
    """Write ``chunks`` to a temporary file next to ``res``, fsync, rename over it."""
    assert res.name is not None
    fd, tmp = create_temp(res)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        commit_temp(res, fd, tmp, mode)
    except BaseException:
        abort_temp(res, fd, tmp)
        raise


def create_temp(res: Resolved) -> tuple[int, str]:
    tmp = f".sandlot-{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(tmp, flags, 0o600, dir_fd=res.dir_fd), tmp


def commit_temp(
    res: Resolved, fd: int, tmp: str, mode: int | None, *, durable: bool = True
) -> None:
    """Give the temp file its mode and rename it over the target.

    ``durable=False`` skips the per-file fsync for callers that write many
    files and flush them all at once with :func:`sync_filesystem`.
    """
    assert res.name is not None
    # The mode of the file replaced, or what a new file would get (0644 less umask-free).
    os.fchmod(fd, mode if mode is not None else 0o644)
    if durable:
        os.fsync(fd)
    os.close(fd)
    os.rename(tmp, res.name, src_dir_fd=res.dir_fd, dst_dir_fd=res.dir_fd)


def sync_filesystem(dir_fd: int) -> None:
    """Flush every file of the filesystem holding directory ``dir_fd`` (which may be an
    ``O_PATH`` descriptor): one syncfs for a whole batch of writes."""
    import ctypes

    from sandlot.dataplane.services.fsids import c_library

    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if c_library().syncfs(ctypes.c_int(fd)) != 0:
            os.fsync(fd)
    finally:
        os.close(fd)


def abort_temp(res: Resolved, fd: int, tmp: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp, dir_fd=res.dir_fd)


_RENAME_NOREPLACE = 1


def rename_noreplace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    import ctypes

    from sandlot.dataplane.services.fsids import c_library

    libc = c_library()
    rc = libc.renameat2(
        src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), ctypes.c_uint(_RENAME_NOREPLACE)
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def decode_content(content: str, encoding: str) -> bytes:
    if encoding == "base64":
        try:
            return base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("content is not valid base64") from None
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("content is not valid UTF-8") from None


def on_change_noop(*_: Any) -> None:
    return None


ChangeListener = Callable[[Change], None]

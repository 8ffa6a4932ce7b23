"""Archives in and out of a sandbox (PROTOCOL.md 3.5): a tar extracted member by member
through the confined resolver, a directory written as a tar.

Absolute names, ``..`` and links pointing out are refused, links are never followed;
hard links, devices and FIFOs are refused. Both run on threads (as the sandbox user),
fed by or feeding the event loop through a bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import queue
import secrets
import shutil
import stat
import tarfile
from collections.abc import Iterable, Iterator
from typing import Any

from sandlot.dataplane.services.fsids import FsExecutor
from sandlot.dataplane.services.fsops import sync_filesystem
from sandlot.dataplane.services.paths import PathResolver, normalize
from sandlot.dataplane.services.tarstream import TarError, TarStream
from sandlot.protocol.dataplane import ArchiveResponse
from sandlot.protocol.errors import InvalidRequest, PayloadTooLarge

CHUNK = 256 * 1024


def extract(
    resolver: PathResolver,
    base: str,
    chunks: Iterable[bytes],
    delete_missing: bool,
    limits: tuple[int, int],
) -> ArchiveResponse:
    max_bytes, max_members = limits
    files = dirs = total = 0
    seen: set[str] = set()
    base = normalize(base)
    top = base.rstrip("/")
    with resolver.resolve(base, create_parents=True, for_write=True) as root:
        if root.name is not None:
            with contextlib.suppress(FileExistsError):
                os.mkdir(root.name, 0o755, dir_fd=root.dir_fd)
    umask = _umask()
    # Members land in directories pinned by fd (resolved once per directory, not
    # once per file), so a symlink swapped in meanwhile cannot redirect them.
    with _DirCache(resolver) as parents:
        try:
            tar = TarStream(chunks)
            count = 0
            for member in tar:
                count += 1
                if count > max_members:
                    raise PayloadTooLarge("too many archive members")
                name = member.name
                if name.startswith("/") or "\x00" in name:
                    raise InvalidRequest(f"archive member has an absolute name: {name!r}")
                parts = [p for p in name.split("/") if p and p != "."]
                if ".." in parts:
                    raise InvalidRequest(f"archive member climbs out: {name!r}")
                if not parts:
                    continue
                rel = "/".join(parts)
                target = f"{top}/{rel}"
                # Directories implied by a member's name are part of the tree too.
                if target not in seen:
                    seen.add(target)
                    parent = target.rsplit("/", 1)[0]
                    while parent != top and parent not in seen:
                        seen.add(parent)
                        parent = parent.rsplit("/", 1)[0]
                kind = member.kind
                if kind == "file":
                    total += member.size
                    if total > max_bytes:
                        raise PayloadTooLarge("archive too large")
                    if resolver.is_mount_point(target):
                        raise InvalidRequest(f"archive member replaces a mount: {name!r}")
                    mode = stat.S_IMODE(member.mode) & 0o777 or 0o644
                    dir_fd = parents.get(target.rsplit("/", 1)[0] or "/")
                    _write_member(dir_fd, parts[-1], tar.data(), mode, umask)
                    files += 1
                elif kind == "dir":
                    parents.get(target)  # made now, and pinned for the files that follow
                    dirs += 1
                elif kind == "symlink":
                    _check_link(name, member.linkname, len(parts) - 1)
                    with resolver.resolve(
                        target, follow_final=False, create_parents=True, for_write=True
                    ) as res:
                        if res.name is None:
                            raise InvalidRequest("archive member replaces a mount")
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(res.name, dir_fd=res.dir_fd)
                        os.symlink(member.linkname, res.name, dir_fd=res.dir_fd)
                    files += 1
                else:
                    # Hard links, devices, FIFOs, sparse files: refused.
                    raise InvalidRequest(f"archive member type not allowed: {name!r}")
        except TarError as exc:
            raise InvalidRequest(
                "body is not a tar archive" if str(exc) in _NOT_TAR else f"corrupt archive: {exc}"
            ) from None
    deleted = _delete_missing(resolver, base, seen) if delete_missing else 0
    with resolver.resolve(base) as root:
        sync_filesystem(root.dir_fd)
    return ArchiveResponse(path=base, files=files, directories=dirs, deleted=deleted, bytes=total)


_NOT_TAR = ("not a tar archive", "empty body")


def _check_link(name: str, link: str, depth: int) -> None:
    """Links are kept only when they stay inside the extracted tree."""
    if link.startswith("/") or "\x00" in link:
        raise InvalidRequest(f"archive link points out: {name!r}")
    level = depth
    for p in link.split("/"):
        if p == "..":
            level -= 1
            if level < 0:
                raise InvalidRequest(f"archive link points out: {name!r}")
        elif p and p != ".":
            level += 1


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777  # unknown: every file gets its mode set explicitly


class _DirCache:
    """``O_PATH`` descriptors of the directories an extraction writes into."""

    LIMIT = 1024

    def __init__(self, resolver: PathResolver) -> None:
        self.resolver = resolver
        self.fds: dict[str, int] = {}

    def get(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is not None:
            return fd
        with self.resolver.resolve(path, create_parents=True, for_write=True) as res:
            if res.name is None:
                fd = os.dup(res.dir_fd)
            else:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(res.name, 0o755, dir_fd=res.dir_fd)
                flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(res.name, flags, dir_fd=res.dir_fd)
        if len(self.fds) >= self.LIMIT:
            self.close()
        self.fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> _DirCache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _write_member(
    dir_fd: int, name: str, data: Iterable[memoryview], mode: int, umask: int
) -> None:
    """Write one archive member.

    A new file is created under its own name (``O_EXCL``: nothing is replaced, as
    ``tar x`` does); a file that exists already is written beside it and renamed
    over it, so its readers see the old content or the new, never a mix. The
    mode is given at creation, and set again only when the umask takes bits
    away. The per-file fsync is skipped: the extraction ends with one syncfs.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    tmp: str | None = None
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except FileExistsError:
        tmp = f".sandlot-{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        for view in data:
            while view:
                view = view[os.write(fd, view) :]
        if mode & umask:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp or name, dir_fd=dir_fd)
        raise
    os.close(fd)
    if tmp is None:
        return
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _delete_missing(resolver: PathResolver, base: str, seen: set[str]) -> int:
    deleted = 0
    with resolver.resolve(base) as root:
        top = root.open(os.O_RDONLY | os.O_DIRECTORY)
        try:
            for dirpath, dirnames, filenames, dfd in os.fwalk(
                ".", dir_fd=top, follow_symlinks=False
            ):
                rel = dirpath[2:] if dirpath != "." else ""
                prefix = base.rstrip("/") + ("/" + rel if rel else "")
                keep = []
                for d in dirnames:
                    if f"{prefix}/{d}" in seen:
                        keep.append(d)
                    else:
                        shutil.rmtree(d, dir_fd=dfd)
                        deleted += 1
                dirnames[:] = keep
                for f in filenames:
                    if f"{prefix}/{f}" not in seen:
                        os.unlink(f, dir_fd=dfd)
                        deleted += 1
        finally:
            os.close(top)
    return deleted


class ChunkQueue:
    """Request chunks handed from the event loop to the extracting thread.

    A few chunks at most are held (bounded memory); the event loop waits for
    room without polling, woken by the thread as it takes a chunk.
    """

    DEPTH = 8

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=self.DEPTH)
        self._room = asyncio.Event()
        self._aborted = False

    async def put(self, item: bytes | None, consumer: asyncio.Future[Any]) -> bool:
        """Queue ``item`` (``None``: the end); ``False`` when the consumer has finished."""
        while not consumer.done():
            try:
                self._q.put_nowait(item)
                return True
            except queue.Full:
                self._room.clear()
            if self._q.full():
                waiter = asyncio.ensure_future(self._room.wait())
                await asyncio.wait((waiter, consumer), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        return False

    def abort(self) -> None:
        """Make the extractor stop at its next chunk (the request failed)."""
        self._aborted = True
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(None)

    def __iter__(self) -> Iterator[bytes]:
        while not self._aborted:
            item = self._q.get()
            self._loop.call_soon_threadsafe(self._room.set)
            if item is None:
                return
            yield item


class TarWriter(io.RawIOBase):
    """A file object for the tar writer thread; bounded hand-off to the response."""

    def __init__(self) -> None:
        self.q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
        self.buf = bytearray()
        self.cancelled = False

    def writable(self) -> bool:
        return True

    def put(self, item: bytes | BaseException | None) -> None:
        # Give up when the response is gone, or after a minute without progress
        # (a client that stopped reading): the writer thread never hangs forever.
        for _ in range(120):
            if self.cancelled:
                break
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        raise OSError("client went away")

    def write(self, b: Any) -> int:
        self.buf += b
        if len(self.buf) >= CHUNK:
            self.put(bytes(self.buf))
            self.buf.clear()
        return len(b)

    def finish(self, error: BaseException | None) -> None:
        if self.buf and error is None:
            self.put(bytes(self.buf))
        self.put(error)


def make_tar(top: int, out: TarWriter) -> None:
    """Write a tar of the directory ``top`` (an fd, closed here) into ``out``."""
    error: BaseException | None = None
    try:
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for dirpath, dirnames, filenames, dfd in os.fwalk(
                ".", dir_fd=top, follow_symlinks=False
            ):
                rel = dirpath[2:] if dirpath != "." else ""
                for d in dirnames:
                    info = tarfile.TarInfo(f"{rel}/{d}" if rel else d)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(info)
                for f in filenames:
                    name = f"{rel}/{f}" if rel else f
                    try:
                        st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    info = tarfile.TarInfo(name)
                    info.mtime = int(st.st_mtime)
                    info.mode = stat.S_IMODE(st.st_mode)
                    if stat.S_ISLNK(st.st_mode):
                        info.type = tarfile.SYMTYPE
                        info.linkname = os.readlink(f, dir_fd=dfd)
                        tar.addfile(info)
                    elif stat.S_ISREG(st.st_mode):
                        # FIFOs and devices are skipped; O_NONBLOCK keeps a swapped-in
                        # FIFO from hanging the open, fstat then checks the type.
                        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                        with os.fdopen(fd, "rb") as fh:
                            fst = os.fstat(fh.fileno())
                            if not stat.S_ISREG(fst.st_mode):
                                continue
                            info.size = fst.st_size
                            tar.addfile(info, fh)
    except BaseException as exc:
        error = exc
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        out.finish(error)


def extract_as(
    executor: FsExecutor,
    resolver: PathResolver,
    path: str,
    chunks: Iterable[bytes],
    delete_missing: bool,
    limits: tuple[int, int],
) -> ArchiveResponse:
    """:func:`extract` on the calling thread, as the sandbox user when there is one."""
    if executor.fs_ids is None:
        return extract(resolver, path, chunks, delete_missing, limits)
    return executor.run_blocking(extract, resolver, path, chunks, delete_missing, limits)

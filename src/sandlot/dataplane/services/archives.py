"""Archives in and out of a sandbox (PROTOCOL.md 3.5): a tar extracted member by member
through the confined resolver, a directory written as a tar.

Absolute names, ``..``, names longer than a sandbox path may be and links pointing
out are refused; links are never followed (a member whose name passes through one is
refused); hard links, devices and FIFOs are refused. Both run on threads of the
sandbox's own (as the sandbox user, at most a few at once), fed by or feeding the
event loop through a bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import queue
import secrets
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sandlot.dataplane.services.fsids import become
from sandlot.dataplane.services.fsops import sync_filesystem
from sandlot.dataplane.services.paths import (
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    PathResolver,
    normalize,
)
from sandlot.dataplane.services.tarstream import TarError, TarStream
from sandlot.dataplane.services.treewalk import NOT_A_DIRECTORY, TreeWalk, remove_tree
from sandlot.protocol.dataplane import ArchiveResponse
from sandlot.protocol.errors import InvalidRequest, PayloadTooLarge, RateLimited

T = TypeVar("T")

CHUNK = 256 * 1024

#: A trie of the names an archive holds (its directories implied by the names too).
Names = dict[str, "Names"]


def extract(
    resolver: PathResolver,
    base: str,
    chunks: Iterable[bytes],
    delete_missing: bool,
    limits: tuple[int, int],
) -> ArchiveResponse:
    max_bytes, max_members = limits
    files = dirs = total = 0
    seen: Names = {}
    # The parent directory of the last member and its node: the members of one directory
    # mostly come together, and a deep one is not walked down again for each.
    last: tuple[tuple[str, ...], Names] = ((), seen)
    base = normalize(base)
    with resolver.resolve(base, create_parents=True, for_write=True) as root:
        if root.name is not None:
            with contextlib.suppress(FileExistsError):
                os.mkdir(root.name, 0o755, dir_fd=root.dir_fd)
        # Where the base really is: a link leading to it is followed, once.
        top = root.sandbox_path.rstrip("/")
    umask = _umask()
    # Members land in directories pinned by fd (opened once per directory, not once per
    # file, one component at a time), so no link, made by the archive or there before
    # it, nor one swapped in meanwhile, can lead them anywhere else.
    with _DirCache(resolver, top) as parents:
        try:
            tar = TarStream(chunks)
            count = 0
            for member in tar:
                count += 1
                if count > max_members:
                    raise PayloadTooLarge("too many archive members")
                name = member.name
                parts = _member_parts(name)
                if not parts:
                    continue
                key = tuple(parts[:-1])
                if key != last[0]:
                    node = seen
                    for p in key:
                        node = node.setdefault(p, {})
                    last = (key, node)
                last[1].setdefault(parts[-1], {})
                target = f"{top}/{'/'.join(parts)}"
                if resolver.is_mount_point(target):
                    raise InvalidRequest(f"archive member replaces a mount: {name!r}")
                kind = member.kind
                if kind == "file":
                    total += member.size
                    if total > max_bytes:
                        raise PayloadTooLarge("archive too large")
                    mode = stat.S_IMODE(member.mode) & 0o777 or 0o644
                    dir_fd = parents.get(key, name)
                    _write_member(dir_fd, parts[-1], tar.data(), mode, umask)
                    files += 1
                elif kind == "dir":
                    parents.get(
                        tuple(parts), name
                    )  # made now, and pinned for the files that follow
                    dirs += 1
                elif kind == "symlink":
                    _check_link(name, member.linkname, len(parts) - 1)
                    dir_fd = parents.get(key, name)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(parts[-1], dir_fd=dir_fd)
                    os.symlink(member.linkname, parts[-1], dir_fd=dir_fd)
                    files += 1
                else:
                    # Hard links, devices, FIFOs, sparse files: refused.
                    raise InvalidRequest(f"archive member type not allowed: {name!r}")
        except TarError as exc:
            raise InvalidRequest(
                "body is not a tar archive" if str(exc) in _NOT_TAR else f"corrupt archive: {exc}"
            ) from None
        if delete_missing and not tar.marked_end:
            # Cut at a member boundary, the rest may never have come: what it held would
            # be deleted as missing.
            raise InvalidRequest(
                "the archive ended without its end-of-archive marker: nothing was deleted"
            )
    deleted = _delete_missing(resolver, top or "/", seen) if delete_missing else 0
    with resolver.resolve(base) as root:
        sync_filesystem(root.dir_fd)
    return ArchiveResponse(path=base, files=files, directories=dirs, deleted=deleted, bytes=total)


_NOT_TAR = ("not a tar archive", "empty body")


def _member_parts(name: str) -> list[str]:
    """The components of a member's name, held to the rules of a sandbox path (checked
    before anything is done with them: a name may be as long as a PAX header allows)."""
    if name.startswith("/") or "\x00" in name:
        raise InvalidRequest(f"archive member has an absolute name: {name[:200]!r}")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidRequest(f"archive member name too long: {name[:200]!r}")
    parts = [p for p in name.split("/") if p and p != "."]
    for part in parts:
        if part == "..":
            raise InvalidRequest(f"archive member climbs out: {name[:200]!r}")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidRequest(f"archive member name too long: {name[:200]!r}")
    return parts


def _check_link(name: str, link: str, depth: int) -> None:
    """Links are kept only when they stay inside the extracted tree.

    A link's ``..`` all come first: each climbs one real directory (the link's own is
    reached through none, see :class:`_DirCache`), and no more of them than the link is
    deep. A ``..`` after a name would climb from wherever that name leads, which a link
    there decides (``d/up/..`` with ``d/up -> ..`` is above the tree).
    """
    if not link or link.startswith("/") or "\x00" in link:
        raise InvalidRequest(f"archive link points out: {name!r}")
    if len(link.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidRequest(f"archive link too long: {name!r}")
    climbs = 0
    named = False
    for p in link.split("/"):
        if p == "..":
            if named:
                raise InvalidRequest(f"archive link climbs after a name: {name!r}")
            climbs += 1
            if climbs > depth:
                raise InvalidRequest(f"archive link points out: {name!r}")
        elif p and p != ".":
            named = True


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
    """``O_PATH`` descriptors of the directories an extraction writes into, under ``top``.

    Each is opened from its parent's, ``O_NOFOLLOW``, and made when missing: a member
    whose name passes through a link (one the archive made, or one there before it)
    is refused, never followed. A mount point below the base is entered through the
    resolver, as the sandbox sees it.
    """

    LIMIT = 1024

    def __init__(self, resolver: PathResolver, top: str) -> None:
        self.resolver = resolver
        self.top = top
        self.fds: dict[tuple[str, ...], int] = {}

    def get(self, parts: tuple[str, ...], member: str) -> int:
        """The directory ``top/parts`` (``member`` names it in errors)."""
        fd = self.fds.get(parts)
        if fd is not None:
            return fd
        if len(self.fds) >= self.LIMIT:
            self.close()
        # Down from the nearest directory held (the base at worst).
        held = len(parts)
        while held > 0 and parts[:held] not in self.fds:
            held -= 1
        fd = self.fds.get(parts[:held])
        if fd is None:
            fd = self.fds[()] = self._base()
        for i in range(held, len(parts)):
            fd = self.fds[parts[: i + 1]] = self._enter(fd, parts[: i + 1], member)
        return fd

    def _base(self) -> int:
        with self.resolver.resolve(self.top or "/", for_write=True) as res:
            if res.sandbox_path.rstrip("/") != self.top:
                raise InvalidRequest("the archive's directory was replaced by a link")
            if res.name is None:
                return os.dup(res.dir_fd)
            return os.open(res.name, _O_PIN, dir_fd=res.dir_fd)

    def _enter(self, parent: int, parts: tuple[str, ...], member: str) -> int:
        spath = f"{self.top}/{'/'.join(parts)}"
        if self.resolver.is_mount_point(spath):
            with self.resolver.resolve(spath, for_write=True) as res:
                return os.dup(res.dir_fd)
        name = parts[-1]
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent)
        try:
            return os.open(name, _O_PIN, dir_fd=parent)
        except NotADirectoryError:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise InvalidRequest(
                    f"archive member passes through a symbolic link: {member[:200]!r}"
                ) from None
            raise

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> _DirCache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


_O_PIN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def _delete_missing(resolver: PathResolver, top: str, seen: Names) -> int:
    """Remove what is under ``top`` and not in ``seen``; how many entries went."""
    deleted = 0
    with resolver.resolve(top) as root:
        first = root.open(os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
    walk = TreeWalk(first, seen)
    try:
        for name, is_dir, node in walk:
            kept = node.get(name)
            if kept is None:
                _remove(walk.fd(), name, is_dir)
                deleted += 1
            elif is_dir:
                # Not a directory any more (``enter`` is false): what the archive wrote is kept.
                walk.enter(name, kept)
    finally:
        walk.close()
        os.close(first)
    return deleted


def _remove(dir_fd: int, name: str, is_dir: bool) -> None:
    """Remove an entry, a directory with what it holds; a link is removed, not followed."""
    try:
        if is_dir:
            remove_tree(dir_fd, name)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # What it is changed since it was listed.
        if exc.errno == errno.EISDIR:
            remove_tree(dir_fd, name)
        elif exc.errno in (errno.ENOTDIR, errno.ELOOP):
            os.unlink(name, dir_fd=dir_fd)
        else:
            raise


class ChunkQueue:
    """Request chunks handed from the event loop to the extracting thread.

    A few chunks at most are held (bounded memory); the event loop waits for
    room without polling, woken by the thread as it takes a chunk. The thread's
    wait ends with the request: it looks every :data:`POLL` seconds whether the
    request was given up, and gives up itself after :data:`IDLE` seconds without
    a chunk (the server ends a body that stops coming before that).
    """

    DEPTH = 8
    POLL = 0.5
    IDLE = 120.0

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

    def aborted(self) -> bool:
        return self._aborted

    def __iter__(self) -> Iterator[bytes]:
        waited = 0.0
        while not self._aborted:
            try:
                item = self._q.get(timeout=self.POLL)
            except queue.Empty:
                waited += self.POLL
                if waited >= self.IDLE:
                    raise InvalidRequest("the archive stopped coming") from None
                continue
            waited = 0.0
            self._loop.call_soon_threadsafe(self._room.set)
            if item is None:
                if self.aborted():
                    break  # the request failed: never taken for the archive's end
                return
            yield item
        raise InvalidRequest("the archive's request ended")


class TarWriter(io.RawIOBase):
    """A file object for the tar writer thread; bounded hand-off to the response.

    The response takes chunks on the event loop, woken by the writer (no thread of
    its own waits for them).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
        self.buf = bytearray()
        self.cancelled = False
        self._loop = loop
        self._ready = asyncio.Event()

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
            except queue.Full:
                continue
            self._loop.call_soon_threadsafe(self._ready.set)
            return
        raise OSError("client went away")

    async def get(self) -> bytes | BaseException | None:
        """The next chunk, the writer's error, or ``None`` at the end."""
        while True:
            self._ready.clear()
            try:
                return self.q.get_nowait()
            except queue.Empty:
                await self._ready.wait()

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
    """Write a tar of the directory ``top`` (an fd, closed here) into ``out``.

    Links are stored as links (their target's text), never followed; FIFOs, devices
    and sockets are skipped; so is an entry that is gone by the time it is read.
    """
    error: BaseException | None = None
    walk = TreeWalk(top, "", listed_order=True)
    try:
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for name, is_dir, rel in walk:
                path = f"{rel}/{name}" if rel else name
                if is_dir and walk.enter(name, path):
                    info = tarfile.TarInfo(path)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(info)
                else:
                    # Not a directory (any more: a link, a FIFO…): archived as what it is.
                    _add_entry(tar, walk.fd(), name, path)
    except BaseException as exc:
        error = exc
    finally:
        walk.close()
        os.close(top)
    with contextlib.suppress(OSError):
        out.finish(error)


def _add_entry(tar: tarfile.TarFile, dir_fd: int, name: str, path: str) -> None:
    """Add a link or a regular file (anything else is skipped)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    info = tarfile.TarInfo(path)
    info.mtime = int(st.st_mtime)
    info.mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        try:
            info.linkname = os.readlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        tar.addfile(info)
    elif stat.S_ISREG(st.st_mode):
        # O_NONBLOCK keeps a FIFO swapped in meanwhile from hanging the open; fstat
        # then checks the type.
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in NOT_A_DIRECTORY:  # gone, or a link now
                return
            raise
        with os.fdopen(fd, "rb") as fh:
            fst = os.fstat(fh.fileno())
            if not stat.S_ISREG(fst.st_mode):
                return
            info.size = fst.st_size
            tar.addfile(info, fh)


class TransferPool:
    """The threads of one sandbox's archive transfers, each one's for as long as it runs.

    Their own (not the process's default pool, which every sandbox shares, nor the
    sandbox's other file operations'): transfers that stall hold only these. At most
    ``size`` run at once; one more is refused (429, retryable) rather than queued.
    """

    def __init__(self, fs_ids: tuple[int, int] | None, size: int) -> None:
        self.size = size
        self.running = 0
        initializer = (lambda: become(*fs_ids)) if fs_ids is not None else None
        self._pool = ThreadPoolExecutor(
            max_workers=size, thread_name_prefix="sandlot-archive", initializer=initializer
        )

    def start(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """``fn(*args)`` on a thread of the pool (as the sandbox user when there is one)."""
        if self.running >= self.size:
            raise RateLimited(
                f"{self.size} archive transfers are running in this sandbox: "
                "try again when one is done",
                retry_after=1.0,
            )
        self.running += 1
        job = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        job.add_done_callback(self._done)
        return job

    def _done(self, _: object) -> None:
        self.running -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

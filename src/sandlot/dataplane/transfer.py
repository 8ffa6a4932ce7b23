"""Streamed file transfer (PROTOCOL.md 3.5): upload, download with Range/HEAD, tar in/out.

Uploads stream to a temporary file beside the target (fsync + rename at the
end); downloads stream from an fd opened through the confined resolver.
Archive members go through the same resolver one by one: absolute names,
``..`` and links pointing out are refused, links are never followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import queue
import secrets
import stat
import tarfile
from collections.abc import AsyncIterator, Iterable, Iterator
from email.utils import formatdate
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sandlot.dataplane.fsops import (
    abort_temp,
    commit_temp,
    create_temp,
    etag_of,
    open_regular,
    sync_filesystem,
)
from sandlot.dataplane.paths import PathResolver, normalize, os_error
from sandlot.dataplane.tarstream import TarError, TarStream
from sandlot.dataplane.web import Api, endpoint, json_response, query_bool, query_path
from sandlot.protocol.common import Capability
from sandlot.protocol.errors import InvalidRequest, PayloadTooLarge

CHUNK = 256 * 1024
#: Downloads up to this size go out as one body (fewer loop turns); larger ones stream.
SINGLE_BODY = 256 * 1024
DOWNLOAD_CHUNK = 256 * 1024


async def upload(api: Api, request: Request, *, multipart_only: bool = False) -> Response:
    entry, ctx = await api.auth(request, Capability.FS_WRITE)
    _, resolver, executor, _ = entry.ready()
    path = query_path(request)
    limit = api.host.settings.max_upload_bytes
    ctype = request.headers.get("content-type", "")
    res = await executor.light(lambda: resolver.resolve(path, create_parents=True, for_write=True))
    with res:
        if res.name is None:
            raise InvalidRequest("is a directory")
        mode = await executor.light(_existing_mode, res)
        fd, tmp = await executor.light(create_temp, res)
        size = 0
        try:
            if ctype.startswith("multipart/form-data"):
                form = await request.form(max_files=1, max_fields=16, max_part_size=1 << 20)
                upload_file = form.get("file")
                if upload_file is None or isinstance(upload_file, str):
                    raise InvalidRequest("multipart field 'file' is required")
                while chunk := await upload_file.read(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge("upload too large")
                    await executor.light(_write, fd, chunk)
                await form.close()
            elif multipart_only:
                raise InvalidRequest("expected multipart/form-data with a 'file' field")
            else:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge("upload too large")
                    await executor.light(_write, fd, chunk)
            await executor.heavy(commit_temp, res, fd, tmp, mode)
        except BaseException:
            await executor.light(abort_temp, res, fd, tmp)
            raise
        op = "modified" if mode is not None else "created"
        entry.changed((res.sandbox_path, op, {"size": size}), ctx.actor)
        return json_response({"path": res.sandbox_path, "size": size}, 201)


def _existing_mode(res: Any) -> int | None:
    try:
        st = res.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise InvalidRequest("is a directory")
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` → inclusive ``(a, b)``; ``None`` when unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        raise InvalidRequest("only a single byte range is supported")
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            if n <= 0:
                return None
            return max(0, size - n), size - 1
        a = int(first)
        b = int(last) if last else size - 1
    except ValueError:
        raise InvalidRequest("bad Range header") from None
    if a >= size or b < a:
        return None
    return a, min(b, size - 1)


async def download(api: Api, request: Request) -> Response:
    entry, _ = await api.auth(request, Capability.FS_READ)
    _, resolver, executor, _ = entry.ready()
    path = query_path(request)

    def opener() -> tuple[int, os.stat_result, str]:
        try:
            with resolver.resolve(path) as res:
                fd, st = open_regular(res)
                return fd, st, res.sandbox_path
        except OSError as exc:
            raise os_error(exc) from None

    fd, st, spath = await executor.light(opener)
    size = st.st_size
    etag = f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Last-Modified": formatdate(st.st_mtime, usegmt=True),
        "Content-Disposition": f"attachment; filename*=UTF-8''{_quote(spath)}",
    }
    if_none_match = request.headers.get("if-none-match")
    if if_none_match and etag in [t.strip() for t in if_none_match.split(",")]:
        os.close(fd)
        return Response(status_code=304, headers=headers)
    start, end = 0, size - 1
    status = 200
    rng = request.headers.get("range")
    if_range = request.headers.get("if-range")
    if rng and if_range and if_range.strip() != etag:
        # The file changed since the caller's chunk: send it whole (RFC 9110 If-Range).
        rng = None
    if rng:
        try:
            parsed = _parse_range(rng, size)
        except BaseException:
            os.close(fd)
            raise
        if parsed is None:
            os.close(fd)
            return Response(
                status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"}
            )
        start, end = parsed
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    length = max(0, end - start + 1)
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        os.close(fd)
        return Response(status_code=status, headers=headers, media_type="application/octet-stream")
    if length <= SINGLE_BODY:
        try:
            data = os.pread(fd, length, start)
        finally:
            os.close(fd)
        return Response(data, status, headers=headers, media_type="application/octet-stream")

    async def body() -> AsyncIterator[bytes]:
        try:
            pos, remaining = start, length
            while remaining > 0:
                chunk = await executor.light(os.pread, fd, min(DOWNLOAD_CHUNK, remaining), pos)
                if not chunk:
                    break
                pos += len(chunk)
                remaining -= len(chunk)
                yield chunk
        finally:
            os.close(fd)

    return StreamingResponse(body(), status, headers=headers, media_type="application/octet-stream")


def _quote(path: str) -> str:
    from urllib.parse import quote

    return quote(path.rsplit("/", 1)[-1] or "file")


# --- archives ---------------------------------------------------------------------------


def _extract(
    resolver: PathResolver,
    base: str,
    chunks: Iterable[bytes],
    delete_missing: bool,
    limits: tuple[int, int],
) -> dict[str, Any]:
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
    return {"path": base, "files": files, "directories": dirs, "deleted": deleted, "bytes": total}


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
    import shutil

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


class _ChunkQueue:
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


def build_transfer_routes(api: Api) -> list[Route]:
    settings = api.host.settings

    @endpoint
    async def upload_route(request: Request) -> Response:
        return await upload(api, request)

    @endpoint
    async def download_route(request: Request) -> Response:
        return await download(api, request)

    @endpoint
    async def archive_in(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_WRITE)
        _, resolver, executor, _ = entry.ready()
        path = query_path(request, default="/workspace")
        delete_missing = query_bool(request, "delete_missing", False)
        loop = asyncio.get_running_loop()
        chunks = _ChunkQueue(loop)
        if entry.watcher is not None:
            # One summary event for the archive, not one per member from the watcher.
            entry.watcher.api_tree(normalize(path))
        job = loop.run_in_executor(
            None,
            lambda: _extract_as(executor, resolver, path, chunks, delete_missing),
        )
        received = 0
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > settings.max_archive_bytes:
                    raise PayloadTooLarge("archive too large")
                if not await chunks.put(chunk, job):
                    break  # the extractor stopped (an error): its answer is the request's
        except BaseException:
            chunks.abort()
            with contextlib.suppress(BaseException):
                await job
            raise
        await chunks.put(None, job)
        try:
            result = await job
        finally:
            if entry.watcher is not None:
                entry.watcher.api_tree(normalize(path), done=True)
        entry.changed((result["path"], "modified", {"archive": True, **result}), ctx.actor)
        return json_response(result)

    def _extract_as(
        executor: Any, resolver: PathResolver, path: str, chunks: Iterable[bytes], dm: bool
    ) -> Any:
        limits = (settings.max_archive_bytes, settings.max_archive_members)
        if executor.fs_ids is None:
            return _extract(resolver, path, chunks, dm, limits)
        return executor.run_blocking(_extract, resolver, path, chunks, dm, limits)

    @endpoint
    async def archive_out(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        _, resolver, executor, _ = entry.ready()
        path = query_path(request, default="/workspace")

        def open_dir() -> int:
            with resolver.resolve(path) as root:
                return root.open(os.O_RDONLY | os.O_DIRECTORY)

        top = await executor.light(open_dir)
        out = _QueueWriter()
        task = asyncio.ensure_future(executor.heavy(_make_tar, top, out))
        loop = asyncio.get_running_loop()

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    item = await loop.run_in_executor(None, out.q.get)
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        # Headers are gone already: end the stream early (the tar is
                        # then visibly truncated for the client).
                        break
                    yield item
            finally:
                out.cancelled = True
                # Wake a getter thread still waiting on the queue.
                with contextlib.suppress(Exception):
                    out.q.put_nowait(None)
                with contextlib.suppress(BaseException):
                    await task

        return StreamingResponse(body(), media_type="application/x-tar")

    return [
        Route("/files/upload", upload_route, methods=["POST", "PUT"]),
        Route("/files/download", download_route, methods=["GET", "HEAD"]),
        Route("/files/archive", archive_in, methods=["POST"]),
        Route("/files/archive", archive_out, methods=["GET"]),
    ]


class _QueueWriter(io.RawIOBase):
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


def _make_tar(top: int, out: _QueueWriter) -> None:
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


__all__ = ["build_transfer_routes", "download", "etag_of", "upload"]

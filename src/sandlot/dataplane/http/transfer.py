"""Streamed file transfer (PROTOCOL.md 3.5): upload, download with Range/HEAD, tar in/out.

Uploads stream to a temporary file beside the target (fsync + rename at the
end); downloads stream from an fd opened through the confined resolver.
Archives are extracted and written by :mod:`sandlot.dataplane.services.archives`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from sandlot.dataplane.http.multipart import file_chunks
from sandlot.dataplane.http.web import (
    Param,
    authorize,
    endpoint,
    host_of,
    json_response,
    query_bool,
    query_path,
)
from sandlot.dataplane.services.archives import ChunkQueue, TarWriter, extract, make_tar
from sandlot.dataplane.services.fsops import (
    abort_temp,
    commit_temp,
    create_temp,
    open_regular,
)
from sandlot.dataplane.services.paths import normalize, os_error
from sandlot.protocol.common import Capability
from sandlot.protocol.dataplane import ArchiveResponse, UploadResponse
from sandlot.protocol.errors import InvalidRequest, PayloadTooLarge

log = logging.getLogger("sandlot.dataplane")

#: Downloads up to this size go out as one body (fewer loop turns); larger ones stream.
SINGLE_BODY = 256 * 1024
DOWNLOAD_CHUNK = 256 * 1024


#: Parameters of the transfer endpoints.
PATH = Param("path", {"type": "string", "minLength": 1}, required=True)
DIR = Param("path", {"type": "string", "default": "/workspace"})
BINARY = {"type": "string", "format": "binary"}
UPLOAD_BODY = {
    "required": True,
    "content": {
        "application/octet-stream": {"schema": BINARY},
        "multipart/form-data": {
            "schema": {"type": "object", "required": ["file"], "properties": {"file": BINARY}}
        },
    },
}
DOWNLOAD_PARAMS = (
    PATH,
    Param("Range", {"type": "string"}, where="header"),
    Param("If-Range", {"type": "string"}, where="header"),
    Param("If-None-Match", {"type": "string"}, where="header"),
)
DOWNLOAD_ANSWERS: dict[int, dict[str, Any]] = {
    200: {"description": "The file", "content": {"application/octet-stream": {}}},
    206: {"description": "The range asked for", "content": {"application/octet-stream": {}}},
    304: {"description": "Unchanged since the ETag given in If-None-Match"},
    416: {"description": "The range lies beyond the end of the file"},
}


@endpoint(responses={201: UploadResponse}, params=(PATH,), body=UPLOAD_BODY)
async def upload(request: Request) -> Response:
    """Upload a file (raw body, or the multipart field 'file')."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    resolver, executor = sandbox.resolver, sandbox.executor
    path = query_path(request)
    limit = host_of(request).settings.max_upload_bytes
    ctype = request.headers.get("content-type", "")
    res = await executor.light(lambda: resolver.resolve(path, create_parents=True, for_write=True))
    with res:
        if res.name is None:
            raise InvalidRequest("is a directory")
        mode = await executor.light(_existing_mode, res)
        fd, tmp = await executor.light(create_temp, res)
        size = 0
        try:
            # A multipart body's file is written as it is parsed: nothing of it is kept
            # outside the sandbox, and the limit holds before the body has ended.
            multipart = ctype.startswith("multipart/form-data")
            chunks = file_chunks(request) if multipart else request.stream()
            async for chunk in chunks:
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
        return json_response(UploadResponse(path=res.sandbox_path, size=size), 201)


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
    """``bytes=a-b`` → inclusive ``(a, b)``; ``None`` when unsatisfiable (RFC 9110 14.1.2)."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        raise InvalidRequest("only a single byte range is supported")
    first, dash, last = spec.strip(" \t").partition("-")
    if not dash or not _digits(first or last) or (first and last and not _digits(last)):
        raise InvalidRequest("bad Range header")
    if first == "":
        n = int(last)
        if n <= 0 or size == 0:
            return None  # a suffix of nothing, or of an empty file
        return max(0, size - n), size - 1
    a = int(first)
    b = int(last) if last else size - 1
    if a >= size or b < a:
        return None
    return a, min(b, size - 1)


def _digits(text: str) -> bool:
    """ASCII digits only (``int`` also takes ``1_0``, ``+1``, spaces and other scripts')."""
    return bool(text) and text.isascii() and text.isdigit()


@endpoint(responses=DOWNLOAD_ANSWERS, params=DOWNLOAD_PARAMS, head=True)
async def download(request: Request) -> Response:
    """Download a file (Range supported; HEAD for its headers)."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    resolver, executor = sandbox.resolver, sandbox.executor
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


@endpoint(
    ok=ArchiveResponse,
    params=(DIR, Param("delete_missing", {"type": "boolean", "default": False})),
    body={"required": True, "content": {"application/x-tar": {"schema": BINARY}}},
)
async def archive_in(request: Request) -> Response:
    """Extract a tar (gzip allowed) into a directory."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    resolver = sandbox.resolver
    settings = host_of(request).settings
    limits = (settings.max_archive_bytes, settings.max_archive_members)
    # Checked before the extraction starts: a path refused after it did (a NUL byte)
    # left its job's error unread.
    path = normalize(query_path(request, default="/workspace"))
    delete_missing = query_bool(request, "delete_missing", False)
    loop = asyncio.get_running_loop()
    chunks = ChunkQueue(loop)
    job = sandbox.transfers.start(extract, resolver, path, chunks, delete_missing, limits)
    if entry.watcher is not None:
        # One summary event for the archive, not one per member from the watcher.
        entry.watcher.api_tree(path)
    try:
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
        result = await job
    except ClientDisconnect:
        # The client went away mid-body: nobody to answer, nothing wrong here.
        log.debug("archive upload to %s: the client went away", path)
        raise InvalidRequest("the request body ended early") from None
    finally:
        if entry.watcher is not None:
            entry.watcher.api_tree(path, done=True)
    entry.changed((result.path, "modified", {"archive": True, **result.model_dump()}), ctx.actor)
    return json_response(result)


@endpoint(
    ok={"description": "The tar", "content": {"application/x-tar": {}}},
    params=(DIR,),
)
async def archive_out(request: Request) -> Response:
    """A directory as a tar."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    resolver, executor = sandbox.resolver, sandbox.executor
    path = query_path(request, default="/workspace")

    def open_dir() -> int:
        with resolver.resolve(path) as root:
            return root.open(os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)

    top = await executor.light(open_dir)
    out = TarWriter(asyncio.get_running_loop())
    try:
        task = sandbox.transfers.start(make_tar, top, out)
    except BaseException:
        os.close(top)
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    # The headers are gone already: the body ends without its last chunk,
                    # so the client sees the tar cut short, never a shorter whole one.
                    log.warning("archive of %s ended early: %r", path, item)
                    raise ArchiveCutShort(str(item))
                yield item
        finally:
            out.cancelled = True
            with contextlib.suppress(BaseException):
                await task

    # Started now, the writer ends on its own if the body is never asked for.
    return StreamingResponse(body(), media_type="application/x-tar")


class ArchiveCutShort(Exception):
    """A tar being sent could not be finished (the walk failed)."""

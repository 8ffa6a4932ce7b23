"""Files to and from the browser as bytes: a file's download, a folder as an archive, an
upload, streamed through the gateway (PROTOCOL.md 3.5), never held whole in memory.

- ``GET /api/v1/download?path=`` answers the file's bytes as an attachment;
- ``GET /api/v1/archive?path=`` answers a folder as a gzipped tar (``NAME.tar.gz``),
  compressed here from the dataplane's tar as it arrives;
- ``POST /api/v1/upload?path=`` writes the request's body to the file (parents created),
  answering ``{"path", "size"}``.

A path is checked as every route's is, and the dataplane's own answer to its ``stat`` must
lie inside the workspace and be a regular file (a download) or a directory (an archive),
never a symlink, before a byte is sent. A download or archive that fails once started
ends early: the browser sees a short file, never another one.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from starlette.responses import StreamingResponse

from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable, SandlotError
from sandlot.web import paths
from sandlot.web.calls import DataplaneCalls
from sandlot.web.files import WorkspaceFiles

#: The most bytes of tar a folder's archive holds (it ends there, visibly truncated).
ARCHIVE_BYTES = 4 << 30
#: Speed over size: the archive is compressed as it streams, in the server's loop.
GZIP_LEVEL = 1


def attachment(name: str) -> str:
    """A ``Content-Disposition`` naming the file as the browser should save it."""
    ascii_name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:200] or "file"
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


async def _passed(
    stack: contextlib.AsyncExitStack, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except SandlotError:
        return
    finally:
        await stack.aclose()


async def _gzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    packer = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    async for chunk in chunks:
        out = packer.compress(chunk)
        if out:
            yield out
    yield packer.flush()


class WorkspaceTransfer:
    """Downloads, archives and uploads of one workspace, for one browser request."""

    def __init__(self, calls: DataplaneCalls, files: WorkspaceFiles) -> None:
        self.calls = calls
        self.files = files

    async def _open(
        self, route: str, path: str, max_bytes: int | None = None
    ) -> tuple[contextlib.AsyncExitStack, AsyncIterator[bytes], dict[str, str]]:
        stack = contextlib.AsyncExitStack()
        try:
            answer = await stack.enter_async_context(
                self.calls.stream(
                    route, params={"path": paths.to_sandbox(path)}, max_bytes=max_bytes
                )
            )
        except BaseException:
            await stack.aclose()
            raise
        return stack, answer.aiter_bytes(), dict(answer.headers)

    async def download(self, path: str) -> StreamingResponse:
        kind = (await self.files.stat(path)).get("type")
        if kind == "directory":
            raise InvalidRequest("a folder is downloaded as an archive (/api/v1/archive)")
        if kind != "file":
            raise InvalidRequest("only a regular file is downloaded")
        stack, chunks, headers = await self._open("/files/download", path)
        sent = {"Content-Disposition": attachment(paths.name_of(path) or "file")}
        length = headers.get("content-length") or headers.get("Content-Length")
        if length and length.isdigit():
            sent["Content-Length"] = length
        return StreamingResponse(
            _passed(stack, chunks), media_type="application/octet-stream", headers=sent
        )

    async def archive(self, path: str) -> StreamingResponse:
        if (await self.files.stat(path)).get("type") != "directory":
            raise InvalidRequest("only a folder is archived (download a file as it is)")
        stack, chunks, _ = await self._open("/files/archive", path, ARCHIVE_BYTES)
        name = paths.name_of(path) if paths.parts_of(path) else "workspace"
        return StreamingResponse(
            _gzipped(_passed(stack, chunks)),
            media_type="application/gzip",
            headers={"Content-Disposition": attachment(f"{name}.tar.gz")},
        )

    async def upload(self, path: str, body: AsyncIterator[bytes]) -> dict[str, Any]:
        if not paths.parts_of(path):
            raise InvalidRequest("the workspace root is a directory")
        dataplane = await self.calls.workspace.dataplane()
        # A streamed body is sent once: the token is renewed before, never retried after.
        answer = await self.calls.gateway.request(
            "POST",
            self.calls.url(dataplane, "/files/upload", {"path": paths.to_sandbox(path)}),
            token=dataplane.token,
            headers={
                "X-Request-Id": self.calls.request_id,
                "Content-Type": "application/octet-stream",
            },
            content=body,
        )
        try:
            written = answer.json()
        except ValueError:
            raise ProviderUnavailable(
                "the workspace answered something unreadable", metadata={"reason": "bad_answer"}
            ) from None
        return {"path": path, "size": written.get("size") if isinstance(written, dict) else None}

"""The broker's relay for hosted boxes: the normalized dataplane, served at ``/dp``.

A hosted sandbox service cannot verify sandlot's tokens, so its boxes are never
handed to clients: a sandbox of the ``langsmith`` provider has its dataplane at
``{public_url}/dp/{sandbox_id}/v1`` like any other, served by :class:`HostedRelay`
in the broker's process. The relay verifies each call's sandbox token itself (the
broker's keys, the sandbox id and generation, revocation, the operation's capability:
the dataplane's own :class:`~sandlot.dataplane.services.auth.TokenVerifier`), then
calls the box with the provider's key, which never leaves the broker.

What does not map one to one is done with what the box has (PROTOCOL.md 3.9):

- ``POST /exec`` → ``POST /execute`` (a list command joined with shell quoting; with
  ``stdin``, through ``/execute/ws``); ``WS /exec/ws`` → ``/execute/ws``, ``attach``
  → ``reconnect`` with the offsets (:mod:`sandlot.providers.hostedstreams`).
- ``/files/upload`` and ``/files/download`` → ``/upload`` and ``/download`` (Range and
  HEAD passed on); ``/fs/read``, ``/fs/write`` and ``/fs/edit`` read and write whole
  files that way (etags are computed by the relay, as the dataplane does).
- ``/fs/list``, ``/fs/stat``, ``DELETE /fs``, ``/fs/mkdir``, ``/fs/move`` → commands
  over ``/execute`` (``find``, ``stat``, ``rm``, ``mkdir``, ``mv``), every path
  absolute and quoted as one shell word; ``/fs/glob`` and ``/fs/grep`` → the box's
  ``/glob`` and ``/grep``.
- ``WS /shell/ws`` → a PTY command of the template's shell profile on ``/execute/ws``,
  shared by every client of the same name.
- The event log (``/events``) is the relay's: it records what passes through it
  (execs, shells, API file changes); changes made by processes inside the box are
  not seen.
- ``/files/archive`` and ``WS /events/ws`` answer 501 ``NOT_SUPPORTED``.

Nothing a client sends or asks for is held whole in the broker: uploads are passed on
as they arrive, files read whole are read only up to :data:`MAX_FILE_BYTES`, a
command's output is kept up to :data:`~sandlot.providers.hostedstreams.MAX_OUTPUT_BYTES`
per stream (``truncated``), and a sandbox holds at most
:data:`~sandlot.providers.hostedstate.MAX_TRANSFERS` streamed transfers at once.
"""

from __future__ import annotations

import base64
import errno
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute

from sandlot.dataplane.http.multipart import file_chunks
from sandlot.dataplane.http.web import (
    endpoint,
    error_response,
    json_response,
    parse_json,
    query_int,
    query_path,
    request_id_of,
)
from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.dataplane.services.fsops import etag_of
from sandlot.dataplane.services.paths import os_error
from sandlot.protocol.common import PROTOCOL_VERSION, Capability, rfc3339
from sandlot.protocol.dataplane import (
    EditRequest,
    ExecRequest,
    GlobRequest,
    GrepRequest,
    MkdirRequest,
    MoveRequest,
    ReadResponse,
    SignalRequest,
    WriteRequest,
)
from sandlot.protocol.errors import (
    FileNotFound,
    InvalidRequest,
    NotSupported,
    PayloadTooLarge,
    PreconditionFailed,
    ResourceNotFound,
)
from sandlot.providers import hostedstreams
from sandlot.providers.hostedbox import Box, q
from sandlot.providers.hostedstate import (
    HostedLookup,
    RelayCore,
    authorize,
    command_text,
)

#: Files the relay reads or edits whole (``/fs/read``, ``/fs/edit``, conditional writes).
MAX_FILE_BYTES = 10 << 20
SIGNALS = {"SIGINT", "SIGTERM", "SIGKILL", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGSTOP"}


class HostedRelay(RelayCore):
    """The ASGI app a hosted provider serves at ``/dp``."""

    def __init__(self, lookup: HostedLookup, verifier: TokenVerifier) -> None:
        super().__init__(lookup, verifier)
        routes = [
            Route("/healthz", version, methods=["GET"]),
            Route("/__meta/version", version, methods=["GET"]),
            Route("/exec", exec_once, methods=["POST"]),
            Route("/execs", execs, methods=["GET"]),
            Route("/execs/{exec_id}", exec_get, methods=["GET"]),
            Route("/execs/{exec_id}/signal", exec_signal, methods=["POST"]),
            WebSocketRoute("/exec/ws", hostedstreams.exec_ws),
            Route("/shells", hostedstreams.shells, methods=["GET"]),
            Route("/shells/{name}", hostedstreams.shell_delete, methods=["DELETE"]),
            WebSocketRoute("/shell/ws", hostedstreams.shell_ws),
            Route("/files/upload", upload, methods=["POST", "PUT"]),
            Route("/files/download", download, methods=["GET", "HEAD"]),
            Route("/files/archive", unsupported, methods=["GET", "POST"]),
            Route("/fs/list", fs_list, methods=["GET"]),
            Route("/fs/read", fs_read, methods=["GET"]),
            Route("/fs/write", fs_write, methods=["PUT", "POST"]),
            Route("/fs/edit", fs_edit, methods=["POST"]),
            Route("/fs/glob", fs_glob, methods=["POST"]),
            Route("/fs/grep", fs_grep, methods=["POST"]),
            Route("/fs/stat", fs_stat, methods=["GET"]),
            Route("/fs", fs_delete, methods=["DELETE"]),
            Route("/fs/mkdir", fs_mkdir, methods=["POST"]),
            Route("/fs/move", fs_move, methods=["POST"]),
            Route("/events", hostedstreams.events_sse, methods=["GET"]),
            WebSocketRoute("/events/ws", hostedstreams.events_ws),
        ]
        self.app = Starlette(
            routes=[Mount("/{sandbox_id}/v1", routes=routes)],
            exception_handlers={404: _not_found, 405: _method_not_allowed},
        )
        self.app.state.relay = self
        #: HTTP routes without parameters, by path: one dict look-up instead of trying each
        #: route's pattern in turn (the others, WebSockets, 404 and 405 go through ``app``).
        self.fast: dict[str, tuple[frozenset[str], Any]] = {
            r.path: (frozenset(r.methods or ()), r.endpoint)
            for r in routes
            if isinstance(r, Route) and "{" not in r.path
        }

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            root = scope.get("root_path", "")
            path: str = scope["path"]
            route = path[len(root) :] if root and path.startswith(root) else path
            sandbox_id, sep, rest = route[1:].partition("/v1/")
            well_formed = sep and sandbox_id and "/" not in sandbox_id
            hit = self.fast.get("/" + rest) if well_formed else None
            if hit is not None and scope["method"] in hit[0]:
                child = dict(scope)
                child["app"] = self.app
                child["path_params"] = {"sandbox_id": sandbox_id}
                response = await hit[1](Request(child, receive, send))
                await response(child, receive, send)
                return
        await self.app(scope, receive, send)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ResourceNotFound("no such route"), request_id_of(request.headers))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    resp = error_response(InvalidRequest("method not allowed"), request_id_of(request.headers))
    resp.status_code = 405
    return resp


#: The messages of the box's tools (coreutils, findutils) → errno, for :func:`os_error`.
_STRERRORS = {
    os.strerror(code): code
    for code in (
        errno.ENOENT,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTEMPTY,
        errno.EEXIST,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENOSPC,
        errno.ELOOP,
        errno.ENAMETOOLONG,
    )
}


def _check(result: dict[str, Any], what: str) -> str:
    """The stdout of a helper command that must succeed; its failure as the dataplane's
    error for the same errno (read from the tool's message)."""
    if result.get("exit_code") == 0:
        return str(result.get("stdout", ""))
    err = str(result.get("stderr", "")).strip()
    for text, code in _STRERRORS.items():
        if text in err:
            raise os_error(OSError(code, text), what)
    raise InvalidRequest(f"{what} failed: {err.splitlines()[-1][:200] if err else 'error'}")


# --- endpoints ----------------------------------------------------------------------------


@endpoint(public=True)
async def version(request: Request) -> Response:
    from sandlot import __version__

    return json_response({"api_version": PROTOCOL_VERSION, "server": f"sandlot/{__version__}"})


@endpoint()
async def unsupported(request: Request) -> Response:
    await authorize(request, Capability.FS_READ)
    raise NotSupported("this operation is not available for sandboxes on a hosted service")


@endpoint()
async def exec_once(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.EXEC)
    body = await parse_json(request, ExecRequest, limit=16 << 20)
    if body.command_id is not None and body.command_id in hosted.by_command:
        ex = hosted.execs[hosted.by_command[body.command_id]]
        if ex.result is not None:
            return json_response(ex.result)
    ex = hosted.new_exec(body.command, body.command_id, ctx.actor, False)
    started = time.perf_counter()
    # Whatever fails on the way (a refused cwd, the box gone), the command is over for
    # the relay: left running, it would count as work forever and the box never reaped.
    try:
        if body.stdin is not None:
            result = await hostedstreams.run_with_stdin(box, body, ex)
        else:
            result = await box.execute(
                command_text(body.command),
                timeout=body.timeout_seconds,
                env=body.env,
                cwd=box.resolve(body.cwd) if body.cwd else None,
                shell=body.shell,
                # The client's own id only: the box may record ids durably (a cost).
                command_id=body.command_id,
            )
    except BaseException:
        hosted.ended(ex, None, state="failed")
        raise
    exit_code = result.get("exit_code")
    stdout, cut_out = hostedstreams.kept_output(str(result.get("stdout", "")))
    stderr, cut_err = hostedstreams.kept_output(str(result.get("stderr", "")))
    ex.stdout_offset, ex.stderr_offset = len(stdout.encode()), len(stderr.encode())
    ex.result = {
        "exec_id": ex.exec_id,
        "command_id": ex.command_id,
        "stdout": stdout,
        "stderr": stderr,
        "exit_code": exit_code,
        "timed_out": bool(result.get("timed_out", False)),
        "oom_killed": False,
        "truncated": bool(result.get("truncated")) or cut_out or cut_err,
        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
    }
    hosted.ended(ex, exit_code if isinstance(exit_code, int) else None)
    return json_response(ex.result)


@endpoint()
async def execs(request: Request) -> Response:
    hosted, _, _ = await authorize(request, Capability.EXEC)
    seq = hosted.events.last_sequence
    return json_response({"execs": [e.snapshot(seq) for e in hosted.execs.values()]})


@endpoint()
async def exec_get(request: Request) -> Response:
    hosted, _, _ = await authorize(request, Capability.EXEC)
    ex = hosted.find_exec(request.path_params["exec_id"])
    return json_response(ex.snapshot(hosted.events.last_sequence))


@endpoint()
async def exec_signal(request: Request) -> Response:
    hosted, _, box = await authorize(request, Capability.EXEC)
    ex = hosted.find_exec(request.path_params["exec_id"])
    raw = (await parse_json(request, SignalRequest, limit=4096)).signal
    name = raw.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name not in SIGNALS:
        raise InvalidRequest(f"unknown signal {raw!r}")
    if ex.state == "running" and ex.pid is not None:
        # The command's process group first (a shell's children), then the process.
        sig = name[3:]
        await box.run(f"kill -s {sig} -- -{ex.pid} 2>/dev/null || kill -s {sig} {ex.pid}")
    return json_response(ex.snapshot(hosted.events.last_sequence))


#: The largest upload (the dataplane's own default ``max_upload_bytes``).
MAX_UPLOAD_BYTES = 16 << 30


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge(
        f"upload over {MAX_UPLOAD_BYTES} bytes", metadata={"limit": MAX_UPLOAD_BYTES}
    )


@endpoint()
async def upload(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.FS_WRITE)
    path = box.resolve(query_path(request))
    ctype = request.headers.get("content-type", "")
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise InvalidRequest("bad Content-Length")
    if length is not None and int(length) > MAX_UPLOAD_BYTES:
        raise _too_large()
    hosted.take_transfer()
    try:
        if ctype.startswith("multipart/form-data"):
            # The file's bytes go on to the box as they are parsed: nothing of the
            # upload is kept on the broker's disk or in its memory.
            sent = await _pass_on(box, path, file_chunks(request), None)
        else:
            size = int(length) if length is not None else None
            sent = await _pass_on(box, path, request.stream(), size)
    finally:
        hosted.give_transfer()
    hosted.changed(path, "created" if sent.created else "modified", ctx.actor)
    return json_response({"path": path, "size": sent.size}, 201)


class _Sent:
    """What :func:`_pass_on` passed on: its size, whether it made a new file."""

    def __init__(self, created: bool) -> None:
        self.created = created
        self.size = 0


async def _pass_on(box: Box, path: str, chunks: AsyncIterator[bytes], size: int | None) -> _Sent:
    """The upload streamed to the box as it arrives (never held whole here)."""
    sent = _Sent(not await box.exists(path))

    async def counted() -> AsyncIterator[bytes]:
        async for chunk in chunks:
            sent.size += len(chunk)
            if sent.size > MAX_UPLOAD_BYTES:
                raise _too_large()
            yield chunk

    await box.upload(path, counted(), size)
    return sent


class _Passthrough(StreamingResponse):
    """A box's streamed answer passed on. ``done`` (closing the box's answer, giving the
    transfer slot back) runs however the client's exchange ends, even when the client
    leaves before the body starts (the body's own ``finally`` would then never run)."""

    def __init__(self, body: Any, done: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(body, **kw)
        self._done = done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._done()


@endpoint()
async def download(request: Request) -> Response:
    hosted, _, box = await authorize(request, Capability.FS_READ)
    path = box.resolve(query_path(request))
    headers = {k: v for k, v in request.headers.items() if k in ("range", "if-range")}
    hosted.take_transfer()
    try:
        upstream = await box.stream(
            request.method, "/download", params={"path": path}, headers=headers
        )
    except BaseException:
        hosted.give_transfer()
        raise
    released = False

    async def done() -> None:
        nonlocal released
        if not released:
            released = True
            hosted.give_transfer()
            await upstream.aclose()

    keep = ("content-type", "content-length", "content-range", "accept-ranges", "etag")
    out = {k: v for k, v in upstream.headers.items() if k.lower() in keep}
    if request.method == "HEAD":
        await done()
        return Response(status_code=upstream.status_code, headers=out)

    async def body() -> Any:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await done()

    return _Passthrough(body(), done, status_code=upstream.status_code, headers=out)


async def _read_whole(box: Box, path: str) -> bytes | None:
    try:
        return await box.download(path, MAX_FILE_BYTES)
    except FileNotFound:
        return None


@endpoint()
async def fs_read(request: Request) -> Response:
    _, _, box = await authorize(request, Capability.FS_READ)
    path = box.resolve(query_path(request))
    offset = query_int(request, "offset", 0)
    limit = query_int(request, "limit", 2000, 1, 1 << 30)
    data = await _read_whole(box, path)
    if data is None:
        raise FileNotFound(f"no such file: {path}")
    etag = etag_of(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        encoded = base64.b64encode(data).decode("ascii")
        return json_response(
            ReadResponse(
                path=path,
                content=encoded,
                encoding="base64",
                total_lines=0,
                start_line=0,
                end_line=0,
                next_offset=None,
                etag=etag,
                size=len(data),
            )
        )
    total = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    lines = text.splitlines(keepends=True)
    start = min(offset, total)
    end = min(total, start + limit)
    return json_response(
        ReadResponse(
            path=path,
            content="".join(lines[start:end]),
            encoding="utf-8",
            total_lines=total,
            start_line=start,
            end_line=end,
            next_offset=end if end < total else None,
            etag=etag,
            size=len(data),
        )
    )


@endpoint()
async def fs_write(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.FS_WRITE)
    body = await parse_json(request, WriteRequest, limit=2 * MAX_FILE_BYTES)
    path = box.resolve(body.path)
    try:
        data = (
            base64.b64decode(body.content, validate=True)
            if body.encoding == "base64"
            else body.content.encode()
        )
    except ValueError:
        raise InvalidRequest("content is not valid base64") from None
    created = False
    if body.if_match is None and body.if_none_match is None:
        created = not await box.exists(path)
    else:
        # Checked, then written: another writer in between is not seen (documented).
        current = await _read_whole(box, path)
        if body.if_none_match == "*" and current is not None:
            raise PreconditionFailed("file exists", metadata={"etag": etag_of(current)})
        if body.if_match is not None and (
            current is None or etag_of(current) != body.if_match.strip('"')
        ):
            raise PreconditionFailed("file changed since it was read")
        created = current is None
    await box.upload(path, data)
    hosted.changed(path, "created" if created else "modified", ctx.actor)
    answer = {"path": path, "etag": etag_of(data), "created": created}
    return json_response(answer, 201 if created else 200)


@endpoint()
async def fs_edit(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.FS_WRITE)
    body = await parse_json(request, EditRequest, limit=2 * MAX_FILE_BYTES)
    path = box.resolve(body.path)
    data = await _read_whole(box, path)
    if data is None:
        raise FileNotFound(f"no such file: {path}")
    if body.if_match is not None and etag_of(data) != body.if_match.strip('"'):
        raise PreconditionFailed("file changed since it was read", metadata={"etag": etag_of(data)})
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("file is not UTF-8 text") from None
    count = text.count(body.old_string)
    if count == 0:
        raise InvalidRequest("old_string not found", metadata={"occurrences": 0})
    if count > 1 and not body.replace_all:
        raise InvalidRequest(
            f"old_string occurs {count} times; pass replace_all or more context",
            metadata={"occurrences": count},
        )
    out = (
        text.replace(body.old_string, body.new_string)
        if body.replace_all
        else text.replace(body.old_string, body.new_string, 1)
    ).encode()
    await box.upload(path, out)
    hosted.changed(path, "modified", ctx.actor)
    return json_response(
        {"path": path, "occurrences": count if body.replace_all else 1, "etag": etag_of(out)}
    )


#: ``find -printf`` of one entry: type, size, mtime, symlink flag, path (NUL-terminated).
_FIND_FORMAT = "%y\\t%s\\t%T@\\t%p\\0"


def _entries(out: str, limit: int | None = None) -> list[dict[str, Any]]:
    entries = []
    for record in out.split("\0"):
        if not record:
            continue
        kind, size, mtime, path = record.split("\t", 3)
        entries.append(
            {
                "path": path,
                "is_dir": kind == "d",
                "size": int(size) if kind != "d" else 0,
                "modified_at": rfc3339(float(mtime)),
                "is_symlink": kind == "l",
            }
        )
    entries.sort(key=lambda e: str(e["path"]))
    return entries[:limit] if limit else entries


@endpoint()
async def fs_list(request: Request) -> Response:
    _, _, box = await authorize(request, Capability.FS_READ)
    path = box.resolve(query_path(request, default="/workspace"))
    depth = query_int(request, "depth", 1, 1, 64)
    out = _check(
        await box.run(
            f"test -d {q(path)} || ls -d -- {q(path)} >/dev/null || exit 2; "
            f"test -d {q(path)} || {{ echo {q(os.strerror(errno.ENOTDIR))} >&2; exit 20; }}; "
            f"find {q(path)} -mindepth 1 -maxdepth {depth} -printf '{_FIND_FORMAT}'"
        ),
        path,
    )
    return json_response({"entries": _entries(out), "truncated": False})


@endpoint()
async def fs_stat(request: Request) -> Response:
    _, _, box = await authorize(request, Capability.FS_READ)
    path = box.resolve(query_path(request))
    out = _check(await box.run(f"stat -c '%F\t%s\t%a\t%Y' -- {q(path)}"), path)
    kind, size, mode, mtime = out.strip().split("\t")
    types = {"directory": "directory", "symbolic link": "symlink"}
    type_ = "file" if kind.startswith("regular") else types.get(kind, "other")
    return json_response(
        {
            "path": path,
            "type": type_,
            "size": int(size),
            "mode": int(mode, 8),
            "modified_at": rfc3339(float(mtime)),
            "etag": None,
        }
    )


@endpoint()
async def fs_delete(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.FS_WRITE)
    path = box.resolve(query_path(request))
    if path == "/" or path == box.workspace:
        raise InvalidRequest("refusing to delete the sandbox's root or workspace")
    recursive = request.query_params.get("recursive", "true").lower() not in ("false", "0")
    cmd = f"rm -r -- {q(path)}" if recursive else f"rm -d -- {q(path)}"
    _check(await box.run(f"ls -d -- {q(path)} >/dev/null && {cmd}"), path)
    hosted.changed(path, "deleted", ctx.actor)
    return json_response({"path": path})


@endpoint()
async def fs_mkdir(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.FS_WRITE)
    body = await parse_json(request, MkdirRequest)
    path = box.resolve(body.path)
    flags = "-p" if body.parents else ""
    script = f"if test -d {q(path)}; then echo exists; else mkdir {flags} -- {q(path)}; fi"
    if not body.exist_ok:
        exists = q(os.strerror(errno.EEXIST))
        script = f"test -e {q(path)} && {{ echo {exists} >&2; exit 17; }}; {script}"
    out = await box.run(script)
    existed = _check(out, path).strip() == "exists"
    if not existed:
        hosted.changed(path, "created", ctx.actor)
    return json_response({"path": path}, 200 if existed else 201)


@endpoint()
async def fs_move(request: Request) -> Response:
    hosted, ctx, box = await authorize(request, Capability.FS_WRITE)
    body = await parse_json(request, MoveRequest)
    src, dst = box.resolve(body.src), box.resolve(body.dst)
    flag = "-f" if body.overwrite else "-n"
    _check(
        await box.run(f"ls -d -- {q(src)} >/dev/null && mv -T {flag} -- {q(src)} {q(dst)}"),
        src,
    )
    hosted.changed(dst, "moved", ctx.actor)
    return json_response({"path": dst})


@endpoint()
async def fs_glob(request: Request) -> Response:
    _, _, box = await authorize(request, Capability.FS_READ)
    body = await parse_json(request, GlobRequest)
    base = box.resolve(body.path)
    resp = await box.request(
        "POST", "/glob", json_body={"pattern": body.pattern, "path": base, "limit": body.limit}
    )
    doc = resp.json()
    matches = []
    for m in doc.get("matches", []):
        if m.get("is_dir"):
            continue
        path = m["path"] if m["path"].startswith("/") else f"{base.rstrip('/')}/{m['path']}"
        matches.append({**m, "path": path, "is_dir": False})
    return json_response({"matches": matches, "truncated": bool(doc.get("truncated"))})


@endpoint()
async def fs_grep(request: Request) -> Response:
    _, _, box = await authorize(request, Capability.FS_READ)
    body = await parse_json(request, GrepRequest)
    doc = body.model_dump(mode="json", exclude_none=True)
    doc["path"] = box.resolve(body.path)
    resp = await box.request("POST", "/grep", json_body=doc, timeout=300.0)
    return Response(resp.content, media_type="application/json")


__all__ = ["HostedRelay"]

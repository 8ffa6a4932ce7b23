"""HTTP endpoints of the dataplane (PROTOCOL.md 3.1, 3.3, 3.4 listing, 3.6, 3.7, 3.8).

Each endpoint authorises, parses, calls the sandbox's services and answers; what
it takes and answers is declared with :func:`~sandlot.dataplane.http.web.endpoint`
for the OpenAPI document. The route table is :data:`sandlot.dataplane.http.app.ROUTES`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from sandlot import __version__ as _version
from sandlot.dataplane.http.web import (
    Param,
    authorize,
    endpoint,
    host_of,
    json_response,
    parse_json,
    query_bool,
    query_int,
    query_path,
)
from sandlot.dataplane.services import grep as grep_service
from sandlot.dataplane.services.events import expired_event
from sandlot.dataplane.services.execs import Exec, parse_signal
from sandlot.dataplane.services.fsops import Change, decode_content
from sandlot.protocol.common import API_VERSION, Capability
from sandlot.protocol.dataplane import (
    EditRequest,
    EditResponse,
    ExecList,
    ExecRequest,
    ExecResult,
    ExecSnapshot,
    GlobRequest,
    GlobResponse,
    GrepRequest,
    GrepResponse,
    ListResponse,
    MkdirRequest,
    MoveRequest,
    PathResponse,
    ReadResponse,
    ShellList,
    SignalRequest,
    StatResponse,
    VersionResponse,
    WriteRequest,
    WriteResponse,
)
from sandlot.protocol.errors import InvalidRequest, SequenceExpired
from sandlot.protocol.openapi import event_stream

#: ``/fs/read`` of a file up to this size runs inline on the event loop (a thread hop
#: would cost more); a larger one on a thread.
INLINE_READ_BYTES = 256 * 1024

#: Parameters several endpoints read.
PATH = Param("path", {"type": "string", "minLength": 1}, required=True)
DIR = Param("path", {"type": "string", "default": "/workspace"})


@endpoint(ok=VersionResponse, public=True)
async def version(request: Request) -> Response:
    """Server version."""
    # Made here, not at import: an instance builds its model's validator, and none is
    # built before the dataplane serves (see ``build_wire_models`` in ``standalone``).
    return json_response(VersionResponse(api_version=API_VERSION, server=f"sandlot/{_version}"))


# --- commands -----------------------------------------------------------------------------


async def run_exec(request: Request) -> ExecResult:
    """``POST /exec`` (and the LangSmith ``POST /execute``): run, wait, collect."""
    entry, ctx = await authorize(request, Capability.EXEC)
    body = await parse_json(request, ExecRequest, limit=host_of(request).settings.max_write_bytes)
    runtime = entry.ready().runtime
    if body.command_id is not None:
        existing = await entry.execs.by_command_id(body.command_id)
        if existing is not None:
            await existing.done.wait()
            return exec_result(existing, 0.0)
    t0 = time.perf_counter()
    ex = await entry.execs.start(
        runtime,
        command=body.command,
        shell=body.shell,
        env=body.env,
        cwd=body.cwd,
        pty=None,
        timeout=body.timeout_seconds,
        command_id=body.command_id,
        actor=ctx.actor,
        collect=True,
        stdin=body.stdin.encode() if body.stdin is not None else b"",
    )
    await ex.done.wait()
    result = exec_result(ex, (time.perf_counter() - t0) * 1000)
    if body.command_id is None:
        # Nobody can ask for this result again: keep only the replay buffers.
        ex.release_collected()
    return result


def exec_result(ex: Exec, duration_ms: float) -> ExecResult:
    out = ex.stdout.collected or b""
    err = ex.stderr.collected or b""
    # From the exec's own clock, so a replayed command_id answers identically.
    if ex.ended_at:
        duration_ms = (ex.ended_at - ex.started_at) * 1000
    return ExecResult(
        exec_id=ex.exec_id,
        command_id=ex.command_id,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        exit_code=ex.exit_code,
        timed_out=ex.timed_out,
        oom_killed=ex.oom_killed,
        truncated=ex.stdout.truncated or ex.stderr.truncated,
        duration_ms=round(duration_ms, 3),
    )


@endpoint(ok=ExecResult, body=ExecRequest)
async def exec_once(request: Request) -> Response:
    """Run a command to completion."""
    return json_response(await run_exec(request))


@endpoint(ok=ExecList)
async def execs(request: Request) -> Response:
    """Commands of the sandbox."""
    entry, _ = await authorize(request, Capability.FS_READ)
    seq = entry.events.last_sequence
    return json_response(ExecList(execs=[e.snapshot(seq) for e in entry.execs.all()]))


@endpoint(ok=ExecSnapshot)
async def exec_get(request: Request) -> Response:
    """A command's snapshot."""
    entry, _ = await authorize(request, Capability.FS_READ)
    ex = entry.execs.get(request.path_params["exec_id"])
    return json_response(ex.snapshot(entry.events.last_sequence))


@endpoint(ok=ExecSnapshot, body=SignalRequest)
async def exec_signal(request: Request) -> Response:
    """Signal a running command."""
    entry, _ = await authorize(request, Capability.EXEC)
    ex = entry.execs.get(request.path_params["exec_id"])
    body = await parse_json(request, SignalRequest)
    ex.signal(parse_signal(body.signal))
    return json_response(ex.snapshot(entry.events.last_sequence))


# --- shells -------------------------------------------------------------------------------


@endpoint(ok=ShellList)
async def shells(request: Request) -> Response:
    """Shared shells of the sandbox."""
    entry, _ = await authorize(request, Capability.SHELL_OBSERVE)
    return json_response(ShellList(shells=[s.snapshot() for s in entry.shells.all()]))


@endpoint(responses={204: {"description": "Ended"}})
async def shell_delete(request: Request) -> Response:
    """End a shared shell."""
    entry, _ = await authorize(request, Capability.SHELL)
    await entry.shells.delete(request.path_params["name"])
    return Response(status_code=204)


# --- filesystem operations ----------------------------------------------------------------


@endpoint(
    ok=ListResponse,
    params=(DIR, Param("depth", {"type": "integer", "minimum": 1, "maximum": 64})),
)
async def fs_list(request: Request) -> Response:
    """Entries of a directory."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    path = query_path(request, default="/workspace")
    depth = query_int(request, "depth", 1, 1, 64)
    run = sandbox.executor.light if depth == 1 else sandbox.executor.heavy
    body = await run(sandbox.files.list_json, path, depth)
    return Response(body, media_type="application/json")


@endpoint(
    ok=ReadResponse,
    params=(
        PATH,
        Param("offset", {"type": "integer", "minimum": 0}),
        Param("limit", {"type": "integer", "minimum": 1, "maximum": 1 << 30}),
    ),
)
async def fs_read(request: Request) -> Response:
    """Lines of a text file (base64 for binary content)."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    path = query_path(request)
    offset = query_int(request, "offset", 0)
    limit = query_int(request, "limit", 2000, 1, 1 << 30)
    files, executor = sandbox.files, sandbox.executor
    if await executor.light(files.size_hint, path) <= INLINE_READ_BYTES:
        return json_response(await executor.light(files.read, path, offset, limit))

    def read() -> Response:
        # Reading, hashing, encoding and serialising a large file would hold the event
        # loop (tenths of a second for 16 MiB): all of it runs on a thread.
        return json_response(files.read(path, offset, limit))

    return await executor.heavy(read)


@endpoint(
    responses={200: WriteResponse, 201: WriteResponse},
    body=WriteRequest,
)
async def fs_write(request: Request) -> Response:
    """Write a file (conditionally with if_match / if_none_match)."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    settings = host_of(request).settings
    body = await parse_json(request, WriteRequest, limit=settings.max_write_bytes * 2)
    data = decode_content(body.content, body.encoding)

    def write() -> tuple[WriteResponse, Change]:
        return sandbox.files.write(
            body.path, data, if_match=body.if_match, if_none_match=body.if_none_match
        )

    result, change = await sandbox.executor.heavy(write)
    entry.changed(change, ctx.actor)
    return json_response(result, 201 if result.created else 200)


@endpoint(ok=EditResponse, body=EditRequest)
async def fs_edit(request: Request) -> Response:
    """Replace a string in a file."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    settings = host_of(request).settings
    body = await parse_json(request, EditRequest, limit=settings.max_write_bytes * 2)

    def edit() -> tuple[EditResponse, Change]:
        return sandbox.files.edit(
            body.path,
            body.old_string,
            body.new_string,
            replace_all=body.replace_all,
            if_match=body.if_match,
        )

    result, change = await sandbox.executor.heavy(edit)
    entry.changed(change, ctx.actor)
    return json_response(result)


@endpoint(ok=GlobResponse, body=GlobRequest)
async def fs_glob(request: Request) -> Response:
    """Files matching a glob pattern."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    body = await parse_json(request, GlobRequest)

    def glob() -> bytes:
        return sandbox.files.glob_json(body.pattern, body.path, limit=body.limit)

    return Response(await sandbox.executor.heavy(glob), media_type="application/json")


@endpoint(ok=GrepResponse, body=GrepRequest)
async def fs_grep(request: Request) -> Response:
    """Lines matching a pattern."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    settings = host_of(request).settings
    body = await parse_json(request, GrepRequest)
    body_json = await grep_service.grep(
        sandbox.runtime,
        sandbox.resolver,
        sandbox.executor,
        pattern=body.pattern,
        path=body.path,
        glob=body.glob,
        max_count=body.max_count,
        regex=body.regex,
        ignore_case=body.ignore_case,
        limit=settings.max_grep_matches,
        timeout=settings.grep_timeout_seconds,
        disconnected=lambda: client_gone(request.receive),
    )
    return Response(body_json, media_type="application/json")


async def client_gone(receive: Callable[[], Awaitable[Any]]) -> None:
    """Resolves once the HTTP client has gone away (ASGI ``http.disconnect``); for a
    request whose body has been read already."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # never expected once the body is read: no busy loop


@endpoint(ok=StatResponse, params=(PATH,))
async def fs_stat(request: Request) -> Response:
    """A path's type, size and mode."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    return json_response(await sandbox.executor.light(sandbox.files.stat, query_path(request)))


@endpoint(
    ok=PathResponse,
    params=(PATH, Param("recursive", {"type": "boolean", "default": True})),
)
async def fs_delete(request: Request) -> Response:
    """Delete a file or a directory."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    path = query_path(request)
    recursive = query_bool(request, "recursive", True)
    change = await sandbox.executor.heavy(sandbox.files.delete, path, recursive)
    entry.changed(change, ctx.actor)
    return json_response(PathResponse(path=change[0]))


@endpoint(responses={200: PathResponse, 201: PathResponse}, body=MkdirRequest)
async def fs_mkdir(request: Request) -> Response:
    """Create a directory."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    body = await parse_json(request, MkdirRequest)

    def mkdir() -> tuple[str, Change | None]:
        return sandbox.files.mkdir(body.path, parents=body.parents, exist_ok=body.exist_ok)

    path, change = await sandbox.executor.light(mkdir)
    if change is not None:
        entry.changed(change, ctx.actor)
    return json_response(PathResponse(path=path), 201 if change else 200)


@endpoint(ok=PathResponse, body=MoveRequest)
async def fs_move(request: Request) -> Response:
    """Move or rename."""
    entry, ctx = await authorize(request, Capability.FS_WRITE)
    sandbox = entry.ready()
    body = await parse_json(request, MoveRequest)

    def move() -> Change:
        return sandbox.files.move(body.src, body.dst, overwrite=body.overwrite)

    change = await sandbox.executor.light(move)
    entry.changed(change, ctx.actor)
    return json_response(PathResponse(path=change[0]))


# --- events -------------------------------------------------------------------------------


@endpoint(
    ok=event_stream("Events as Server-Sent Events")["200"],
    params=(
        Param("after", {"type": "integer", "minimum": 0}),
        Param("tail", {"type": "integer", "minimum": 0}),
        Param("Last-Event-ID", {"type": "string"}, where="header"),
    ),
)
async def events_sse(request: Request) -> Response:
    """The sandbox's events after the cursor (at most its latest ``tail``), then live."""
    entry, ctx = await authorize(request, Capability.FS_READ)
    host = host_of(request)
    raw = request.query_params.get("after") or request.headers.get("last-event-id") or "0"
    try:
        after = int(raw)
        tail = int(request.query_params.get("tail") or -1)
    except ValueError:
        raise InvalidRequest("after and tail must be integers") from None
    if after < 0:
        raise InvalidRequest("after must be >= 0")
    if tail >= 0:
        # At most the latest ``tail``: fewer when the log keeps fewer.
        log = entry.events
        after = max(after, log.last_sequence - tail, log.oldest_sequence - 1)
    entry.events.since(after)  # 410 now, before the stream starts
    # An open event stream counts like a WebSocket (429 beyond the limits).
    place = host.sockets.admit(entry.sandbox_id, "/events", authenticated=True)
    try:
        place.claim(ctx)
    except BaseException:
        place.release()
        raise
    closed = asyncio.Event()
    conn = host.track(entry, ctx, closed)
    keepalive = host.settings.keepalive_seconds
    wake = asyncio.Event()

    def ended() -> None:
        entry.events.unlisten(wake)
        host.untrack(entry, conn)
        place.release()

    async def stream() -> AsyncIterator[bytes]:
        cursor = after
        live = False
        entry.events.listen(wake)
        try:
            yield b": connected\n\n"
            while not closed.is_set():
                wake.clear()
                try:
                    batch = entry.events.since(cursor)
                except SequenceExpired as exc:
                    # The reader fell further behind than the log keeps.
                    yield expired_event(exc)
                    return
                if batch:
                    parts = [
                        f"id: {seq}\nevent: {etype}\ndata: {data}\n\n" for seq, etype, data in batch
                    ]
                    cursor = batch[-1][0]
                    yield "".join(parts).encode()
                    continue
                if not live:
                    # Caught up: what the log held is sent, what follows is live.
                    live = True
                    yield b": live\n\n"
                waiter = asyncio.ensure_future(wake.wait())
                stopper = asyncio.ensure_future(closed.wait())
                try:
                    done, _ = await asyncio.wait(
                        {waiter, stopper}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    # Also when the client left meanwhile (this wait is then cancelled).
                    waiter.cancel()
                    stopper.cancel()
                if not done:
                    yield b": keep-alive\n\n"
        finally:
            ended()

    return EndingStream(
        stream(),
        ended,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class EndingStream(StreamingResponse):
    """A streamed response whose ``ended`` runs when it ends, however it ends: a client
    gone before the first byte never starts the body's generator (nor its ``finally``)."""

    def __init__(self, content: AsyncIterator[bytes], ended: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ended()

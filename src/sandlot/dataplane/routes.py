"""HTTP routes of the dataplane (PROTOCOL.md 3.1, 3.3, 3.4 listing, 3.6, 3.7, 3.8)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sandlot import __version__ as _version
from sandlot.dataplane import grep as grep_mod
from sandlot.dataplane.execs import parse_signal
from sandlot.dataplane.fsops import decode_content
from sandlot.dataplane.web import (
    Api,
    endpoint,
    json_response,
    parse_json,
    query_bool,
    query_int,
    query_path,
)
from sandlot.protocol.common import API_VERSION, Capability
from sandlot.protocol.dataplane import (
    EditRequest,
    ExecRequest,
    GlobRequest,
    GrepRequest,
    MkdirRequest,
    MoveRequest,
    SignalRequest,
    WriteRequest,
)
from sandlot.protocol.errors import InvalidRequest, SequenceExpired

VERSION = {"api_version": API_VERSION, "server": f"sandlot/{_version}"}


@endpoint
async def version(request: Request) -> Response:
    return json_response(VERSION)


async def run_exec(api: Api, request: Request) -> dict[str, Any]:
    entry, ctx = await api.auth(request, Capability.EXEC)
    body = await parse_json(request, ExecRequest, limit=api.host.settings.max_write_bytes)
    runtime, *_ = entry.ready()
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


def exec_result(ex: Any, duration_ms: float) -> dict[str, Any]:
    out = ex.stdout.collected or b""
    err = ex.stderr.collected or b""
    # From the exec's own clock, so a replayed command_id answers identically.
    if ex.ended_at:
        duration_ms = (ex.ended_at - ex.started_at) * 1000
    return {
        "exec_id": ex.exec_id,
        "command_id": ex.command_id,
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err.decode("utf-8", "replace"),
        "exit_code": ex.exit_code,
        "timed_out": ex.timed_out,
        "oom_killed": ex.oom_killed,
        "truncated": ex.stdout.truncated or ex.stderr.truncated,
        "duration_ms": round(duration_ms, 3),
    }


def build_routes(api: Api) -> list[Route]:
    host = api.host
    settings = host.settings

    @endpoint
    async def exec_once(request: Request) -> Response:
        return json_response(await run_exec(api, request))

    @endpoint
    async def execs(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        seq = entry.events.last_sequence
        return json_response({"execs": [e.snapshot(seq) for e in entry.execs.all()]})

    @endpoint
    async def exec_get(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        ex = entry.execs.get(request.path_params["exec_id"])
        return json_response(ex.snapshot(entry.events.last_sequence))

    @endpoint
    async def exec_signal(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.EXEC)
        ex = entry.execs.get(request.path_params["exec_id"])
        body = await parse_json(request, SignalRequest)
        ex.signal(parse_signal(body.signal))
        return json_response(ex.snapshot(entry.events.last_sequence))

    @endpoint
    async def shells(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.SHELL_OBSERVE)
        return json_response({"shells": [s.snapshot() for s in entry.shells.all()]})

    @endpoint
    async def shell_delete(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.SHELL)
        await entry.shells.delete(request.path_params["name"])
        return Response(status_code=204)

    # --- filesystem operations ----------------------------------------------------------

    @endpoint
    async def fs_list(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        _, _, executor, files = entry.ready()
        path = query_path(request, default="/workspace")
        depth = query_int(request, "depth", 1, 1, 64)
        run = executor.light if depth == 1 else executor.heavy
        body = await run(files.list_json, path, depth)
        return Response(body, media_type="application/json")

    @endpoint
    async def fs_read(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        _, _, executor, files = entry.ready()
        path = query_path(request)
        offset = query_int(request, "offset", 0)
        limit = query_int(request, "limit", 2000, 1, 1 << 30)
        return json_response(await executor.light(files.read, path, offset, limit))

    @endpoint
    async def fs_write(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_WRITE)
        _, _, executor, files = entry.ready()
        body = await parse_json(request, WriteRequest, limit=settings.max_write_bytes * 2)
        data = decode_content(body.content, body.encoding)

        def write() -> Any:
            return files.write(
                body.path, data, if_match=body.if_match, if_none_match=body.if_none_match
            )

        result, change = await executor.heavy(write)
        entry.changed(change, ctx.actor)
        return json_response(result, 201 if result["created"] else 200)

    @endpoint
    async def fs_edit(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_WRITE)
        _, _, executor, files = entry.ready()
        body = await parse_json(request, EditRequest, limit=settings.max_write_bytes * 2)

        def edit() -> Any:
            return files.edit(
                body.path,
                body.old_string,
                body.new_string,
                replace_all=body.replace_all,
                if_match=body.if_match,
            )

        result, change = await executor.heavy(edit)
        entry.changed(change, ctx.actor)
        return json_response(result)

    @endpoint
    async def fs_glob(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        _, _, executor, files = entry.ready()
        body = await parse_json(request, GlobRequest)

        def glob() -> bytes:
            return files.glob_json(body.pattern, body.path, limit=body.limit)

        return Response(await executor.heavy(glob), media_type="application/json")

    @endpoint
    async def fs_grep(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        runtime, resolver, executor, _ = entry.ready()
        body = await parse_json(request, GrepRequest)
        body_json = await grep_mod.grep(
            runtime,
            resolver,
            executor,
            pattern=body.pattern,
            path=body.path,
            glob=body.glob,
            max_count=body.max_count,
            regex=body.regex,
            ignore_case=body.ignore_case,
            limit=settings.max_grep_matches,
            timeout=settings.grep_timeout_seconds,
            disconnected=lambda: grep_mod.client_gone(request.receive),
        )
        return Response(body_json, media_type="application/json")

    @endpoint
    async def fs_stat(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        _, _, executor, files = entry.ready()
        return json_response(await executor.light(files.stat, query_path(request)))

    @endpoint
    async def fs_delete(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_WRITE)
        _, _, executor, files = entry.ready()
        path = query_path(request)
        recursive = query_bool(request, "recursive", True)
        change = await executor.heavy(files.delete, path, recursive)
        entry.changed(change, ctx.actor)
        return json_response({"path": change[0]})

    @endpoint
    async def fs_mkdir(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_WRITE)
        _, _, executor, files = entry.ready()
        body = await parse_json(request, MkdirRequest)

        def mkdir() -> Any:
            return files.mkdir(body.path, parents=body.parents, exist_ok=body.exist_ok)

        path, change = await executor.light(mkdir)
        if change is not None:
            entry.changed(change, ctx.actor)
        return json_response({"path": path}, 201 if change else 200)

    @endpoint
    async def fs_move(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_WRITE)
        _, _, executor, files = entry.ready()
        body = await parse_json(request, MoveRequest)

        def move() -> Any:
            return files.move(body.src, body.dst, overwrite=body.overwrite)

        change = await executor.light(move)
        entry.changed(change, ctx.actor)
        return json_response({"path": change[0]})

    # --- events -------------------------------------------------------------------------

    @endpoint
    async def events_sse(request: Request) -> Response:
        entry, ctx = await api.auth(request, Capability.FS_READ)
        raw = request.query_params.get("after") or request.headers.get("last-event-id") or "0"
        try:
            after = int(raw)
        except ValueError:
            raise InvalidRequest("after must be an integer") from None
        if after < 0:
            raise InvalidRequest("after must be >= 0")
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

        def ended() -> None:
            entry.events.unlisten(wake)
            host.untrack(entry, conn)
            place.release()

        wake = asyncio.Event()

        async def stream() -> AsyncIterator[bytes]:
            cursor = after
            entry.events.listen(wake)
            try:
                yield b": connected\n\n"
                while not closed.is_set():
                    wake.clear()
                    try:
                        batch = entry.events.since(cursor)
                    except SequenceExpired:
                        # The reader fell further behind than the log keeps.
                        yield b'event: error\ndata: {"code":"SEQUENCE_EXPIRED"}\n\n'
                        return
                    if batch:
                        parts = [
                            f"id: {seq}\nevent: {etype}\ndata: {data}\n\n"
                            for seq, etype, data in batch
                        ]
                        cursor = batch[-1][0]
                        yield "".join(parts).encode()
                        continue
                    waiter = asyncio.ensure_future(wake.wait())
                    stopper = asyncio.ensure_future(closed.wait())
                    try:
                        done, _ = await asyncio.wait(
                            {waiter, stopper},
                            timeout=settings.keepalive_seconds,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    finally:
                        # Also when the client left meanwhile (this wait is then cancelled).
                        waiter.cancel()
                        stopper.cancel()
                    if not done:
                        yield b": keep-alive\n\n"
            finally:
                ended()

        return _Stream(
            stream(),
            ended,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return [
        Route("/healthz", version, methods=["GET"]),
        Route("/__meta/version", version, methods=["GET"]),
        Route("/exec", exec_once, methods=["POST"]),
        Route("/execs", execs, methods=["GET"]),
        Route("/execs/{exec_id}", exec_get, methods=["GET"]),
        Route("/execs/{exec_id}/signal", exec_signal, methods=["POST"]),
        Route("/shells", shells, methods=["GET"]),
        Route("/shells/{name}", shell_delete, methods=["DELETE"]),
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
        Route("/events", events_sse, methods=["GET"]),
    ]


class _Stream(StreamingResponse):
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

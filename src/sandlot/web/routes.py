"""The workspace's HTTP routes: boring-ui's, and sandlot's richer ones under ``/api/v1``.

Thin adapters: each reads its query and body, opens the signed-in user's workspace
(:func:`~sandlot.web.workspaces.open_workspace`), calls a service
(:mod:`~sandlot.web.files`, :mod:`~sandlot.web.git`, :mod:`~sandlot.web.activity`) and
answers JSON. Every answer is JSON data only: ``<``, ``>`` and ``&`` are escaped as
``\\u003c``… and every non-ASCII or control character as ``\\uXXXX`` (a file named
``<script>`` or carrying an escape sequence is text in a string, whatever reads it),
with ``X-Content-Type-Options: nosniff`` and ``Cache-Control: no-store``. Errors are the
project's envelope under the browser's request id (``X-Request-Id``, echoed when sane),
never a stack trace, an upstream URL or a token; an etag conflict is 412.

The routes that walk the workspace (``/api/tree``, ``/api/search``, ``/api/v1/grep``)
spend their user's budget first (:class:`~sandlot.web.limits.RouteGate`); an empty one
is 429 ``RATE_LIMITED`` with ``Retry-After``, before the workspace is opened.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandlot import __version__
from sandlot.protocol.errors import (
    FileNotFound,
    InternalError,
    InvalidRequest,
    ProviderUnavailable,
    RateLimited,
    ResourceNotFound,
    SandlotError,
)
from sandlot.web.activity import ActivityResponse, ActivityStream, UserStreams, WorkspaceActivity
from sandlot.web.auth import current_user, read_capped
from sandlot.web.calls import DataplaneCalls
from sandlot.web.errors import error_answer
from sandlot.web.files import WorkspaceFiles
from sandlot.web.gateway import Gateway, request_id_of
from sandlot.web.git import WorkspaceGit
from sandlot.web.limits import RouteGate, Walk
from sandlot.web.metrics import WebMetrics
from sandlot.web.settings import WebSettings, WorkspaceMode
from sandlot.web.transfer import WorkspaceTransfer
from sandlot.web.workspaces import Workspaces, open_workspace

log = logging.getLogger("sandlot.web.routes")

#: Headers of every answer of these routes.
SAFE_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def json_text(data: Any) -> bytes:
    """JSON with every character that could be read as markup or a terminal escape escaped."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.translate(_ESCAPES).encode("ascii")


def json_answer(
    data: Any, request_id: str, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        json_text(data),
        status_code=status,
        media_type="application/json",
        headers={**SAFE_HEADERS, "X-Request-Id": request_id, **(headers or {})},
    )


def error_json(exc: BaseException, request_id: str) -> Response:
    """The envelope of ``exc``; an etag conflict is 412 (RFC 9110), not the table's 409."""
    if isinstance(exc, SandlotError) and exc.status < 400:
        exc = ProviderUnavailable("the workspace cannot be reached now")
    answer = error_answer(exc, request_id)
    status = 412 if answer.body["error"]["code"] == "PRECONDITION_FAILED" else answer.status
    return json_answer(answer.body, request_id, status, answer.headers)


def unified_diff(path: str, before: str | None, after: str | None) -> str:
    """``before`` → ``after`` as a unified diff (``None``: no such file on that side)."""
    old = (before or "").splitlines(keepends=True)
    new = (after or "").splitlines(keepends=True)
    lines = difflib.unified_diff(
        old,
        new,
        fromfile=f"a/{path}" if before is not None else "/dev/null",
        tofile=f"b/{path}" if after is not None else "/dev/null",
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


def query(request: Request, name: str, default: str | None = None) -> str:
    value = request.query_params.get(name)
    if value is None:
        if default is None:
            raise InvalidRequest(f"the query parameter {name} is required")
        return default
    return value


def query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be a whole number") from None


def query_bool(request: Request, name: str) -> bool:
    raw = (request.query_params.get(name) or "").lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidRequest(f"{name} must be true or false")


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object (at most ``limit`` bytes)."""
    body = await read_capped(request, limit)
    try:
        data = json.loads(body)
    except ValueError:
        raise InvalidRequest("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    return data


def string_field(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string")
    return value


def _etag_header(request: Request, name: str) -> str | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    value = raw.strip()
    if "," in value or value.startswith("W/"):
        raise InvalidRequest(f"{name} takes one strong etag")
    return value.strip('"')


Handler = Callable[[Request, DataplaneCalls], Awaitable[Any]]


class WorkspaceRoutes:
    """The routes of :mod:`sandlot.web.routes`, over one gateway and one mode's workspaces.

    ``features`` are the optional parts (``pty``, ``chat_claude_code``) and whether they
    are served, for ``/api/capabilities``; ``walks`` admits the routes that walk the
    workspace (a gate of the settings' ``route_limits`` if none); ``metrics`` counts what
    it refuses (the gateway's registry's if none).
    """

    def __init__(
        self,
        settings: WebSettings,
        gateway: Gateway,
        workspaces: Workspaces,
        features: dict[str, bool] | None = None,
        *,
        walks: RouteGate | None = None,
        metrics: WebMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.gateway = gateway
        self.workspaces = workspaces
        self.features = features or {}
        self.walks = walks or RouteGate(settings.route_limits)
        self.metrics = metrics or WebMetrics.of(gateway.registry)
        #: The activity streams each user has open (at most ``max_activity_streams``).
        self.streams = UserStreams(settings.max_activity_streams)

    def routes(self) -> list[BaseRoute]:
        h = self._handler
        return [
            Route("/api/capabilities", self.capabilities, methods=["GET"]),
            Route("/api/tree", h(self.tree, Walk.TREE), methods=["GET"]),
            Route("/api/file", h(self.read_file), methods=["GET"]),
            Route("/api/file", h(self.write_file), methods=["PUT"]),
            Route("/api/file", h(self.delete_file), methods=["DELETE"]),
            Route("/api/file/rename", h(self.rename), methods=["POST"]),
            Route("/api/file/move", h(self.move), methods=["POST"]),
            Route("/api/search", h(self.search, Walk.SEARCH), methods=["GET"]),
            Route("/api/git/status", h(self.git_status), methods=["GET"]),
            Route("/api/git/diff", h(self.git_diff), methods=["GET"]),
            Route("/api/git/show", h(self.git_show), methods=["GET"]),
            Route("/api/v1/file", h(self.read_versioned), methods=["GET"]),
            Route("/api/v1/file", h(self.write_versioned), methods=["PUT"]),
            Route("/api/v1/file/diff", h(self.agent_diff), methods=["GET"]),
            Route("/api/v1/grep", h(self.grep, Walk.SEARCH), methods=["GET"]),
            Route("/api/v1/activity", h(self.activity), methods=["GET"]),
            Route("/api/v1/activity/stream", h(self.activity_stream), methods=["GET"]),
            Route("/api/v1/download", h(self.download), methods=["GET"]),
            Route("/api/v1/archive", h(self.archive), methods=["GET"]),
            Route("/api/v1/upload", h(self.upload), methods=["POST"]),
            Route("/api/v1/workspaces", self.workspace_list, methods=["GET"]),
            Route("/api/v1/workspace", self.workspace_open, methods=["GET", "POST"]),
        ]

    def _handler(
        self, handler: Handler, walk: Walk | None = None
    ) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def endpoint(request: Request) -> Response:
            rid = request_id_of(request.headers)
            try:
                if walk is not None:
                    self._admit(request, walk)
                workspace = await open_workspace(request, self.workspaces)
                result = await handler(request, DataplaneCalls(self.gateway, workspace, rid))
            except SandlotError as exc:
                return error_json(exc, rid)
            except Exception:
                log.exception("unexpected error on %s %s", request.method, request.url.path)
                return error_json(InternalError("internal error"), rid)
            if isinstance(result, Response):
                result.headers.update({**SAFE_HEADERS, "X-Request-Id": rid})
                return result
            return json_answer(result, rid)

        return endpoint

    def _admit(self, request: Request, walk: Walk) -> None:
        user = current_user(request).user_id
        try:
            self.walks.admit(walk, user)
        except RateLimited:
            log.info("%s refused for %s: over its rate limit", request.url.path, user)
            self.metrics.route_limited.labels(request.url.path).inc()
            raise

    def _files(self, calls: DataplaneCalls) -> WorkspaceFiles:
        return WorkspaceFiles(calls, self.settings)

    # --- boring-ui's --------------------------------------------------------------------

    async def capabilities(self, request: Request) -> Response:
        """``GET /api/capabilities``: what this server serves (no sign-in needed)."""
        features = {
            "files": True,
            "git": True,
            "pty": self.features.get("pty", False),
            "chat_claude_code": self.features.get("chat_claude_code", False),
            "approval": False,
            "search": True,
            "grep": True,
            "etags": True,
            "activity": True,
        }
        routers = [
            ("files", "/api", "File operations (tree, read, write, rename, move, delete)"),
            ("git", "/api/git", "Git status, diff and show"),
            ("pty", "/ws", "PTY WebSocket for shell terminals"),
            ("chat_claude_code", "/ws", "Agent stream WebSocket"),
            ("sandlot", "/api/v1", "Versioned files, content search, activity"),
        ]
        body = {
            "version": __version__,
            "mode": self.workspaces.mode.value,
            "features": features,
            "routers": [
                {
                    "name": name,
                    "prefix": prefix,
                    "description": text,
                    "enabled": features.get(name, True),
                }
                for name, prefix, text in routers
            ],
        }
        return json_answer(body, request_id_of(request.headers))

    async def tree(self, request: Request, calls: DataplaneCalls) -> Any:
        path = query(request, "path", ".")
        return await self._files(calls).tree(path, query_int(request, "depth", 1))

    async def read_file(self, request: Request, calls: DataplaneCalls) -> Any:
        return await self._files(calls).read_text(query(request, "path"))

    async def write_file(self, request: Request, calls: DataplaneCalls) -> Any:
        path = query(request, "path")
        body = await json_body(request, self.settings.max_body_bytes)
        await self._files(calls).write(path, string_field(body, "content"))
        return {"success": True, "path": path}

    async def delete_file(self, request: Request, calls: DataplaneCalls) -> Any:
        return await self._files(calls).delete(query(request, "path"))

    async def rename(self, request: Request, calls: DataplaneCalls) -> Any:
        body = await json_body(request, 64 * 1024)
        old, new = string_field(body, "old_path"), string_field(body, "new_path")
        return await self._files(calls).rename(old, new)

    async def move(self, request: Request, calls: DataplaneCalls) -> Any:
        body = await json_body(request, 64 * 1024)
        src, dest = string_field(body, "src_path"), string_field(body, "dest_dir")
        return await self._files(calls).move(src, dest)

    async def search(self, request: Request, calls: DataplaneCalls) -> Any:
        return await self._files(calls).search(query(request, "q"), query(request, "path", "."))

    async def git_status(self, request: Request, calls: DataplaneCalls) -> Any:
        return await WorkspaceGit(calls).status()

    async def git_diff(self, request: Request, calls: DataplaneCalls) -> Any:
        return await WorkspaceGit(calls).diff(query(request, "path"))

    async def git_show(self, request: Request, calls: DataplaneCalls) -> Any:
        return await WorkspaceGit(calls).show(query(request, "path"))

    # --- sandlot's ----------------------------------------------------------------------

    async def read_versioned(self, request: Request, calls: DataplaneCalls) -> Any:
        """``GET /api/v1/file``: ``{"path", "content", "encoding", "etag", "size"}``."""
        found = await self._files(calls).read(query(request, "path"))
        return json_answer(found, "", headers={"ETag": f'"{found["etag"]}"'})

    async def write_versioned(self, request: Request, calls: DataplaneCalls) -> Any:
        """``PUT /api/v1/file`` with ``If-Match: "<etag>"`` (or ``If-None-Match: *``)."""
        path = query(request, "path")
        body = await json_body(request, self.settings.max_body_bytes)
        encoding = body.get("encoding", "utf-8")
        if encoding not in ("utf-8", "base64"):
            raise InvalidRequest("encoding must be utf-8 or base64")
        if_match = _etag_header(request, "if-match")
        if if_match is None and isinstance(body.get("if_match"), str):
            if_match = body["if_match"]
        if_none_match = _etag_header(request, "if-none-match")
        if if_none_match not in (None, "*"):
            raise InvalidRequest("If-None-Match takes only *")
        written = await self._files(calls).write(
            path,
            string_field(body, "content"),
            encoding=encoding,
            if_match=if_match,
            if_none_match=if_none_match,
        )
        status = 201 if written["created"] else 200
        return json_answer(written, "", status, headers={"ETag": f'"{written["etag"]}"'})

    async def grep(self, request: Request, calls: DataplaneCalls) -> Any:
        return await self._files(calls).grep(
            query(request, "q"),
            query(request, "path", "."),
            glob=request.query_params.get("glob") or None,
            regex=query_bool(request, "regex"),
            ignore_case=query_bool(request, "ignore_case"),
        )

    async def activity(self, request: Request, calls: DataplaneCalls) -> Any:
        after = query_int(request, "after", 0)
        limit = query_int(request, "limit", 100)
        return await WorkspaceActivity(calls).page(after, limit)

    async def activity_stream(self, request: Request, calls: DataplaneCalls) -> Any:
        """``GET /api/v1/activity/stream``: the log after ``after`` (or the browser's
        ``Last-Event-ID`` when it reconnects), then live, as Server-Sent Events."""
        after = query_int(request, "after", 0)
        tail = query_int(request, "tail", 0) if request.query_params.get("tail") else None
        last_id = request.headers.get("last-event-id", "").strip()
        if last_id.isdigit():
            # A reconnection: everything it missed, whatever the first open asked.
            after, tail = int(last_id), None
        stream = ActivityStream(calls, after, tail)
        await stream.open()
        return ActivityResponse(
            stream,
            lambda event: json_text(event).decode("ascii"),
            streams=self.streams,
            user=current_user(request).user_id,
            headers={"X-Accel-Buffering": "no"},
        )

    def _transfer(self, calls: DataplaneCalls) -> WorkspaceTransfer:
        return WorkspaceTransfer(calls, self._files(calls))

    async def download(self, request: Request, calls: DataplaneCalls) -> Any:
        return await self._transfer(calls).download(query(request, "path"))

    async def archive(self, request: Request, calls: DataplaneCalls) -> Any:
        return await self._transfer(calls).archive(query(request, "path", "."))

    async def upload(self, request: Request, calls: DataplaneCalls) -> Any:
        written = await self._transfer(calls).upload(query(request, "path"), request.stream())
        return json_answer(written, "", 201)

    async def workspace_list(self, request: Request) -> Response:
        """``GET /api/v1/workspaces``: ``{"workspaces": [{"id", "thread", "sandbox",
        "name", "state", "template", "created_at", "attached"}], "mode"}``."""
        rid = request_id_of(request.headers)
        try:
            entries = await self.workspaces.listing(current_user(request))
        except SandlotError as exc:
            return error_json(exc, rid)
        except Exception:
            log.exception("unexpected error listing workspaces")
            return error_json(InternalError("internal error"), rid)
        return json_answer({"workspaces": entries, "mode": self.workspaces.mode.value}, rid)

    async def workspace_open(self, request: Request) -> Response:
        """``GET /api/v1/workspace?thread=|?sandbox=``: the workspace named, once its
        sandbox is active, ``{"workspace": {"id", "thread", "sandbox"}, "mode"}``; never
        creates one (a thread without a sandbox: ``"workspace": null``, where every other
        route answers 404 with ``metadata.creatable``). ``POST`` (CSRF token required)
        creates a thread's sandbox when it has none."""
        rid = request_id_of(request.headers)
        create = request.method == "POST"
        mode = self.workspaces.mode.value
        try:
            workspace = await open_workspace(request, self.workspaces, create=create)
            plane = await workspace.dataplane()
        except ResourceNotFound as exc:
            if create or not exc.metadata.get("creatable"):
                return error_json(exc, rid)
            return json_answer({"workspace": None, "mode": mode}, rid)
        except SandlotError as exc:
            return error_json(exc, rid)
        except Exception:
            log.exception("unexpected error opening a workspace")
            return error_json(InternalError("internal error"), rid)
        local = self.workspaces.mode is WorkspaceMode.LOCAL
        entry = {
            "id": workspace.id,
            "thread": None if local else request.query_params.get("thread") or None,
            "sandbox": None if local else plane.sandbox_id,
        }
        return json_answer({"workspace": entry, "mode": mode}, rid)

    async def agent_diff(self, request: Request, calls: DataplaneCalls) -> Any:
        """``GET /api/v1/file/diff``: the file against ``HEAD``, and the agent's last
        change to it that the event log holds (docs/WEB.md, "Workspace routes")."""
        path = query(request, "path")
        is_repo, base = await WorkspaceGit(calls).head_content(path)
        files = self._files(calls)
        current: str | None = None
        binary = False
        with contextlib.suppress(FileNotFound):
            found = await files.read(path)
            binary = found["encoding"] == "base64"
            current = None if binary else found["content"]
        if base is None and current is None and not binary:
            raise FileNotFound("no such file, neither now nor at HEAD")
        change = await WorkspaceActivity(calls).last_agent_change(path)
        return {
            "path": path,
            "base": "HEAD",
            "is_repo": is_repo,
            "in_head": base is not None,
            "binary": binary,
            "diff": None if binary else unified_diff(path, base, current),
            "last_agent_change": change,
        }

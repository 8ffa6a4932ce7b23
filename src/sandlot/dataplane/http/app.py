"""The dataplane's route table and the ASGI app serving it.

:data:`ROUTES` is every route of one sandbox's dataplane, relative to its
``http_base_url`` (``…/{sandbox_id}/v1``); the OpenAPI document is drawn from it
(:func:`sandlot.dataplane.http.openapi.document`). :func:`build_app` mounts it for
a :class:`~sandlot.dataplane.http.web.Host`, with the answers for unknown routes
and methods, and :class:`Direct` serves the common routes without Starlette's
router in front of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

from sandlot.dataplane.http import langsmith, openapi, routes, transfer, websockets
from sandlot.dataplane.http.metrics import UNMATCHED, DataplaneMetrics
from sandlot.dataplane.http.web import Host, endpoint, error_response, json_response, request_id_of
from sandlot.protocol.errors import InternalError, InvalidRequest, ResourceNotFound

log = logging.getLogger("sandlot.dataplane")


@endpoint(ok={"description": "This document", "content": {"application/json": {}}}, public=True)
async def openapi_document(request: Request) -> Response:
    """The dataplane's OpenAPI document."""
    return json_response(openapi.document(ROUTES))


#: One sandbox's routes, relative to its ``http_base_url``.
ROUTES: list[BaseRoute] = [
    Route("/healthz", routes.version, methods=["GET"]),
    Route("/__meta/version", routes.version, methods=["GET"]),
    Route("/openapi.json", openapi_document, methods=["GET"]),
    # Commands and shells (PROTOCOL.md 3.3, 3.4).
    Route("/exec", routes.exec_once, methods=["POST"]),
    Route("/execs", routes.execs, methods=["GET"]),
    Route("/execs/{exec_id}", routes.exec_get, methods=["GET"]),
    Route("/execs/{exec_id}/signal", routes.exec_signal, methods=["POST"]),
    WebSocketRoute("/exec/ws", websockets.exec_ws),
    Route("/shells", routes.shells, methods=["GET"]),
    Route("/shells/{name}", routes.shell_delete, methods=["DELETE"]),
    WebSocketRoute("/shell/ws", websockets.shell_ws),
    # Files (3.5) and filesystem operations (3.6).
    Route("/files/upload", transfer.upload, methods=["POST", "PUT"]),
    Route("/files/download", transfer.download, methods=["GET", "HEAD"]),
    Route("/files/archive", transfer.archive_in, methods=["POST"]),
    Route("/files/archive", transfer.archive_out, methods=["GET"]),
    Route("/fs/list", routes.fs_list, methods=["GET"]),
    Route("/fs/read", routes.fs_read, methods=["GET"]),
    Route("/fs/write", routes.fs_write, methods=["PUT", "POST"]),
    Route("/fs/edit", routes.fs_edit, methods=["POST"]),
    Route("/fs/glob", routes.fs_glob, methods=["POST"]),
    Route("/fs/grep", routes.fs_grep, methods=["POST"]),
    Route("/fs/stat", routes.fs_stat, methods=["GET"]),
    Route("/fs", routes.fs_delete, methods=["DELETE"]),
    Route("/fs/mkdir", routes.fs_mkdir, methods=["POST"]),
    Route("/fs/move", routes.fs_move, methods=["POST"]),
    # The event log (3.7).
    Route("/events", routes.events_sse, methods=["GET"]),
    WebSocketRoute("/events/ws", websockets.events_ws),
    # The LangSmith-compatible surface (3.9).
    Route("/execute", langsmith.execute, methods=["POST"]),
    WebSocketRoute("/execute/ws", websockets.execute_ws),
    Route("/upload", transfer.upload, methods=["POST", "PUT"]),
    Route("/download", transfer.download, methods=["GET", "HEAD"]),
    Route("/glob", langsmith.glob, methods=["POST"]),
    Route("/grep", routes.fs_grep, methods=["POST"]),
]


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ResourceNotFound("no such route"), request_id_of(request.headers))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    resp = error_response(InvalidRequest("method not allowed"), request_id_of(request.headers))
    resp.status_code = 405
    return resp


async def _server_error(request: Request, exc: Exception) -> Response:
    return server_error_response(request)


def server_error_response(request: Request) -> Response:
    return error_response(InternalError("internal error"), request_id_of(request.headers))


def build_app(host: Host, routes: list[BaseRoute]) -> Starlette:
    """A Starlette app serving ``routes`` for ``host`` (``app.state.dataplane``), every
    error as the envelope."""
    app = Starlette(
        routes=routes,
        exception_handlers={404: _not_found, 405: _method_not_allowed, 500: _server_error},
    )
    app.state.dataplane = host
    return app


def sandbox_app(host: Host) -> Direct:
    """Every sandbox of ``host`` at ``/{sandbox_id}/v1/…``."""
    app = build_app(
        host,
        [
            Route("/healthz", routes.version, methods=["GET"]),
            Route("/__meta/version", routes.version, methods=["GET"]),
            Mount("/{sandbox_id}/v1", routes=ROUTES),
        ],
    )
    return Direct(app, ROUTES, host.metrics)


class Direct:
    """``/{sandbox_id}/v1/<route>`` straight to the route's endpoint, when the route has no
    path parameter of its own (``/fs/read``, ``/fs/grep``, ``/exec``...); anything else
    (WebSockets, ``/exec/{id}/...``, unknown paths and methods) through ``app``.

    Starlette's middleware and route matching (a regular expression per route, one
    scope copy per level) are about a tenth of a small file operation; the endpoints
    write every error as the envelope themselves (:func:`~sandlot.dataplane.http.web.endpoint`).
    Every HTTP request, either way, is counted in ``metrics``.
    """

    def __init__(
        self, app: Starlette, routes: Sequence[BaseRoute], metrics: DataplaneMetrics
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.table: dict[tuple[str, str], Any] = {}
        for route in routes:
            if isinstance(route, Route) and "{" not in route.path:
                for method in route.methods or ():
                    self.table[(method, route.path)] = route.endpoint

    @property
    def routes(self) -> list[BaseRoute]:
        """The routes of the app behind (every route, the direct ones included)."""
        return self.app.routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            parts = path.split("/", 2)  # "", sandbox id, "v1/<route>"
            if len(parts) == 3 and parts[1] and parts[2].startswith("v1/"):
                sandbox_id = parts[1]
                endpoint = self.table.get((scope["method"], parts[2][2:]))
                if endpoint is not None:
                    # "app": what Starlette's own request code looks for (a malformed
                    # multipart body is then a 400, as behind Starlette's router), and
                    # where the endpoints find their host.
                    child = {**scope, "app": self.app, "path_params": {"sandbox_id": sandbox_id}}
                    await _serve(endpoint, child, receive, send, self.metrics, parts[2][2:])
                    return
            await measured(self.app, scope, receive, send, self.metrics)
            return
        await self.app(scope, receive, send)


class _Answer:
    """The ``send`` of one HTTP request: notes the status, counts an error's code."""

    __slots__ = ("counted", "metrics", "send", "status")

    def __init__(self, send: Any, metrics: DataplaneMetrics) -> None:
        self.send = send
        self.metrics = metrics
        self.status = 0
        self.counted = False

    async def __call__(self, message: Any) -> None:
        if not self.status:
            self.status = message["status"]  # http.response.start comes first
        elif self.status >= 400 and not self.counted:
            self.counted = True
            self.metrics.error_answer(self.status, message.get("body", b""))
        await self.send(message)


async def _serve(
    endpoint: Any, scope: Any, receive: Any, send: Any, metrics: DataplaneMetrics, route: str
) -> None:
    """What Starlette's route and error middleware do around an endpoint, for one that
    answers every error itself: an exception escaping it (or its response) is still a
    500 envelope if nothing was sent yet."""
    started = time.perf_counter()
    answer = _Answer(send, metrics)
    request = Request(scope, receive, send)
    try:
        response = await endpoint(request)
        await response(scope, receive, answer)
    except Exception:
        if answer.status:
            raise
        log.exception("unexpected error in the dataplane")
        await server_error_response(request)(scope, receive, answer)
    finally:
        metrics.request(scope["method"], route, answer.status or 500, time.perf_counter() - started)


async def measured(
    app: Any, scope: Any, receive: Any, send: Any, metrics: DataplaneMetrics
) -> None:
    """An HTTP request served by a Starlette app, counted under its route's template."""
    started = time.perf_counter()
    answer = _Answer(send, metrics)
    try:
        await app(scope, receive, answer)
    finally:
        # Starlette's router notes the route it matched in the scope.
        route = scope.get("route")
        template = route.path if isinstance(route, Route) else UNMATCHED
        metrics.request(
            scope["method"], template, answer.status or 500, time.perf_counter() - started
        )

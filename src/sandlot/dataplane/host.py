"""The dataplane host: sandboxes registered by a provider, served as one ASGI app.

The local provider creates a :class:`DataplaneHost`, registers each sandbox
(possibly while it is still provisioning: calls then get 423
SANDBOX_STARTING), hands it the runtime once it runs, and mounts :attr:`app`
(the embedded server puts it at ``/dp``, so URLs read
``/dp/{sandbox_id}/v1/exec``). :func:`create_standalone_app` serves a single
sandbox from inside a remote container.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from sandlot.dataplane import grepcache, native, openapi
from sandlot.dataplane.auth import ApiKeyResolver, AuthContext, Authenticator, TokenVerifier
from sandlot.dataplane.langsmith import build_langsmith_routes
from sandlot.dataplane.metrics import UNMATCHED, DataplaneMetrics
from sandlot.dataplane.routes import VERSION, build_routes
from sandlot.dataplane.sandbox import Connection, SandboxEntry
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.dataplane.socketlimits import SocketLimits
from sandlot.dataplane.transfer import build_transfer_routes
from sandlot.dataplane.web import Api, endpoint, error_response, json_response, request_id_of
from sandlot.dataplane.websockets import build_ws_routes
from sandlot.protocol.errors import ResourceNotFound, SandboxNotFound
from sandlot.protocol.sessions import SandboxActivity
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.runtime.base import SandboxRuntime

if TYPE_CHECKING:
    from sandlot.dataplane.websockets import Socket

log = logging.getLogger("sandlot.dataplane")


def _sandbox_routes(api: Api) -> list[BaseRoute]:
    routes = build_routes(api)
    by_path = {r.path: r for r in routes}
    return [
        *routes,
        Route("/openapi.json", _openapi, methods=["GET"]),
        *build_transfer_routes(api),
        *build_langsmith_routes(api, by_path),
        *build_ws_routes(api),
    ]


@endpoint
async def _version(request: Request) -> Response:
    return json_response(VERSION)


@endpoint
async def _openapi(request: Request) -> Response:
    return json_response(openapi.document())


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ResourceNotFound("no such route"), request_id_of(request.headers))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    from sandlot.protocol.errors import InvalidRequest

    resp = error_response(InvalidRequest("method not allowed"), request_id_of(request.headers))
    resp.status_code = 405
    return resp


async def _server_error(request: Request, exc: Exception) -> Response:
    return _server_error_response(request)


def _app(routes: list[BaseRoute]) -> Starlette:
    return Starlette(
        routes=routes,
        exception_handlers={404: _not_found, 405: _method_not_allowed, 500: _server_error},
    )


class _Direct:
    """``/{sandbox_id}/v1/<route>`` straight to the route's endpoint, when the route has no
    path parameter of its own (``/fs/read``, ``/fs/grep``, ``/exec``...); anything else
    (WebSockets, ``/exec/{id}/...``, unknown paths and methods) through ``app``.

    Starlette's middleware and route matching (a regular expression per route, one
    scope copy per level) are about a tenth of a small file operation; the endpoints
    write every error as the envelope themselves (:func:`~sandlot.dataplane.web.endpoint`).
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
                    # multipart body is then a 400, as behind Starlette's router).
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
        await _server_error_response(request)(scope, receive, answer)
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


def _server_error_response(request: Request) -> Response:
    from sandlot.protocol.errors import InternalError

    return error_response(InternalError("internal error"), request_id_of(request.headers))


class DataplaneHost:
    """Serves the dataplane of every sandbox registered with it."""

    def __init__(
        self,
        *,
        verifier: TokenVerifier,
        settings: DataplaneSettings | None = None,
        api_key_resolver: ApiKeyResolver | None = None,
    ) -> None:
        self.verifier = verifier
        self.settings = settings or DataplaneSettings()
        native.configure(self.settings.native)
        grepcache.configure(self.settings.grep_cache)
        self.authenticator = Authenticator(verifier, api_key_resolver)
        self._entries: dict[str, SandboxEntry] = {}
        self.sockets = SocketLimits(
            self.settings.max_websockets_per_token, self.settings.max_websockets_per_sandbox
        )
        self.metrics = DataplaneMetrics(self.sockets, lambda: list(self._entries.values()))
        self._api = Api(self)
        sandbox_routes = _sandbox_routes(self._api)
        self.app: Any = _Direct(
            _app(
                [
                    Route("/healthz", _version, methods=["GET"]),
                    Route("/__meta/version", _version, methods=["GET"]),
                    Mount("/{sandbox_id}/v1", routes=sandbox_routes),
                ]
            ),
            sandbox_routes,
            self.metrics,
        )

    # --- registration -------------------------------------------------------------------

    def entry(self, sandbox_id: str) -> SandboxEntry:
        entry = self._entries.get(sandbox_id)
        if entry is None:
            raise SandboxNotFound("no such sandbox")
        return entry

    def register(
        self,
        sandbox_id: str,
        generation: int,
        state: SandboxState,
        runtime: SandboxRuntime | None = None,
    ) -> None:
        old = self._entries.get(sandbox_id)
        if old is not None and old.generation != generation:
            # A recreated sandbox: the old generation's processes and sockets go.
            task = asyncio.get_running_loop().create_task(old.close())
            _keep(task)
        entry = SandboxEntry(sandbox_id, generation, state, self.settings)
        if old is not None and old.generation == generation:
            entry = old
            entry.state = state
        self._entries[sandbox_id] = entry
        if runtime is not None:
            entry.set_runtime(runtime)

    def set_runtime(self, sandbox_id: str, runtime: SandboxRuntime) -> None:
        self.entry(sandbox_id).set_runtime(runtime)

    def set_state(self, sandbox_id: str, state: SandboxState, *, reason: str | None = None) -> int:
        entry = self.entry(sandbox_id)
        previous = entry.state
        entry.state = state
        return entry.emit(
            f"phase.{state.value}",
            "phase",
            {"from": previous.value, "to": state.value, "reason": reason},
        )

    def status(self, sandbox_id: str) -> tuple[SandboxState, int]:
        entry = self.entry(sandbox_id)
        return entry.state, entry.events.last_sequence

    def activity(self, sandbox_id: str) -> SandboxActivity:
        entry = self.entry(sandbox_id)
        # Every WebSocket and SSE stream of the sandbox (exec, shell and event clients).
        return SandboxActivity(
            running_execs=entry.execs.running,
            attached_clients=len(entry.connections),
            last_active_at=entry.last_active_at,
        )

    def revoke(self, tokens: Sequence[RevokedToken]) -> None:
        self.verifier.revoke(tokens)
        jtis = {t.jti for t in tokens}
        for entry in self._entries.values():
            for conn in list(entry.connections):
                if conn.jti in jtis:
                    conn.close(4401, "token revoked")

    async def unregister(self, sandbox_id: str) -> None:
        entry = self._entries.pop(sandbox_id, None)
        if entry is not None:
            await entry.close()

    async def readopt(self, sandbox_id: str) -> None:
        """Take over the commands and shells a previous server left running in the sandbox."""
        await self.entry(sandbox_id).readopt()

    async def close(self) -> None:
        """The server is stopping: sandboxes and their running work stay for the next one."""
        for sandbox_id in list(self._entries):
            entry = self._entries.pop(sandbox_id)
            await entry.close(detach=True)

    # --- connections (for revocation, expiry and activity) ------------------------------

    def track(
        self,
        entry: SandboxEntry,
        ctx: AuthContext,
        closed: asyncio.Event,
        sock: Socket | None = None,
    ) -> Connection:
        """Count a socket (or stream) of ``ctx`` on ``entry``: it is closed when its token is
        revoked or expires (``closed`` is set; ``sock``, if any, gets its close frame)."""

        async def closer(code: int, reason: str) -> None:
            closed.set()
            if sock is not None:
                await sock.close(code, reason)

        conn = Connection(ctx.jti, closer)
        entry.add_connection(conn, ctx.expires_at, self.verifier.leeway)
        return conn

    def untrack(self, entry: SandboxEntry, conn: Connection) -> None:
        """The socket of :meth:`track` ended (idempotent)."""
        entry.remove_connection(conn)


def _keep(task: asyncio.Task[Any]) -> None:
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


_tasks: set[asyncio.Task[Any]] = set()


class _StandaloneApp:
    """ASGI wrapper that registers the one sandbox on startup and closes it on shutdown."""

    def __init__(self, host: DataplaneHost, runtime: SandboxRuntime, app: Starlette) -> None:
        self.host = host
        self.runtime = runtime
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    rt = self.runtime
                    self.host.register(rt.sandbox_id, rt.generation, SandboxState.ACTIVE, rt)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    with contextlib.suppress(Exception):
                        await self.host.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "http":
            await measured(self.app, scope, receive, send, self.host.metrics)
            return
        await self.app(scope, receive, send)


def create_standalone_app(
    runtime: SandboxRuntime,
    *,
    verifier: TokenVerifier,
    settings: DataplaneSettings | None = None,
    api_key_resolver: ApiKeyResolver | None = None,
) -> Any:
    """A dataplane for one sandbox running where this process runs (``DirectRuntime``).

    Serves both ``/v1/...`` and ``/{sandbox_id}/v1/...``, and its figures at ``/metrics``.
    """
    host = DataplaneHost(verifier=verifier, settings=settings, api_key_resolver=api_key_resolver)
    api = Api(host, default_sandbox=runtime.sandbox_id)

    async def metrics(request: Request) -> Response:
        return Response(host.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app = _app(
        [
            Route("/healthz", _version, methods=["GET"]),
            Route("/__meta/version", _version, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Mount("/v1", routes=_sandbox_routes(api)),
            Mount("/{sandbox_id}/v1", routes=_sandbox_routes(host._api)),
        ]
    )
    return _StandaloneApp(host, runtime, app)


__all__ = ["DataplaneHost", "create_standalone_app"]

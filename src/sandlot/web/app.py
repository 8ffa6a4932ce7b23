"""The web app: sign-in, the workspace routes, health and metrics, wired together.

:func:`create_web_app` builds the Starlette app ``sandlot serve`` mounts beside the broker
(``sandbox`` mode) and ``sandlot web`` serves alone (``local`` mode, or ``sandbox`` mode
against a broker). It only wires:

- the sign-in routes of :class:`~sandlot.web.auth.WebAuth`, and
  :class:`~sandlot.web.auth.BrowserAuthMiddleware` in front of everything;
- the workspace routes (:mod:`sandlot.web.routes`) over one
  :class:`~sandlot.web.gateway.Gateway` whose allowlist is the mode's upstreams (the
  broker's dataplane, or the local folder's loopback dataplane);
- ``extra_routes``: the terminal and agent-stream routes (``/ws/pty``, ``/api/sessions``,
  ``/ws/claude-stream``), built elsewhere; they find what they need with
  :func:`web_context` (the settings, the auth, the gateway, the workspaces) and open a
  request's workspace with :func:`~sandlot.web.workspaces.open_workspace`;
- the workspace page (:mod:`sandlot.web.page`: ``GET /`` and ``/assets/…``), ``/api/healthz``,
  ``/api/readyz`` (each upstream's breaker and the local dataplane's state) and
  ``/api/metrics`` (the gateway's figures and the server's own,
  :mod:`sandlot.web.metrics`, ``sandlot_web_ready`` among them: ``/api/readyz``'s verdict).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from sandlot import __version__
from sandlot.protocol.errors import InvalidRequest, ResourceNotFound, SandlotError
from sandlot.web.allowlist import Upstream
from sandlot.web.auth import (
    BrowserAuthMiddleware,
    KeyAuthenticator,
    LinkStore,
    SessionStore,
    WebAuth,
    sandlot_error_handler,
)
from sandlot.web.gateway import Gateway, GatewaySettings, request_id_of
from sandlot.web.localplane import LocalDataplane
from sandlot.web.metrics import WebMetrics
from sandlot.web.page import Page
from sandlot.web.routes import WorkspaceRoutes, error_json, json_answer
from sandlot.web.settings import ConfigError, WebSettings, WorkspaceMode, served_root
from sandlot.web.workspaces import LocalWorkspaces, SandboxWorkspaces, Workspaces


@dataclass(frozen=True)
class WebContext:
    """What the web app's routes share (``request.app.state.web``)."""

    settings: WebSettings
    auth: WebAuth
    gateway: Gateway
    workspaces: Workspaces


def web_context(conn: HTTPConnection) -> WebContext:
    """The :class:`WebContext` of the web app serving ``conn``."""
    context: WebContext = conn.app.state.web
    return context


def build_workspaces(
    settings: WebSettings,
    *,
    broker_url: str | None,
    dataplane_url: str | None = None,
    own_dataplane: bool = True,
) -> Workspaces:
    """The workspaces of the settings' mode."""
    if settings.mode is WorkspaceMode.LOCAL:
        if not settings.local_users:
            raise ConfigError(
                "local mode needs the users the folder is served to (SANDLOT_WEB_LOCAL_USERS)"
            )
        root = served_root(settings)
        if not root.is_dir():
            raise ConfigError(f"the folder to serve, {root}, is not a directory")
        return LocalWorkspaces(root, settings.local_users, LocalDataplane(root))
    if not broker_url:
        raise ConfigError("sandbox mode needs the broker's URL")
    return SandboxWorkspaces(broker_url, dataplane_url=dataplane_url, own_dataplane=own_dataplane)


def _served(routes: Sequence[BaseRoute], path: str) -> bool:
    return any(isinstance(r, Route | WebSocketRoute) and r.path == path for r in routes)


def create_web_app(
    settings: WebSettings,
    *,
    broker_url: str | None,
    authenticator: KeyAuthenticator | None,
    extra_routes: Sequence[BaseRoute] = (),
    dataplane_url: str | None = None,
    registry: CollectorRegistry | None = None,
    gateway_settings: GatewaySettings | None = None,
    workspaces: Workspaces | None = None,
    own_dataplane: bool = True,
    discover: Callable[[], Awaitable[Iterable[Upstream]]] | None = None,
    sessions: SessionStore | None = None,
    links: LinkStore | None = None,
) -> Starlette:
    """The web app (see the module's docstring).

    ``broker_url``: the broker the ``sandbox`` mode negotiates with (``None`` in ``local``
    mode); ``dataplane_url``: where its grants point, when not ``{broker_url}/dp``;
    ``authenticator`` checks API keys at sign-in (``None``: only one-time links sign in);
    ``registry`` receives the gateway's metrics and the server's own (the broker's
    registry, when mounted beside it); ``own_dataplane=False``: the broker serves no
    dataplane (registered sandbox hosts); ``discover``: the dataplanes of the sandbox
    hosts the gateway may reach besides (:class:`~sandlot.web.gateway.Gateway`);
    ``sessions`` and ``links``: where browser sessions and sign-in links are kept (the
    broker's store, shared by replicas; by default this process's memory).
    """
    if workspaces is None:
        workspaces = build_workspaces(
            settings,
            broker_url=broker_url,
            dataplane_url=dataplane_url,
            own_dataplane=own_dataplane,
        )
    auth = WebAuth(settings, authenticator, sessions=sessions, links=links)
    gateway = Gateway(
        workspaces.upstreams(), gateway_settings, registry=registry, discover=discover
    )
    context = WebContext(settings, auth, gateway, workspaces)
    features = {
        "pty": _served(extra_routes, "/ws/pty"),
        "chat_claude_code": _served(extra_routes, "/ws/claude-stream"),
    }
    web_metrics = WebMetrics.of(gateway.registry)
    workspace_routes = WorkspaceRoutes(settings, gateway, workspaces, features, metrics=web_metrics)

    async def healthz(request: Request) -> Response:
        return json_answer({"status": "ok", "version": __version__}, request_id_of(request.headers))

    def readiness() -> dict[str, Any]:
        state = workspaces.readiness()
        breakers = gateway.states()
        configured = gateway.states(discovered=False).values()
        ready = bool(state.get("ready")) and all(s != "open" for s in configured)
        return {**state, "ready": ready, "gateway": breakers}

    web_metrics.watch_readiness(lambda: bool(readiness()["ready"]))

    async def readyz(request: Request) -> Response:
        body = readiness()
        return json_answer(body, request_id_of(request.headers), 200 if body["ready"] else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await workspaces.start()
        try:
            yield
        finally:
            # The gateway's connections first: the local dataplane then stops at once.
            await gateway.aclose()
            await workspaces.stop()

    async def not_found(request: Request, exc: Exception) -> Response:
        rid = request_id_of(request.headers)
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            response = error_json(InvalidRequest("method not allowed here"), rid)
            response.status_code = 405
            return response
        return error_json(ResourceNotFound("no such route"), rid)

    app = Starlette(
        routes=[
            *auth.routes(),
            *Page().routes(),
            *workspace_routes.routes(),
            Route("/api/healthz", healthz, methods=["GET"]),
            Route("/api/readyz", readyz, methods=["GET"]),
            Route("/api/metrics", metrics, methods=["GET"]),
            *extra_routes,
        ],
        middleware=[Middleware(BrowserAuthMiddleware, auth=auth)],
        exception_handlers={
            SandlotError: sandlot_error_handler,
            404: not_found,
            405: not_found,
        },
        lifespan=lifespan,
    )
    app.state.web = context
    return app


__all__ = ["WebContext", "build_workspaces", "create_web_app", "web_context"]

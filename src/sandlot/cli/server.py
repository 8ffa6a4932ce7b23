"""The embedded default: broker + dataplane + local provider in one process, one port.

The browser workspace (:mod:`sandlot.web`) is served on the same port: ``/``, ``/login``,
``/api/…`` and ``/ws/…`` reach the web app (:class:`WebDispatch`), everything else the
broker (``/v1``, ``/v2``, ``/sandbox``, ``/healthz``, ``/readyz``, ``/metrics``, ``/mcp``,
its OpenAPI pages) or the dataplane (``/dp``). None of the broker's paths starts with
``/api``, ``/ws`` or is ``/`` or ``/login``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.broker.app import MountDispatch, create_app
from sandlot.broker.assembly import build_provider
from sandlot.broker.browsersessions import StoredLinks, StoredSessions
from sandlot.broker.core import Broker, prepare_store
from sandlot.broker.hosts import host_credential
from sandlot.broker.identities import identity
from sandlot.broker.settings import BrokerSettings
from sandlot.cli.draining import GRACEFUL_SHUTDOWN_SECONDS, Drain, DrainingServer
from sandlot.dataplane.http.connections import guarded_http, raise_open_files_limit
from sandlot.dataplane.http.host import DataplaneHost
from sandlot.web.allowlist import Upstream
from sandlot.web.app import create_web_app
from sandlot.web.handshakes import WebSocketProtocol
from sandlot.web.live import live_routes
from sandlot.web.settings import load_web_settings
from sandlot.web.workspaces import dataplane_upstream

if TYPE_CHECKING:
    from sandlot.integrations.mcp import HttpMcp

log = logging.getLogger("sandlot.server")


def build_app(
    settings: BrokerSettings,
    *,
    run_reaper: bool = True,
    dataplane_url: str | None = None,
    provider_secret: str | None = None,
) -> tuple[ASGIApp, Broker]:
    """The whole server as one ASGI app (its lifespan starts and stops the broker).

    The provider's dataplane, if it serves one, is at ``/dp``; its figures are served with
    the broker's at ``/metrics``.

    With ``provider_secret`` the app also exposes its provider to broker worker
    processes (see :mod:`sandlot.providers.remote`). On a server store (PostgreSQL) a
    server that runs sandboxes always exposes it, guarded by its host's credential
    (:func:`sandlot.broker.hosts.host_credential`), and registers it with its host: other
    replicas act on its sandboxes there (resume, suspend, and create when they place
    sandboxes on it, ``hosts.mode = "mixed"``).
    """
    ref: list[Broker] = []
    if dataplane_url:
        # The sandbox host of ``--workers``: its dataplane is on a port of its own, and its
        # host is registered with that address.
        settings = replace(settings, dataplane_url=dataplane_url)
    # With registered sandbox hosts the broker runs no provider of its own.
    provider = (
        None
        if settings.sandbox_hosts == "registered"
        else build_provider(settings, ref, dataplane_url=dataplane_url)
    )
    provider_api = None
    if provider is not None and not settings.resolved_store_url.startswith("sqlite"):
        if provider_secret is None:
            provider_secret = host_credential(settings.data_dir)
        own = dataplane_url or replace(settings, public_url=None).base_url
        provider_api = (settings.host_provider_url or own, provider_secret)
    broker = Broker(settings, provider, run_reaper=run_reaper, provider_api=provider_api)
    ref.append(broker)
    provider = broker.provider
    app = create_app(broker)
    host = getattr(provider, "host", None)
    if isinstance(host, DataplaneHost):
        metrics = app.state.metrics
        host.metrics.attach(metrics.registry, metrics.errors)
    if provider_secret is not None:
        from sandlot.providers.remote import provider_router

        app.include_router(provider_router(provider, provider_secret))

    dataplane = getattr(provider, "app", None)
    served: ASGIApp = MountDispatch(app, {"/dp": dataplane}) if dataplane else app
    own_dataplane = dataplane_url or settings.dataplane_url or settings.base_url
    web = web_app(
        broker,
        settings,
        dataplane_url=f"{own_dataplane.rstrip('/')}/dp",
        own_dataplane=dataplane is not None,
        registry=app.state.metrics.registry,
    )
    served = WebDispatch(served, web)
    mcp = _mcp_app(served, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await broker.start(migrate=True)
        try:
            async with (
                web.router.lifespan_context(web),
                mcp.lifespan() if mcp else contextlib.nullcontext(),
            ):
                yield
        finally:
            await broker.stop()

    app.router.lifespan_context = lifespan
    return (mcp or served), broker


def web_app(
    broker: Broker,
    settings: BrokerSettings,
    *,
    dataplane_url: str,
    own_dataplane: bool,
    registry: CollectorRegistry,
) -> Starlette:
    """The browser workspace served beside ``broker`` (``sandbox`` mode): API keys checked
    by its key service, sessions and sign-in links in its store, terminal ids signed with
    the store's key, so that every process serving it on the store (``--workers``,
    replicas) knows them. ``dataplane_url``: the dataplane the gateway reaches
    (``own_dataplane=False``: none, registered hosts' only)."""
    web_settings = load_web_settings(data_dir=settings.data_dir, public_url=settings.public_url)
    if web_settings.session_token_secret is None:
        # Worker processes and replicas sign terminal session ids with one key: the
        # store's (a browser's next request may reach another one).
        secret = identity(broker.store, "web.session_token_secret", secrets.token_urlsafe(32))
        web_settings = replace(web_settings, session_token_secret=secret)
    return create_web_app(
        web_settings,
        broker_url=settings.base_url,
        extra_routes=live_routes(web_settings),
        authenticator=broker.keys,
        dataplane_url=dataplane_url,
        registry=registry,
        own_dataplane=own_dataplane,
        discover=_host_dataplanes(broker),
        sessions=StoredSessions(
            broker.store,
            idle_seconds=web_settings.session_idle_seconds,
            max_seconds=web_settings.session_max_seconds,
            max_sessions=web_settings.max_sessions,
        ),
        links=StoredLinks(broker.store, ttl_seconds=web_settings.login_link_ttl_seconds),
    )


def _host_dataplanes(broker: Broker) -> Callable[[], Awaitable[list[Upstream]]] | None:
    """The dataplanes of the sandbox hosts in the store, for the web app's gateway: a
    browser's workspace may be on a registered host, or on another replica's embedded
    one. None on SQLite (one machine: this server's own dataplane only)."""
    registry = broker.hosts
    if registry is None:
        return None

    async def discover() -> list[Upstream]:
        records = await anyio.to_thread.run_sync(registry.all)
        return [
            dataplane_upstream(f"host:{r.id}", f"{r.dataplane_url.rstrip('/')}/dp") for r in records
        ]

    return discover


class WebDispatch:
    """``/``, ``/login``, ``/assets/…``, ``/api/…`` and ``/ws/…`` to the web app; the rest to
    ``app``."""

    def __init__(self, app: ASGIApp, web: Starlette) -> None:
        self.app = app
        self.web = web

    @staticmethod
    def is_web(path: str) -> bool:
        return path in ("/", "/login", "/api", "/ws", "/favicon.ico") or path.startswith(
            ("/api/", "/ws/", "/assets/")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            root = scope.get("root_path", "")
            path: str = scope["path"]
            route = path[len(root) :] if root and path.startswith(root) else path
            if self.is_web(route):
                await self.web(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _mcp_app(app: ASGIApp, settings: BrokerSettings) -> HttpMcp | None:
    """``app`` with the MCP server at ``/mcp`` in front (talking to this server's broker
    through the SDK, at its own URL), or ``None`` without the ``mcp`` extra."""
    try:
        from sandlot.integrations.mcp import HttpMcp
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in ("mcp", "mcp_types"):
            return None
        raise
    return HttpMcp(app, settings.base_url)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(settings: BrokerSettings) -> None:
    """Run the embedded server until SIGTERM/SIGINT; prints where it listens."""
    sock = bind_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    settings = replace(settings, port=port)
    prepare_store(settings).dispose()
    app, _broker = build_app(settings)
    server = make_server(app)
    sys.stdout.write(banner(settings))
    sys.stdout.flush()
    run_until_signalled(server, [sock])


def make_server(app: ASGIApp) -> uvicorn.Server:
    """``app`` under uvicorn, with requests in flight answered 503 on shutdown (see
    :mod:`sandlot.cli.draining`)."""
    drain = Drain(app)
    return DrainingServer(uvicorn_config(drain), drain)


def run_until_signalled(server: uvicorn.Server, sockets: list[socket.socket]) -> None:
    """Serve until SIGTERM/SIGINT, shut down gracefully, and exit 0.

    uvicorn re-raises the signal it caught once it has shut down; the no-op
    handlers make that a clean exit instead of death by signal.
    """
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    raise_open_files_limit()
    # What the start-up made (modules, the app) lives as long as the process: out of the
    # collector's way, so that a full collection walks only what requests left behind
    # (it walked everything: pauses of 0.2 to 1 s on a loaded machine).
    gc.freeze()
    server.run(sockets=sockets)


def uvicorn_config(app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        ws_ping_interval=20,
        ws_ping_timeout=20,
        # No permessage-deflate, which browsers offer on every WebSocket: compressing a
        # terminal's output was half of this process's CPU time for each byte of it
        # (docs/BENCHMARKS.md, the workspace page). The SDK's sockets never ask for it.
        ws_per_message_deflate=False,
        # A refused handshake's answer completes it (uvicorn logged an ERROR for each).
        ws=WebSocketProtocol,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_SECONDS),
        lifespan="on",
        # A connection that sends no request head in time is closed (one that sends
        # nothing held a descriptor for good: sandlot.dataplane.http.connections).
        http=guarded_http(),
    )


def banner(settings: BrokerSettings, extra: str = "") -> str:
    return (
        f"sandlot listening on {settings.base_url}\n"
        f"  data directory: {settings.data_dir.absolute()}\n"
        f"  store: {_safe_url(settings.resolved_store_url)}\n"
        f"  provider: {_providers(settings)}\n"
        f"  create an API key: sandlot keys create --user alice --actor human"
        f"{'' if str(settings.data_dir) == '.sandlot' else f' --data-dir {settings.data_dir}'}\n"
        f"{extra}"
    )


def _providers(settings: BrokerSettings) -> str:
    if len(settings.providers) <= 1:
        return f"{settings.provider_name} ({settings.provider_mode})"
    names = [
        f"{name} ({table['kind']}{', default' if name == settings.default_provider else ''})"
        for name, table in settings.providers.items()
    ]
    return ", ".join(names)


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)

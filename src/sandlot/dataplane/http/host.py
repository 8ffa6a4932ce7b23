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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from sandlot.dataplane.http import routes
from sandlot.dataplane.http.app import ROUTES, build_app, measured, sandbox_app
from sandlot.dataplane.http.metrics import DataplaneMetrics
from sandlot.dataplane.services import grepcache, native
from sandlot.dataplane.services.auth import (
    ApiKeyResolver,
    AuthContext,
    Authenticator,
    TokenVerifier,
)
from sandlot.dataplane.services.sandbox import Connection, SandboxEntry
from sandlot.dataplane.services.socketlimits import SocketLimits
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.errors import SandboxNotFound
from sandlot.protocol.states import SandboxState
from sandlot.protocol.templates import SandboxActivity
from sandlot.protocol.tokens import RevokedToken, on_sandbox
from sandlot.runtime.base import SandboxRuntime

if TYPE_CHECKING:
    from sandlot.dataplane.http.websockets import Socket

log = logging.getLogger("sandlot.dataplane")


class DataplaneHost:
    """Serves the dataplane of every sandbox registered with it."""

    def __init__(
        self,
        *,
        verifier: TokenVerifier,
        settings: DataplaneSettings | None = None,
        api_key_resolver: ApiKeyResolver | None = None,
        default_sandbox: str | None = None,
    ) -> None:
        self.verifier = verifier
        #: The sandbox of routes without a ``{sandbox_id}`` (a standalone dataplane's one).
        self.default_sandbox = default_sandbox
        self.settings = settings or DataplaneSettings()
        native.configure(self.settings.native)
        native.warm()  # says at start when the C file operations are unavailable
        grepcache.configure(self.settings.grep_cache)
        self.authenticator = Authenticator(verifier, api_key_resolver)
        self._entries: dict[str, SandboxEntry] = {}
        self.sockets = SocketLimits(
            self.settings.max_websockets_per_token, self.settings.max_websockets_per_sandbox
        )
        self.metrics = DataplaneMetrics(self.sockets, lambda: list(self._entries.values()))
        #: Every sandbox at ``/{sandbox_id}/v1/…`` (mounted at ``/dp`` by the embedded server).
        self.app: Any = sandbox_app(self)

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
        for sandbox_id, entry in self._entries.items():
            for conn in list(entry.connections):
                if conn.jti is not None and (
                    conn.jti in jtis or on_sandbox(conn.jti, sandbox_id) in jtis
                ):
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

    def __init__(
        self, host: DataplaneHost, runtime: SandboxRuntime, app: Starlette, *, announce: bool
    ) -> None:
        self.host = host
        self.runtime = runtime
        self.app = app
        self.announce = announce

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    rt = self.runtime
                    if self.announce:
                        self.host.register(
                            rt.sandbox_id, rt.generation, SandboxState.PROVISIONING, rt
                        )
                        self.host.set_state(rt.sandbox_id, SandboxState.ACTIVE, reason="ready")
                    else:
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
    announce: bool = False,
) -> Any:
    """A dataplane for one sandbox running where this process runs (``DirectRuntime``).

    Serves both ``/v1/...`` and ``/{sandbox_id}/v1/...``, and its figures at ``/metrics``.
    With ``announce`` the sandbox's activation is the first event of its log: a dataplane
    that starts with its sandbox, whose clients wait on that log for it to be active.
    """
    host = DataplaneHost(
        verifier=verifier,
        settings=settings,
        api_key_resolver=api_key_resolver,
        default_sandbox=runtime.sandbox_id,
    )

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(host.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app = build_app(
        host,
        [
            Route("/healthz", routes.version, methods=["GET"]),
            Route("/__meta/version", routes.version, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Mount("/v1", routes=ROUTES),
            Mount("/{sandbox_id}/v1", routes=ROUTES),
        ],
    )
    return _StandaloneApp(host, runtime, app, announce=announce)


__all__ = ["DataplaneHost", "create_standalone_app"]

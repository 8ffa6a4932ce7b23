"""How the terminal and chat routes find what they use: given to their factories, or the
web app's own (:func:`~sandlot.web.app.web_context`).

``create_web_app`` builds its gateway, sign-in and workspaces itself, after the
``extra_routes`` it is given were made; so :func:`~sandlot.web.terminals.terminal_routes`
and :func:`~sandlot.web.chat.chat_routes` may leave them out, and find them at the first
request: the app's gateway and :class:`~sandlot.web.auth.WebAuth`, the workspace a
request names (``?thread=`` or ``?sandbox=``, through
:func:`~sandlot.web.workspaces.open_workspace`), and session ids signed with the key the
app's settings name. One set of routes serves one app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from sandlot.web.app import web_context
from sandlot.web.auth import WebAuth
from sandlot.web.gateway import Gateway
from sandlot.web.metrics import WebMetrics
from sandlot.web.session_tokens import SessionTokens
from sandlot.web.workspace import Workspace
from sandlot.web.workspaces import open_workspace

#: The workspace a request or WebSocket works on.
WorkspaceOf = Callable[[HTTPConnection], Awaitable[Workspace]]


@dataclass(frozen=True)
class Bound:
    """What the routes use, once found."""

    gateway: Gateway
    auth: WebAuth
    tokens: SessionTokens
    workspace_of: WorkspaceOf


class Deps:
    """What the terminal and chat routes use: what their factory was given, the rest the
    app's own, found at the first request (:meth:`bind`)."""

    def __init__(
        self,
        *,
        gateway: Gateway | None,
        auth: WebAuth | None,
        tokens: SessionTokens | None,
        workspace_of: WorkspaceOf | None,
    ) -> None:
        self._given = (gateway, auth, tokens, workspace_of)
        self._bound: Bound | None = None
        if gateway and auth and tokens and workspace_of:
            self._bound = Bound(gateway, auth, tokens, workspace_of)

    def bind(self, conn: HTTPConnection) -> Bound:
        if self._bound is not None:
            return self._bound
        context = web_context(conn)
        gateway, auth, tokens, workspace_of = self._given
        if workspace_of is None:
            workspaces = context.workspaces

            async def workspace_of(c: HTTPConnection) -> Workspace:
                return await open_workspace(c, workspaces)

        self._bound = Bound(
            gateway or context.gateway,
            auth or context.auth,
            tokens or SessionTokens.from_settings(context.settings),
            workspace_of,
        )
        return self._bound

    @property
    def bound(self) -> Bound:
        if self._bound is None:
            raise RuntimeError("the routes' dependencies are found at the first request")
        return self._bound


class UsesDeps:
    """Routes whose gateway, auth, session ids and workspaces come from :class:`Deps`
    (and their metrics from the gateway's registry)."""

    deps: Deps

    @property
    def gateway(self) -> Gateway:
        return self.deps.bound.gateway

    @property
    def auth(self) -> WebAuth:
        return self.deps.bound.auth

    @property
    def tokens(self) -> SessionTokens:
        return self.deps.bound.tokens

    @property
    def workspace_of(self) -> WorkspaceOf:
        return self.deps.bound.workspace_of

    @property
    def metrics(self) -> WebMetrics:
        """The web server's figures, in its gateway's registry."""
        return WebMetrics.of(self.gateway.registry)

"""Opening a signed-in user's workspace, in both modes.

- :class:`SandboxWorkspaces` (``sandbox`` mode): a workspace is a thread's sandbox
  (``?thread=thr_1``) or a sandbox by id (``?sandbox=sb_1``). The server negotiates the
  grant with the broker *for* the user, with the credential held in the user's browser
  session (the SDK's :class:`~sandlot.sdk.AsyncSandlot`: ``get`` for a thread, ``ensure``
  when it is created, ``attach_sandbox`` for a sandbox). Opening a workspace never creates
  one: only ``POST /api/v1/workspace?thread=`` does (``create=True``), a state-changing
  request the CSRF check guards, so that no link or cross-site navigation can make
  sandboxes in a visitor's account. One client per (user, credential), its grants cached
  per workspace by the SDK; a token is refreshed once less than a third of its lifetime
  is left, before it is handed out. The broker decides who may open what (a user's own
  threads and sandboxes, and scopes shared with them); its refusals reach the browser as
  ``403 FORBIDDEN`` or ``404 NOT_FOUND``, with messages of this server's own.
- :class:`LocalWorkspaces` (``local`` mode): the one folder, served by the web server's
  own dataplane (:mod:`sandlot.web.localplane`), to the users it is configured for.

Either way the routes get a :class:`~sandlot.web.workspace.Workspace` and reach its
dataplane through the gateway, with the upstreams :meth:`upstreams` names.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import HTTPConnection

from sandlot.protocol.errors import (
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ProviderUnavailable,
    QuotaExceeded,
    RateLimited,
    ResourceNotFound,
    SandboxStarting,
    SandlotError,
    SessionNotFound,
    Unauthenticated,
)
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.web.allowlist import Upstream
from sandlot.web.auth import BrowserSession, current_user
from sandlot.web.localplane import LocalDataplane
from sandlot.web.settings import WorkspaceMode
from sandlot.web.workspace import Dataplane, Workspace

log = logging.getLogger("sandlot.web.workspaces")

#: What a thread or sandbox id may look like (the broker's own rule for names, minus
#: the characters no id uses).
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}$")
#: A grant's token is refreshed once less than this share of its lifetime is left.
RENEW_FRACTION = 1 / 3


class Workspaces(Protocol):
    """Where a mode's workspaces come from (see the module's docstring)."""

    mode: WorkspaceMode

    def upstreams(self) -> list[Upstream]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def readiness(self) -> dict[str, Any]:
        """``{"ready": bool, …}`` for ``/readyz``."""
        ...

    async def open(
        self,
        session: BrowserSession,
        *,
        thread: str | None,
        sandbox: str | None,
        create: bool = False,
    ) -> Workspace:
        """The workspace named; a thread's sandbox is created only with ``create``."""
        ...

    async def listing(self, session: BrowserSession) -> list[dict[str, Any]]:
        """The workspaces the user may open (``GET /api/v1/workspaces``)."""
        ...


async def open_workspace(
    conn: HTTPConnection, workspaces: Workspaces, *, create: bool = False
) -> Workspace:
    """The workspace a request or WebSocket names (``?thread=`` or ``?sandbox=``), for its
    signed-in user (401 without one); created only with ``create``."""
    session = current_user(conn)
    return await workspaces.open(
        session,
        thread=conn.query_params.get("thread") or None,
        sandbox=conn.query_params.get("sandbox") or None,
        create=create,
    )


# --- sandbox mode ---------------------------------------------------------------------


def broker_error(exc: BaseException, workspace: str, *, thread: bool = False) -> SandlotError:
    """What the browser is told when the broker refuses or fails to open a workspace
    (``thread``: the workspace is a thread's, which ``POST /api/v1/workspace`` creates)."""
    if thread and isinstance(exc, SessionNotFound):
        return ResourceNotFound(
            "this thread has no sandbox yet: create it (POST /api/v1/workspace?thread=…)",
            metadata={"workspace": workspace, "creatable": True},
        )
    if isinstance(exc, Unauthenticated):
        return Unauthenticated("the API key of this sign-in is no longer valid: sign in again")
    if isinstance(exc, Forbidden):
        return Forbidden(
            "this workspace is not yours, or not shared with you",
            metadata={"workspace": workspace},
        )
    if isinstance(exc, NotFound):
        return ResourceNotFound("no such workspace", metadata={"workspace": workspace})
    if isinstance(exc, RateLimited | QuotaExceeded | SandboxStarting | InvalidRequest):
        return type(exc)(exc.message, retry_after=exc.retry_after, code=exc.wire_code)
    if isinstance(exc, PayloadTooLarge):
        return InvalidRequest("the broker refused the request")
    return ProviderUnavailable(
        "the broker cannot open this workspace now", metadata={"reason": "broker"}
    )


@dataclass
class _Client:
    client: AsyncSandlot
    used_at: float


class SandboxWorkspace:
    """A thread's sandbox, or a sandbox by id, opened for one user."""

    def __init__(
        self,
        workspace_id: str,
        open_sandbox: Callable[[], Awaitable[AsyncSandbox]],
        *,
        thread: bool = False,
    ):
        self._id = workspace_id
        self._open = open_sandbox
        self._thread = thread

    @property
    def id(self) -> str:
        return self._id

    async def _sandbox(self) -> AsyncSandbox:
        try:
            return await self._open()
        except (SandlotError, OSError) as exc:
            if not isinstance(exc, SandlotError) or exc.status >= 500 or exc.status == 0:
                log.warning("opening workspace %s failed: %r", self._id, exc)
            raise broker_error(exc, self._id, thread=self._thread) from None

    async def _renew(self, sandbox: AsyncSandbox) -> None:
        renew = sandbox.renew
        if renew is None:
            return
        try:
            await renew()
        except (SandlotError, OSError) as exc:
            raise broker_error(exc, self._id) from None

    async def dataplane(self) -> Dataplane:
        sandbox = await self._sandbox()
        grant = sandbox.grant
        ttl = grant.token_ttl_seconds or 900.0
        if grant.seconds_left() < ttl * RENEW_FRACTION:
            await self._renew(sandbox)
        return _dataplane_of(sandbox)

    async def renewed(self) -> Dataplane:
        sandbox = await self._sandbox()
        await self._renew(sandbox)
        return _dataplane_of(sandbox)


def _dataplane_of(sandbox: AsyncSandbox) -> Dataplane:
    grant = sandbox.grant
    return Dataplane(
        sandbox_id=grant.sandbox_id,
        http_base_url=grant.http_base_url,
        ws_base_url=grant.ws_base_url,
        token=grant.token,
        capabilities=frozenset(grant.capabilities),
    )


def _checked_id(value: str, what: str) -> str:
    if not _ID.match(value):
        raise InvalidRequest(f"{what} is not a valid id")
    return value


def dataplane_upstream(name: str, dataplane_url: str) -> Upstream:
    """The gateway's upstream for the dataplane at ``dataplane_url`` (``…/dp``): calls may
    address the paths under it."""
    base = dataplane_url.rstrip("/")
    path = base.split("://", 1)[-1].partition("/")[2]
    prefix = f"/{path}/" if path else "/"
    return Upstream(name, base, (prefix,))


class SandboxWorkspaces:
    """Sandboxes negotiated with the broker at ``broker_url`` for each signed-in user.

    ``dataplane_url`` is where the broker's grants point (its ``/dp`` mount, or the
    sandbox host's with several workers): the only upstream configured for the gateway;
    ``own_dataplane=False`` for a broker that serves none (its sandboxes are on registered
    hosts, whose dataplanes the gateway discovers: :func:`dataplane_upstream`).
    Clients unused for ``idle_seconds`` are closed (their leases left to expire); at most
    ``max_clients`` are kept.
    """

    mode = WorkspaceMode.SANDBOX

    def __init__(
        self,
        broker_url: str,
        *,
        dataplane_url: str | None = None,
        own_dataplane: bool = True,
        timeout: float = 30.0,
        idle_seconds: float = 3600.0,
        max_clients: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker_url = broker_url.rstrip("/")
        self.dataplane_url = (dataplane_url or f"{self.broker_url}/dp").rstrip("/")
        self.own_dataplane = own_dataplane
        self.timeout = timeout
        self.idle_seconds = idle_seconds
        self.max_clients = max_clients
        self._clock = clock
        self._clients: OrderedDict[tuple[str, str], _Client] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def upstreams(self) -> list[Upstream]:
        if not self.own_dataplane:
            return []
        return [dataplane_upstream("dataplane", self.dataplane_url)]

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        clients = list(self._clients.values())
        self._clients.clear()
        for entry in clients:
            await entry.client.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def readiness(self) -> dict[str, Any]:
        return {"ready": True, "mode": self.mode.value, "clients": len(self._clients)}

    def _client(self, session: BrowserSession) -> AsyncSandlot:
        credential = session.credential
        if credential is None:
            raise Unauthenticated(
                "this sign-in carries no API key to open sandboxes with: sign in with one"
            )
        key = (session.user_id, hashlib.sha256(credential.encode()).hexdigest())
        now = self._clock()
        for old_key in [k for k, c in self._clients.items() if now - c.used_at > self.idle_seconds]:
            self._retire(old_key)
        entry = self._clients.get(key)
        if entry is None:
            while len(self._clients) >= self.max_clients:
                self._retire(next(iter(self._clients)))
            client = AsyncSandlot(
                self.broker_url, credential, timeout=self.timeout, auto_refresh=False
            )
            entry = self._clients[key] = _Client(client, now)
        entry.used_at = now
        self._clients.move_to_end(key)
        return entry.client

    def _retire(self, key: tuple[str, str]) -> None:
        entry = self._clients.pop(key, None)
        if entry is None:
            return
        task = asyncio.get_running_loop().create_task(entry.client.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def open(
        self,
        session: BrowserSession,
        *,
        thread: str | None,
        sandbox: str | None,
        create: bool = False,
    ) -> Workspace:
        if (thread is None) == (sandbox is None):
            raise InvalidRequest(
                "name the workspace: ?thread=THREAD_ID or ?sandbox=SANDBOX_ID (one of the two)"
            )
        client = self._client(session)
        if thread is not None:
            thread_id = _checked_id(thread, "thread")
            # A thread's existing sandbox is attached to (``get``); ``ensure`` makes one.
            # The grant is cached per thread by the SDK either way.
            negotiate = client.ensure if create else client.get
            return SandboxWorkspace(thread_id, lambda: negotiate(thread_id), thread=True)
        assert sandbox is not None
        sandbox_id = _checked_id(sandbox, "sandbox")
        return SandboxWorkspace(sandbox_id, lambda: client.attach_sandbox(sandbox_id))

    async def listing(self, session: BrowserSession) -> list[dict[str, Any]]:
        """The user's live sandboxes as the broker lists them, a thread's named by its
        thread (the broker's scope ``thread:ID``)."""
        client = self._client(session)
        try:
            sandboxes = await client.list_sandboxes()
        except (SandlotError, OSError) as exc:
            raise broker_error(exc, "*") from None
        entries = []
        for box in sandboxes:
            scope = box.scope or ""
            thread = scope.removeprefix("thread:") if scope.startswith("thread:") else None
            entries.append(
                {
                    "id": thread or box.id,
                    "thread": thread,
                    "sandbox": box.id,
                    "name": box.name,
                    "state": box.state,
                    "template": box.template,
                    "created_at": box.created_at,
                    # The broker does not say who holds a sandbox's leases.
                    "attached": None,
                }
            )
        return entries


# --- local mode -----------------------------------------------------------------------


class LocalWorkspace:
    """The local folder, as one user works on it."""

    def __init__(self, plane: LocalDataplane, user_id: str) -> None:
        self._plane = plane
        self._user = user_id

    @property
    def id(self) -> str:
        return "local"

    async def dataplane(self) -> Dataplane:
        return self._plane.dataplane(self._user)

    async def renewed(self) -> Dataplane:
        return self._plane.dataplane(self._user, fresh=True)


class LocalWorkspaces:
    """The folder ``root``, for the users in ``users`` (anyone else: 403).

    ``?thread=`` and ``?sandbox=`` are ignored: there is one workspace.
    """

    mode = WorkspaceMode.LOCAL

    def __init__(self, root: Path, users: frozenset[str], plane: LocalDataplane | None = None):
        if not users:
            raise ValueError("local mode needs the users the folder is served to")
        self.users = users
        self.plane = plane or LocalDataplane(root)

    @property
    def root(self) -> Path:
        return self.plane.root

    def upstreams(self) -> list[Upstream]:
        return [self.plane.upstream()]

    async def start(self) -> None:
        await self.plane.start()

    async def stop(self) -> None:
        await self.plane.stop()

    def readiness(self) -> dict[str, Any]:
        state = self.plane.state
        return {
            "ready": state.value == "running",
            "mode": self.mode.value,
            "local_dataplane": state.value,
        }

    async def open(
        self,
        session: BrowserSession,
        *,
        thread: str | None,
        sandbox: str | None,
        create: bool = False,
    ) -> Workspace:
        del thread, sandbox, create
        if session.user_id not in self.users:
            raise Forbidden("this folder is not served to you")
        return LocalWorkspace(self.plane, session.user_id)

    async def listing(self, session: BrowserSession) -> list[dict[str, Any]]:
        """The one folder (its name only, never where it lies)."""
        if session.user_id not in self.users:
            raise Forbidden("this folder is not served to you")
        running = self.plane.state.value == "running"
        return [
            {
                "id": "local",
                "thread": None,
                "sandbox": None,
                "name": self.root.name or "/",
                "state": "active" if running else self.plane.state.value,
                "template": "local",
                "created_at": None,
                "attached": None,
            }
        ]

"""Sandlot inside a LangGraph server: the control plane, the dataplane and the MCP server
on the server's own port, its users as sandlot's, its threads' lifecycle as the sandboxes'.

``langgraph.json``::

    {"graphs": {"agent": "./graph.py:agent"},
     "auth": {"path": "./auth.py:auth"},
     "http": {"app": "./webapp.py:app", "enable_custom_route_auth": true}}

``webapp.py``::

    from sandlot.integrations.langgraph import create_app
    app = create_app()

What a request meets (docs/INTEGRATIONS.md, "LangGraph"):

- ``/dp/…`` (the dataplane) goes straight to it: it checks sandlot's own tokens.
- ``/sandlot/mcp`` is sandlot's MCP server (LangGraph's own stays at ``/mcp``).
- The control plane (``/v1/…``, the aliases ``/sandbox/…``, ``/v2/sandboxes/…``) with a
  sandlot API key (``sl_…``) goes straight to the broker; with anything else it passes
  the LangGraph server's auth, and the LangGraph user is the sandlot user
  (:data:`PERMISSIONS` maps its permissions to an actor type).
- A thread-scoped session is refused (403) unless the caller may see the thread in this
  LangGraph server: a LangGraph user is checked through the server's own threads
  operation with the auth context its auth gave the request (its ``@auth.on`` filters
  apply); a sandlot key's user must be the thread's ``metadata.owner`` when the thread
  has one.
- ``DELETE /threads/{id}`` that succeeds ends the thread's sandbox at once; a pass every
  ``reconcile_seconds`` ends the sandboxes of threads deleted otherwise (TTL, prune, or
  while sandlot was down) and of runs that ended (``run`` scopes named ``THREAD/RUN``).

Graphs the server runs need no configuration: :class:`~sandlot.integrations.deepagents.
SandlotBackend` ``.from_run()`` uses a service key each server process makes at start
(kept in its memory, revoked at its stop), acting for the run's LangGraph user.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import anyio
import httpx
from fastapi import Request
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.broker.app import MountDispatch
from sandlot.broker.app import create_app as create_broker_app
from sandlot.broker.assembly import build_provider
from sandlot.broker.core import Broker
from sandlot.broker.hosted import end_scopes, live_scopes
from sandlot.broker.keys import looks_like_key
from sandlot.broker.principals import Principal
from sandlot.broker.settings import BrokerSettings, load_settings
from sandlot.dataplane.http.host import DataplaneHost
from sandlot.protocol.common import PrincipalType, ScopeType
from sandlot.protocol.common import Scope as SandlotScope
from sandlot.protocol.errors import (
    Forbidden,
    InvalidRequest,
    ProviderUnavailable,
    Unauthenticated,
)
from sandlot.sdk.settings import ClientSettings, register_in_process

log = logging.getLogger("sandlot.integrations.langgraph")

#: The control plane's paths (PROTOCOL.md section 2 and its aliases, 2.9).
CONTROL_PATHS = (
    "/v1/",
    "/v2/sandboxes",
    "/sandbox/",
    "/.well-known/jwks.json",
    "/healthz",
    "/readyz",
)
MCP_PATH = "/sandlot/mcp"
#: A LangGraph user's permission (``"permissions"`` of the auth handler's answer) → the
#: principal type it authenticates as; a user with none of them is a human.
PERMISSIONS = {"sandlot:agent": PrincipalType.AGENT, "sandlot:service": PrincipalType.SERVICE}
#: The permission that makes a LangGraph user a sandlot admin.
ADMIN_PERMISSION = "sandlot:admin"
#: The service key the server's own graphs use (one at a time; revoked at stop).
RUNTIME_USER, RUNTIME_PRINCIPAL, RUNTIME_KEY_NAME = "langgraph", "langgraph-runs", "langgraph runs"
#: The user LangGraph puts on requests it lets in as LangGraph Studio's.
STUDIO_IDENTITY = "langgraph-studio-user"
#: Run states after which a run's sandbox ends.
LIVE_RUN_STATES = frozenset({"pending", "running"})
_THREAD_PATH = re.compile(r"^/threads/([^/]+)/?$")


@dataclass(frozen=True)
class _Caller:
    """A control-plane request that passed the LangGraph server's auth: the user and the
    permissions its auth handler returned (``scope["user"]``, ``scope["auth"]``)."""

    user: Any
    permissions: tuple[str, ...]


_caller: ContextVar[_Caller | None] = ContextVar("sandlot_langgraph_caller", default=None)


def create_app(
    settings: BrokerSettings | None = None, *, reconcile_seconds: float = 10.0
) -> Starlette:
    """The app for ``langgraph.json``'s ``http.app``.

    ``settings`` default to :func:`sandlot.broker.settings.load_settings` (``SANDLOT_*``
    variables, ``SANDLOT_CONFIG``), with the public URL the LangGraph server's own
    (``LANGGRAPH_API_URL``, which ``langgraph dev`` sets) unless ``SANDLOT_PUBLIC_URL``
    names another.
    """
    return SandlotInLangGraph(settings, reconcile_seconds=reconcile_seconds).app


def default_settings() -> BrokerSettings:
    """``SANDLOT_*`` settings; the public URL defaults to the LangGraph server's."""
    return load_settings(hosted_url_var="LANGGRAPH_API_URL", hosted_url="http://127.0.0.1:2024")


class SandlotInLangGraph:
    """The broker, its provider's dataplane and the MCP server, assembled for a LangGraph
    server (see the module's documentation); :attr:`app` is what it serves."""

    def __init__(
        self, settings: BrokerSettings | None = None, *, reconcile_seconds: float = 10.0
    ) -> None:
        self.settings = settings = settings or default_settings()
        self.reconcile_seconds = reconcile_seconds
        ref: list[Broker] = []
        provider = build_provider(settings, ref)
        self.broker = broker = Broker(settings, provider)
        ref.append(broker)
        self.api = create_broker_app(broker)
        self.api.state.principal_of = self.principal_of
        broker.sessions.scope_guard = self.check_scope
        host = getattr(provider, "host", None)
        if isinstance(host, DataplaneHost):
            metrics = self.api.state.metrics
            host.metrics.attach(metrics.registry, metrics.errors)
        self.dataplane: ASGIApp | None = getattr(provider, "app", None)
        self.mcp = _mcp(settings.base_url)
        #: The LangGraph server's app, as its first request met it.
        self.langgraph: ASGIApp | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.app = Starlette(
            routes=[_Paths(CONTROL_PATHS, _WithCaller(self.api, self))],
            middleware=[Middleware(_Gateway, sandlot=self)],
            lifespan=self.lifespan,
        )

    # --- lifespan --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        await self.broker.start(migrate=True)
        key_id = await anyio.to_thread.run_sync(self._runtime_key)
        try:
            async with self.mcp.lifespan() if self.mcp else contextlib.nullcontext():
                reconciler = asyncio.get_running_loop().create_task(self._reconcile_forever())
                try:
                    yield
                finally:
                    reconciler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reconciler
        finally:
            register_in_process(None)
            await anyio.to_thread.run_sync(self._revoke_runtime_key, key_id)
            for task in list(self.tasks):
                task.cancel()
            await self.broker.stop()

    def _runtime_key(self) -> str:
        """A fresh service key for the server's graphs, registered in this process only.

        Each process of the server makes its own and revokes it at stop (other processes'
        keys are theirs: several may share one store). One left by a process that died is
        unusable (its secret was only ever in that process's memory) and is listed by
        ``sandlot keys list`` under user ``langgraph`` until revoked.
        """
        secret, info = self.broker.keys.create(
            user_id=RUNTIME_USER,
            principal_type=PrincipalType.SERVICE,
            principal_id=RUNTIME_PRINCIPAL,
            name=RUNTIME_KEY_NAME,
        )
        register_in_process(ClientSettings(url=self.settings.base_url, api_key=secret))
        return info.id

    def _revoke_runtime_key(self, key_id: str) -> None:
        self.broker.keys.revoke(key_id)

    # --- who calls ---------------------------------------------------------------------

    async def principal_of(self, request: Request) -> Principal | None:
        """The LangGraph user the server's auth put on the request, if any."""
        user = request.scope.get("user")
        identity = getattr(user, "identity", None) if user is not None else None
        if not identity:
            return None
        identity = str(identity)
        if identity == STUDIO_IDENTITY or getattr(user, "kind", None) == "StudioUser":
            # LangGraph lets a request that says it comes from Studio (``X-Auth-Scheme:
            # langsmith``) past the auth handler as this one user, which ``langgraph dev``
            # checks nothing of: anyone reaching the port would be every thread's owner.
            raise Forbidden(
                "LangGraph Studio's user is not a sandlot user: call with your own "
                "credentials (those the server's auth handler takes)"
            )
        if len(identity) > 180 or any(ord(c) < 0x20 or c == "\x7f" for c in identity):
            raise Unauthenticated("the LangGraph user's identity is not a usable sandlot user id")
        if request.headers.get("x-sandlot-on-behalf-of"):
            raise Forbidden("acting on behalf of a user takes a sandlot service key")
        auth = request.scope.get("auth")
        permissions = set(getattr(auth, "scopes", None) or ())
        kind = next((t for p, t in PERMISSIONS.items() if p in permissions), PrincipalType.HUMAN)
        return Principal(
            type=kind,
            id=f"langgraph:{identity}",
            user_id=identity,
            key_id=None,
            is_admin=ADMIN_PERMISSION in permissions or identity in self.settings.admins,
        )

    async def check_scope(self, principal: Principal, scope: SandlotScope) -> None:
        """Refuse a thread (or run) the caller may not see in this LangGraph server."""
        if scope.type not in (ScopeType.THREAD, ScopeType.RUN):
            return
        thread_id = scope.id
        if scope.type is ScopeType.RUN:
            thread_id, slash, run_id = scope.id.partition("/")
            if not slash or not thread_id or not run_id:
                raise InvalidRequest(
                    "in a LangGraph server a run scope's id is THREAD_ID/RUN_ID",
                    metadata={"scope": scope.key()},
                )
        caller = _caller.get()
        if caller is not None and principal.key_id is None:
            visible = await self._visible_to(caller, thread_id)
        else:
            visible = await self._owned_by(principal, thread_id)
        if not visible:
            raise Forbidden(
                f"no thread {thread_id} that you may see in this LangGraph server",
                metadata={"thread_id": thread_id},
            )

    async def _visible_to(self, caller: _Caller, thread_id: str) -> bool:
        """Whether the LangGraph server shows the thread to the caller: the threads
        operation its own ``GET /threads/{id}`` runs, in process, with the caller's auth
        context (its auth handlers and their filters apply; its HTTP stack is not
        passed a second time)."""
        return await _read_thread(thread_id, caller.user, caller.permissions)

    async def _owned_by(self, principal: Principal, thread_id: str) -> bool:
        """For a sandlot key: the thread exists, and is the user's if it names an owner."""
        thread = await self._thread(thread_id)
        if thread is None:
            return False
        owner = (thread.get("metadata") or {}).get("owner")
        return principal.is_admin or owner is None or owner == principal.effective_user

    async def _thread(self, thread_id: str) -> dict[str, Any] | None:
        """The thread as the server itself sees it (no user's auth), or ``None``.

        In process: the threads operation of its ``GET /threads/{id}`` with no auth
        context, its fields decrypted as that route does. Should the thread's metadata
        not read as a plain mapping there (a runtime that hands out raw JSON), it is
        asked as the LangGraph SDK's own loopback client asks (``root_path``
        ``/noauth``, which only an in-process caller can set); before the server has
        met its first request, through that client.
        """
        server = self.langgraph
        if server is None:
            return await _thread(thread_id)
        with contextlib.suppress(_Unreadable):
            return await _server_thread(thread_id)
        status, body = await _asgi_get(
            server, f"/threads/{quote(thread_id, safe='')}", [], root_path="/noauth"
        )
        if status in (404, 422):
            return None
        if status != 200:
            raise ProviderUnavailable("the LangGraph server could not look the thread up; retry")
        found: dict[str, Any] = json.loads(body)
        return found

    # --- lifecycle ---------------------------------------------------------------------

    def thread_deleted(self, thread_id: str) -> None:
        """End the sandbox of a thread the server just deleted (in the background)."""
        task = asyncio.get_running_loop().create_task(self._end_thread(thread_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _end_thread(self, thread_id: str) -> None:
        try:
            runs = await anyio.to_thread.run_sync(live_scopes, self.broker.store, ScopeType.RUN)
            keys = [f"thread:{thread_id}"]
            keys += [f"run:{r}" for r in runs if r.partition("/")[0] == thread_id]
            await self._end(keys, "its LangGraph thread was deleted")
        except Exception:
            log.exception("ending the sandbox of deleted thread %s failed", thread_id)

    async def _end(self, keys: Iterable[str], reason: str) -> None:
        ended = await end_scopes(self.broker.sandboxes, self.broker.store, keys, reason)
        for sandbox_id in ended:
            log.info("sandbox %s ends: %s", sandbox_id, reason)

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconciling sandboxes with LangGraph's threads failed")
            await asyncio.sleep(self.reconcile_seconds)

    async def reconcile(self) -> None:
        """End the sandboxes of threads that no longer exist and of runs that ended.

        One search per 100 threads answers both: a thread missing ends its sandbox and
        its runs'; a thread that is not ``busy`` has no pending or running run (LangGraph
        marks a thread busy when a run is created on it). Only the runs of busy threads
        are looked up one by one."""
        store = self.broker.store
        threads = await anyio.to_thread.run_sync(live_scopes, store, ScopeType.THREAD)
        runs = await anyio.to_thread.run_sync(live_scopes, store, ScopeType.RUN)
        run_ids = [(key.partition("/")[0], key.partition("/")[2]) for key in runs]
        run_ids = [(t, r) for t, r in run_ids if _is_uuid(t) and _is_uuid(r)]
        ids = sorted({t for t in threads if _is_uuid(t)} | {t for t, _ in run_ids})
        status: dict[str, str] = {}
        for start in range(0, len(ids), 100):
            status.update(await _search_threads(ids[start : start + 100]))
        gone = [f"thread:{t}" for t in threads if _is_uuid(t) and t not in status]
        await self._end(gone, "its LangGraph thread no longer exists")
        ended = []
        for thread_id, run_id in run_ids:
            busy = status.get(thread_id) == "busy"
            if busy and await _run_status(thread_id, run_id) in LIVE_RUN_STATES:
                continue
            ended.append(f"run:{thread_id}/{run_id}")
        await self._end(ended, "its LangGraph run ended")


class _Paths(BaseRoute):
    """One route for every path under the given prefixes (the control plane's): the
    LangGraph server applies its auth to it as to any custom route."""

    def __init__(self, prefixes: tuple[str, ...], app: ASGIApp) -> None:
        self.prefixes = prefixes
        self.app = app

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and _under(scope["path"], self.prefixes):
            return Match.FULL, {}
        return Match.NONE, {}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class _WithCaller:
    """Remembers, for the request it passes on, the LangGraph user its auth found."""

    def __init__(self, app: ASGIApp, sandlot: SandlotInLangGraph) -> None:
        self.app = app
        self.sandlot = sandlot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        auth = scope.get("auth")
        permissions = tuple(str(p) for p in getattr(auth, "scopes", None) or ())
        user = scope.get("user")
        token = _caller.set(_Caller(user, permissions) if user is not None else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _caller.reset(token)


class _Gateway:
    """The app's middleware, in front of every route of the LangGraph server."""

    def __init__(self, app: ASGIApp, sandlot: SandlotInLangGraph) -> None:
        self.sandlot = sandlot
        self.app = app
        dataplane = sandlot.dataplane
        self.route: ASGIApp = (
            MountDispatch(self._rest, {"/dp": dataplane}) if dataplane else self._rest
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self.sandlot.langgraph is None and "app" in scope:
            self.sandlot.langgraph = scope["app"]
        await self.route(scope, receive, send)

    async def _rest(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        mcp = self.sandlot.mcp
        if mcp is not None and scope["type"] == "http" and path.rstrip("/") == MCP_PATH:
            await mcp.mcp_app(scope, receive, send)
            return
        if _under(path, CONTROL_PATHS) and _carries_key(scope):
            # A sandlot key: the broker checks it; the LangGraph server's auth would not.
            await self.sandlot.api(scope, receive, send)
            return
        deleted = _THREAD_PATH.match(path) if scope.get("method") == "DELETE" else None
        if deleted is None:
            await self.app(scope, receive, send)
            return
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        if 200 <= status < 300:
            self.sandlot.thread_deleted(deleted.group(1))


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path.startswith(p) or path == p.rstrip("/") for p in prefixes)


def _carries_key(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, raw = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and looks_like_key(raw)
        if name == b"x-api-key":
            return looks_like_key(value.decode("latin-1"))
    return False


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _mcp(url: str) -> Any:
    try:
        from sandlot.integrations.mcp import HttpMcp
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in ("mcp", "mcp_types"):
            return None
        raise

    async def unused(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("the MCP server is reached through the gateway only")

    return HttpMcp(unused, url, path=MCP_PATH)


# --- the LangGraph server's own view (in process, as its loopback client sees it) ------


async def _asgi_get(
    app: ASGIApp, path: str, headers: list[tuple[bytes, bytes]], *, root_path: str = ""
) -> tuple[int, bytes]:
    """``GET path`` on ``app`` in process, as a request from outside would be (its
    middleware and auth included): the status and the body."""
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": root_path,
        "query_string": b"",
        "headers": [(b"host", b"langgraph"), *headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    status = 0
    body: list[bytes] = []
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if asked:
            await asyncio.Event().wait()  # the client never goes away mid-request
        asked = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(body)


def _threads_api() -> Any:
    """The module of the LangGraph server's threads API: its runtime's ``Threads`` and
    ``connect``, and how its routes decrypt a thread."""
    return importlib.import_module("langgraph_api.api.threads")


def _unless_not_found(exc: Exception) -> None:
    """Pass a threads operation's error meaning "no such thread for this caller" (its
    routes answer 404, or the caller's auth handler refused); raise any other as the
    server not answering."""
    from starlette.exceptions import HTTPException

    if isinstance(exc, HTTPException) and exc.status_code in (401, 403, 404, 422):
        return
    raise ProviderUnavailable("the LangGraph server could not look the thread up") from exc


async def _read_thread(thread_id: str, user: Any, permissions: tuple[str, ...]) -> bool:
    """Whether ``Threads.get`` of the LangGraph server's threads API finds the thread for
    this user: its auth handlers run for ``threads``/``read`` and their filters apply."""
    from langgraph_sdk import Auth

    try:
        thread_uuid = uuid.UUID(thread_id)
    except ValueError:
        return False  # LangGraph's thread ids are UUIDs: no such thread
    ctx = Auth.types.BaseAuthContext(permissions=list(permissions), user=user)
    api = _threads_api()
    try:
        async with api.connect() as conn:
            async for _ in await api.Threads.get(conn, thread_uuid, ctx=ctx):
                return True
    except Exception as exc:
        _unless_not_found(exc)
    return False


class _Unreadable(Exception):
    """The thread's metadata did not read as a plain mapping in process."""


async def _server_thread(thread_id: str) -> dict[str, Any] | None:
    """The thread as ``GET /threads/{id}`` finds it with no user (the server's own view),
    in process, or ``None``; :class:`_Unreadable` if its metadata is not a mapping."""
    try:
        thread_uuid = uuid.UUID(thread_id)
    except ValueError:
        return None
    api = _threads_api()
    # No user's auth context: the handlers and their filters are not applied.
    auth_context = importlib.import_module("langgraph_api.utils").AuthContext
    token = auth_context.set(None)
    try:
        async with api.connect() as conn:
            rows = await api.Threads.get(conn, thread_uuid)
            row = await anext(aiter(rows), None)
        if row is None:
            return None
        thread = await api.decrypt_response(
            row,
            "thread",
            api.THREAD_ENCRYPTION_FIELDS,
            plaintext_from_core=api.IS_POSTGRES_OR_GRPC_BACKEND and api.using_custom_encryption(),
        )
    except Exception as exc:
        _unless_not_found(exc)
        return None
    finally:
        auth_context.reset(token)
    metadata = thread.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise _Unreadable(thread_id)
    return {"thread_id": str(thread.get("thread_id")), "metadata": dict(metadata or {})}


_loopback: Any = None


def _client() -> Any:
    """The LangGraph SDK's in-process client (its own privileges), made once."""
    global _loopback
    if _loopback is None:
        from langgraph_sdk import get_client

        _loopback = get_client()
    return _loopback


async def _thread(thread_id: str) -> dict[str, Any] | None:
    from langgraph_sdk.errors import NotFoundError

    try:
        thread: dict[str, Any] = await _client().threads.get(thread_id)
    except NotFoundError:
        return None
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code in (404, 422):
            return None
        raise ProviderUnavailable("the LangGraph server could not look the thread up") from exc
    return thread


async def _search_threads(ids: list[str]) -> dict[str, str]:
    """The status of each of ``ids`` that exists (``idle``, ``busy``, ``interrupted``…)."""
    found = await _client().threads.search(ids=ids, limit=len(ids), select=["thread_id", "status"])
    return {str(t["thread_id"]): str(t.get("status")) for t in found}


async def _run_status(thread_id: str, run_id: str) -> str | None:
    from langgraph_sdk.errors import NotFoundError

    try:
        run = await _client().runs.get(thread_id, run_id)
    except NotFoundError:
        return None
    return str(run.get("status"))


__all__ = ["ADMIN_PERMISSION", "PERMISSIONS", "SandlotInLangGraph", "create_app"]

"""The broker client: sessions (bindings), leases, tokens, and the other resources.

::

    async with AsyncSandlot() as sandlot:          # SANDLOT_URL, SANDLOT_API_KEY
        sandbox = await sandlot.ensure("thr_123")  # waits until the sandbox is active
        print((await sandbox.run("echo hi")).stdout)

Every grant handed out is cached per scope and kept fresh in the background:
the token is refreshed at about 2/3 of its lifetime and this actor's lease is
renewed (heartbeat) at about 1/3 of ``lease_ttl_seconds``. A 401 from the
dataplane refreshes the token, or re-negotiates if the binding is gone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from sandlot.protocol.errors import Gone, SandlotError, Unauthenticated
from sandlot.sdk import _aio
from sandlot.sdk._async._http import KEEPALIVE, AsyncHTTP
from sandlot.sdk._async._wire import AsyncWire
from sandlot.sdk._async.events import AsyncEventStream, wait_for_state
from sandlot.sdk._async.sandbox import AsyncSandbox
from sandlot.sdk.settings import load_settings
from sandlot.sdk.transport import seg
from sandlot.sdk.types import (
    AuditEntry,
    Event,
    Grant,
    HeartbeatResult,
    Pool,
    RefreshResult,
    SandboxSnapshot,
    SessionSnapshot,
    Template,
    Volume,
)

_ACTIVE = ("active", "idle")
_TERMINATED = ("terminated",)
#: Seconds before a failed background refresh or heartbeat is tried again.
RETRY_DELAY = 5.0
#: States a sandbox does not come back from (``terminating`` leads to ``terminated``).
_ENDED = ("terminating", "terminated", "failed")


def _reaches(states: tuple[str, ...]) -> Callable[[Event], bool]:
    """Whether an event (dispatched on its ``phase``) leaves the sandbox in one of ``states``."""

    def check(event: Event) -> bool:
        phase = event.details.get("phase") or {}
        return phase.get("to") in states or event.state in states

    return check


def _failing(target: tuple[str, ...]) -> tuple[str, ...]:
    """The end states that mean ``target`` will never be reached."""
    on_the_way = ("terminating",) if "terminated" in target else ()
    return tuple(s for s in _ENDED if s not in target and s not in on_the_way)


class _Lease:
    """One negotiated grant kept fresh: token refresh and lease heartbeats."""

    def __init__(self, client: AsyncSandlot, request: dict[str, Any], grant: Grant) -> None:
        self.client = client
        self.request = request
        self.grant = grant
        self.stopper = _aio.Stopper()
        self.lock = _aio.Lock()
        self.task: _aio.Background | None = None
        self.refreshes = 0
        self.heartbeats = 0

    def stale(self) -> bool:
        """Whether the cached token is too close to expiry to hand out again."""
        ttl = self.grant.token_ttl_seconds or 90.0
        return self.grant.seconds_left() < min(30.0, ttl / 3)

    def start(self) -> None:
        self.task = _aio.Background(self._loop, name=f"sandlot-lease-{self.grant.session_id}")

    async def _loop(self) -> None:
        lease_ttl = self.grant.lease_ttl_seconds
        beat = max(1.0, lease_ttl / 3) if lease_ttl else None
        refresh_at = time.monotonic() + self.grant.refresh_delay()
        beat_at = time.monotonic() + beat if beat is not None else float("inf")
        while True:
            wait = max(0.0, min(refresh_at, beat_at) - time.monotonic())
            if await self.stopper.wait(wait):
                return
            now = time.monotonic()
            try:
                if now >= refresh_at:
                    await self.renew()
                if beat is not None and now >= beat_at and self.grant.session_id:
                    try:
                        await self.client.heartbeat(self.grant.session_id)
                    except Gone:
                        await self.renew()  # the lease was lost: negotiate again
                    self.heartbeats += 1
            except Exception:  # retried a little later (or by the next 401)
                if now >= refresh_at:
                    refresh_at = now + RETRY_DELAY
                if now >= beat_at:
                    beat_at = now + RETRY_DELAY
                continue
            if now >= refresh_at:
                refresh_at = time.monotonic() + self.grant.refresh_delay()
            if beat is not None and now >= beat_at:
                beat_at = time.monotonic() + beat

    async def renew(self) -> bool:
        """Refresh the token; re-negotiate when the binding is gone."""
        async with self.lock:
            body: RefreshResult | None = None
            # A refresh mints for the actor that attached last through the key: a lease
            # that names its actor negotiates again instead, to stay that actor.
            if self.grant.session_id is not None and "actor" not in self.request:
                try:
                    body = await self.client.refresh(self.grant.session_id)
                    self.grant.update_token(body)
                except (Gone, Unauthenticated):
                    body = None
            if body is None:
                fresh = Grant.from_response(await self.client._negotiate(self.request, None))
                self.grant.__dict__.update(fresh.__dict__)
            self.refreshes += 1
            return True

    async def stop(self) -> None:
        self.stopper.set()
        if self.task is not None:
            await self.task.join(5.0)


class AsyncSandlot:
    """Client of the broker (control plane).

    ``url`` and ``api_key`` default to ``SANDLOT_URL`` and ``SANDLOT_API_KEY``
    (:mod:`sandlot.sdk.settings`).
    ``timeout`` is the default client-side deadline of every call; each method
    takes its own ``timeout`` too. ``on_behalf_of`` lets a service key act for
    a user. ``auto_refresh=False`` turns the background refresh and heartbeats off.
    ``keepalive`` is handed to the sandboxes (see :class:`AsyncSandbox`), and so
    is the client's connection pool (``wire``: one to share, else its own).
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | None = 30.0,
        on_behalf_of: str | None = None,
        auto_refresh: bool = True,
        wire: AsyncWire | None = None,
        keepalive: float | None = KEEPALIVE,
    ) -> None:
        settings = load_settings(url, api_key)
        self.url = settings.url
        self.timeout = timeout
        self.auto_refresh = auto_refresh
        self.keepalive = keepalive
        self._api_key = settings.api_key
        self._on_behalf_of = on_behalf_of
        self._wire = wire or AsyncWire()
        self._owns_wire = wire is None
        self._http = AsyncHTTP(self.url, self._auth, timeout=timeout, wire=self._wire)
        self._leases: dict[tuple[str, str, str, str], _Lease] = {}

    def _auth(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self._api_key}"}
        if self._on_behalf_of:
            headers["X-Sandlot-On-Behalf-Of"] = self._on_behalf_of
        return headers

    async def _json(self, method: str, path: str, timeout: float | None, **kw: Any) -> Any:
        return await self._http.json(method, path, deadline=self._http.deadline(timeout), **kw)

    # --- sessions ------------------------------------------------------------------

    async def _negotiate(self, request: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        body = await self._json(
            "POST", "/v1/sandbox/sessions", timeout, json_body=request, headers=headers
        )
        return dict(body)

    async def ensure(
        self,
        thread_id: str | None = None,
        *,
        scope_type: str = "thread",
        scope_id: str | None = None,
        mode: str = "ensure",
        capabilities: list[str] | None = None,
        template: str | None = None,
        sandbox_hint: str | None = None,
        assistant_id: str | None = None,
        actor_id: str | None = None,
        actor_type: str = "agent",
        provider_preference: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> AsyncSandbox:
        """Attach to the scope's sandbox, creating it if needed; return its :class:`AsyncSandbox`.

        ``thread_id`` is the scope id of a thread scope (``scope_type`` and
        ``scope_id`` name any other scope). With ``wait=True`` (the default)
        this returns once the binding is active, waiting on its event stream.
        The grant is cached per scope and kept fresh until :meth:`release`.
        ``actor_id`` names who acts (one agent of a framework, say) in the token
        and the audit; ``actor_type`` must be the key's (``agent`` for agent and
        service keys, ``human`` for a human's). ``provider_preference`` names the
        configured provider a new sandbox comes from (a template's pin wins).
        """
        sid = scope_id or thread_id
        if not sid:
            raise ValueError("name a scope: thread_id or scope_id")
        request: dict[str, Any] = {"scope": {"type": scope_type, "id": sid}, "mode": mode}
        for name, value in (
            ("requested_capabilities", capabilities),
            ("template", template),
            ("sandbox_hint", sandbox_hint),
            ("assistant_id", assistant_id),
            ("provider_preference", provider_preference),
        ):
            if value is not None:
                request[name] = value
        if actor_id is not None:
            request["actor"] = {"type": actor_type, "id": actor_id}
        key = (scope_type, sid, ",".join(sorted(capabilities or [])), actor_id or "")
        return await self._leased(
            key,
            request,
            {**request, "mode": "ensure"},
            fresh=mode == "create_only",
            wait=wait,
            timeout=timeout,
        )

    async def attach_sandbox(
        self,
        sandbox_id: str,
        *,
        capabilities: list[str] | None = None,
        actor_id: str | None = None,
        actor_type: str = "agent",
        wait: bool = True,
        timeout: float | None = None,
    ) -> AsyncSandbox:
        """Attach to a sandbox by id (one :meth:`create_sandbox` made, say); never creates.

        The caller must own the sandbox (or be an admin); a sandbox that serves a scope is
        attached through that scope's session, so whoever may attach to the scope may.
        Otherwise as :meth:`ensure`: the grant is cached and kept fresh until
        :meth:`release`. Raises ``SandboxNotFound`` for a sandbox that is gone and
        ``Forbidden`` for another user's.
        """
        if not sandbox_id:
            raise ValueError("name a sandbox: sandbox_id")
        request: dict[str, Any] = {"sandbox_id": sandbox_id, "mode": "attach_only"}
        if capabilities is not None:
            request["requested_capabilities"] = capabilities
        if actor_id is not None:
            request["actor"] = {"type": actor_type, "id": actor_id}
        key = ("sandbox", sandbox_id, ",".join(sorted(capabilities or [])), actor_id or "")
        return await self._leased(key, request, request, fresh=False, wait=wait, timeout=timeout)

    async def _leased(
        self,
        key: tuple[str, str, str, str],
        request: dict[str, Any],
        renewal: dict[str, Any],
        *,
        fresh: bool,
        wait: bool,
        timeout: float | None,
    ) -> AsyncSandbox:
        """The sandbox of a cached lease, negotiating ``request`` when there is none (or a
        stale one, or ``fresh``); ``renewal`` is what the lease negotiates to renew."""
        lease = self._leases.get(key)
        if lease is None or lease.stale() or fresh:
            deadline = self._http.deadline(timeout)
            grant = Grant.from_response(await self._negotiate(request, deadline.remaining()))
            if lease is not None:
                await lease.stop()
            lease = _Lease(self, renewal, grant)
            self._leases[key] = lease
            if self.auto_refresh:
                lease.start()
            if wait and grant.state not in _ACTIVE:
                await self.wait_active(grant, timeout=deadline.remaining())
        return AsyncSandbox(
            lease.grant,
            timeout=self.timeout,
            wire=self._wire,
            renew=lease.renew,
            keepalive=self.keepalive,
        )

    async def get(
        self,
        thread_id: str | None = None,
        *,
        scope_type: str = "thread",
        scope_id: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> AsyncSandbox:
        """Attach to the scope's existing sandbox; never creates one (404 SessionNotFound)."""
        return await self.ensure(
            thread_id,
            scope_type=scope_type,
            scope_id=scope_id,
            mode="attach_only",
            wait=wait,
            timeout=timeout,
        )

    async def wait_active(self, grant: Grant, *, timeout: float | None = None) -> SessionSnapshot:
        """Wait until a binding is active: subscribe after the snapshot, dispatch, re-read."""
        assert grant.session_id is not None
        deadline = self._http.deadline(timeout)
        snapshot = await self.session(grant.session_id, timeout=deadline.remaining())
        snapshot = await self._wait_binding(snapshot, _ACTIVE, deadline.remaining())
        grant.state = snapshot.binding.state
        # A sandbox whose first host could not be reached was placed on another one.
        grant.http_base_url = snapshot.dataplane.http_base_url
        grant.ws_base_url = snapshot.dataplane.ws_base_url
        return snapshot

    async def _wait_binding(
        self, snapshot: SessionSnapshot, target: tuple[str, ...], timeout: float | None
    ) -> SessionSnapshot:
        """Wait on a binding's events, from its snapshot's sequence, until it is in ``target``.

        The snapshot is read again at the end: the events are a notice, the snapshot the truth.
        """
        session_id = snapshot.session_id
        deadline = self._http.deadline(timeout)
        if snapshot.binding.state not in target:
            events = self.binding_events(
                session_id,
                after=snapshot.binding.last_event_sequence,
                timeout=deadline.remaining(),
            )
            await wait_for_state(events, _reaches(target), _reaches(_failing(target)))
            snapshot = await self.session(session_id, timeout=deadline.remaining())
        if snapshot.binding.state in _failing(target):
            raise SandlotError(f"binding {session_id} is {snapshot.binding.state}")
        return snapshot

    async def session(self, session_id: str, *, timeout: float | None = None) -> SessionSnapshot:
        """The binding snapshot (``binding``, ``sandbox``, ``dataplane``, ``policy``; no token)."""
        body = await self._json("GET", f"/v1/sandbox/sessions/{seg(session_id)}", timeout)
        return SessionSnapshot.from_wire(body)

    async def refresh(self, session_id: str, *, timeout: float | None = None) -> RefreshResult:
        """A fresh token for the binding (capabilities never wider than granted)."""
        path = f"/v1/sandbox/sessions/{seg(session_id)}/refresh"
        return RefreshResult.from_wire(await self._json("POST", path, timeout, json_body={}))

    async def heartbeat(self, session_id: str, *, timeout: float | None = None) -> HeartbeatResult:
        """Extend this actor's lease: the binding's state and the lease's new expiry."""
        path = f"/v1/sandbox/sessions/{seg(session_id)}/heartbeat"
        return HeartbeatResult.from_wire(await self._json("POST", path, timeout, json_body={}))

    async def release(
        self,
        session_id: str,
        *,
        terminate: bool = False,
        wait: bool = True,
        timeout: float | None = None,
    ) -> SessionSnapshot | None:
        """Detach this actor (its tokens are revoked); ``terminate=True`` tears the sandbox down.

        A teardown is answered as soon as the broker has accepted it (the binding
        ``terminating``, every token revoked). With ``wait=True`` (the default) this then
        waits on the binding's events until the sandbox is ``terminated`` and returns the
        binding snapshot read after that; with ``wait=False`` it returns the accepted
        snapshot (wait later with :meth:`binding_events` after its
        ``binding.last_event_sequence``). A plain detach returns ``None``.
        """
        deadline = self._http.deadline(timeout)
        await self.forget(session_id)
        params = {"terminate": True, "wait": False} if terminate else None
        path = f"/v1/sandbox/sessions/{seg(session_id)}"
        body = await self._json("DELETE", path, deadline.remaining(), params=params)
        if not terminate:
            return None
        # A broker that answers 204 has finished the teardown already.
        left = deadline.remaining()
        snapshot = (
            SessionSnapshot.from_wire(body)
            if body
            else await self.session(session_id, timeout=left)
        )
        if wait:
            snapshot = await self._wait_binding(snapshot, _TERMINATED, deadline.remaining())
        return snapshot

    async def forget(self, session_id: str) -> None:
        """Stop keeping the session's token fresh and its lease held, without a release:
        unless another client holds it, the lease then expires at the broker and the
        sandbox goes idle as its policy says (a later :meth:`ensure` or attach takes it
        up again)."""
        for key, lease in list(self._leases.items()):
            if lease.grant.session_id == session_id:
                await lease.stop()
                del self._leases[key]

    def binding_events(
        self, session_id: str, *, after: int | None = None, timeout: float | None = None
    ) -> AsyncEventStream:
        """The binding's ordered event log after ``after`` (SSE, resumes after drops)."""
        return AsyncEventStream(
            self._http,
            f"/v1/sandbox/sessions/{seg(session_id)}/events",
            after=after,
            timeout=timeout,
        )

    def sandbox(self, grant: Grant | Mapping[str, Any]) -> AsyncSandbox:
        """An :class:`AsyncSandbox` for a grant in hand (e.g. a bootstrap object)."""
        return AsyncSandbox(grant, timeout=self.timeout, wire=self._wire, keepalive=self.keepalive)

    # --- sandboxes -----------------------------------------------------------------

    async def list_sandboxes(
        self, *, include_ended: bool = False, timeout: float | None = None
    ) -> list[SandboxSnapshot]:
        """The caller's sandboxes (``include_ended``: the terminated ones too)."""
        params = {"include_ended": include_ended}
        body = await self._json("GET", "/v1/sandboxes", timeout, params=params)
        return [SandboxSnapshot.from_wire(s) for s in _items(body)]

    async def create_sandbox(
        self,
        *,
        template: str | None = None,
        name: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> SandboxSnapshot:
        """Create a sandbox bound to no scope; with ``wait`` return once it is active."""
        deadline = self._http.deadline(timeout)
        body: dict[str, Any] = {}
        if template is not None:
            body["template"] = template
        if name is not None:
            body["name"] = name
        snap = SandboxSnapshot.from_wire(
            await self._json("POST", "/v1/sandboxes", deadline.remaining(), json_body=body)
        )
        if wait:
            snap = await self._wait_sandbox(snap, _ACTIVE, deadline.remaining())
        return snap

    async def get_sandbox(
        self, sandbox_id: str, *, timeout: float | None = None
    ) -> SandboxSnapshot:
        """One sandbox's snapshot."""
        body = await self._json("GET", f"/v1/sandboxes/{seg(sandbox_id)}", timeout)
        return SandboxSnapshot.from_wire(body)

    async def delete_sandbox(
        self, sandbox_id: str, *, wait: bool = True, timeout: float | None = None
    ) -> SandboxSnapshot:
        """Terminate and remove a sandbox; return its snapshot.

        The broker answers once it has accepted the teardown (state ``terminating``:
        tokens revoked, out of use). With ``wait=True`` (the default) this then waits on
        the sandbox's events until it is ``terminated`` (its processes and files gone);
        with ``wait=False`` it returns the accepted snapshot, to wait on later with
        :meth:`sandbox_events` after its ``last_event_sequence``.
        """
        deadline = self._http.deadline(timeout)
        path = f"/v1/sandboxes/{seg(sandbox_id)}"
        body = await self._json("DELETE", path, deadline.remaining(), params={"wait": False})
        # A broker that answers 204 has finished the teardown already.
        left = deadline.remaining()
        snap = (
            SandboxSnapshot.from_wire(body)
            if body
            else await self.get_sandbox(sandbox_id, timeout=left)
        )
        if wait:
            snap = await self._wait_sandbox(snap, _TERMINATED, deadline.remaining())
        return snap

    async def suspend_sandbox(
        self, sandbox_id: str, *, wait: bool = True, timeout: float | None = None
    ) -> SandboxSnapshot:
        """Suspend a sandbox (processes frozen, files kept)."""
        return await self._transition(sandbox_id, "suspend", ("suspended",), wait, timeout)

    async def resume_sandbox(
        self, sandbox_id: str, *, wait: bool = True, timeout: float | None = None
    ) -> SandboxSnapshot:
        """Resume a suspended sandbox."""
        return await self._transition(sandbox_id, "resume", _ACTIVE, wait, timeout)

    async def _transition(
        self, sandbox_id: str, verb: str, target: tuple[str, ...], wait: bool, timeout: float | None
    ) -> SandboxSnapshot:
        deadline = self._http.deadline(timeout)
        path = f"/v1/sandboxes/{seg(sandbox_id)}/{verb}"
        body = await self._json("POST", path, deadline.remaining(), json_body={})
        snap = (
            SandboxSnapshot.from_wire(body)
            if body
            else await self.get_sandbox(sandbox_id, timeout=deadline.remaining())
        )
        if wait:
            snap = await self._wait_sandbox(snap, target, deadline.remaining())
        return snap

    async def _wait_sandbox(
        self, snap: SandboxSnapshot, target: tuple[str, ...], timeout: float | None
    ) -> SandboxSnapshot:
        """Wait on a sandbox's events, from its snapshot's sequence, until it is in ``target``;
        then read the snapshot again (the events are a notice, the snapshot the truth)."""
        deadline = self._http.deadline(timeout)
        if snap.state not in target:
            events = self.sandbox_events(
                snap.id, after=snap.last_event_sequence, timeout=deadline.remaining()
            )
            await wait_for_state(events, _reaches(target), _reaches(_failing(target)))
            snap = await self.get_sandbox(snap.id, timeout=deadline.remaining())
        if snap.state in _failing(target):
            raise SandlotError(f"sandbox {snap.id} is {snap.state}")
        return snap

    def sandbox_events(
        self, sandbox_id: str, *, after: int | None = None, timeout: float | None = None
    ) -> AsyncEventStream:
        """A sandbox's phase events on the broker (SSE)."""
        return AsyncEventStream(
            self._http, f"/v1/sandboxes/{seg(sandbox_id)}/events", after=after, timeout=timeout
        )

    # --- templates, pools, volumes --------------------------------------------------

    async def list_templates(self, *, timeout: float | None = None) -> list[Template]:
        """Templates the caller may use."""
        body = await self._json("GET", "/v1/templates", timeout)
        return [Template.from_wire(t) for t in _items(body)]

    async def get_template(self, name: str, *, timeout: float | None = None) -> Template:
        """One template."""
        return Template.from_wire(await self._json("GET", f"/v1/templates/{seg(name)}", timeout))

    async def create_template(
        self, template: dict[str, Any], *, timeout: float | None = None
    ) -> Template:
        """Create a template (admins): ``{name, image, resources, network, env, shells, …}``."""
        body = await self._json("POST", "/v1/templates", timeout, json_body=template)
        return Template.from_wire(body)

    async def delete_template(self, name: str, *, timeout: float | None = None) -> None:
        """Delete a template (admins)."""
        await self._json("DELETE", f"/v1/templates/{seg(name)}", timeout)

    async def list_pools(self, *, timeout: float | None = None) -> list[Pool]:
        """Warm pools, with how many sandboxes each has ready."""
        return [Pool.from_wire(p) for p in _items(await self._json("GET", "/v1/pools", timeout))]

    async def create_pool(
        self,
        name: str,
        template: str,
        *,
        min_ready: int = 1,
        max_ready: int | None = None,
        timeout: float | None = None,
    ) -> Pool:
        """Create a warm pool of ``template`` (admins)."""
        body: dict[str, Any] = {"name": name, "template": template, "min_ready": min_ready}
        if max_ready is not None:
            body["max_ready"] = max_ready
        return Pool.from_wire(await self._json("POST", "/v1/pools", timeout, json_body=body))

    async def delete_pool(self, name: str, *, timeout: float | None = None) -> None:
        """Delete a warm pool (admins)."""
        await self._json("DELETE", f"/v1/pools/{seg(name)}", timeout)

    async def list_volumes(self, *, timeout: float | None = None) -> list[Volume]:
        """The caller's volumes."""
        body = await self._json("GET", "/v1/volumes", timeout)
        return [Volume.from_wire(v) for v in _items(body)]

    async def create_volume(
        self, name: str, *, timeout: float | None = None, **fields: Any
    ) -> Volume:
        """Create a persistent volume."""
        body = {"name": name, **fields}
        return Volume.from_wire(await self._json("POST", "/v1/volumes", timeout, json_body=body))

    async def delete_volume(self, name: str, *, timeout: float | None = None) -> None:
        """Delete a volume."""
        await self._json("DELETE", f"/v1/volumes/{seg(name)}", timeout)

    # --- audit ---------------------------------------------------------------------

    async def audit(
        self,
        *,
        scope: str | None = None,
        actor: str | None = None,
        after: int = 0,
        limit: int = 100,
        timeout: float | None = None,
    ) -> list[AuditEntry]:
        """Audit entries after the id ``after`` (admins): who did what, when, to which
        sandbox; ``scope`` (``thread:thr_1``) and ``actor`` (a principal id) filter them."""
        params = {"scope": scope, "actor": actor, "after": after, "limit": limit}
        body = await self._json("GET", "/v1/audit", timeout, params=params)
        return [AuditEntry.from_wire(e) for e in _items(body)]

    # --- lifecycle -----------------------------------------------------------------

    def lease_stats(self) -> dict[str, dict[str, int]]:
        """Per session: how many background refreshes and heartbeats were done."""
        return {
            str(lease.grant.session_id): {
                "refreshes": lease.refreshes,
                "heartbeats": lease.heartbeats,
            }
            for lease in self._leases.values()
        }

    async def aclose(self) -> None:
        """Stop background refreshes and close connections (leases are left to expire)."""
        for lease in list(self._leases.values()):
            await lease.stop()
        self._leases.clear()
        if self._owns_wire:
            await self._wire.aclose()

    async def __aenter__(self) -> AsyncSandlot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _items(body: Any) -> list[dict[str, Any]]:
    """The objects of a list answer (``{"items": [...]}``, PROTOCOL.md 2.8)."""
    return list(body["items"])

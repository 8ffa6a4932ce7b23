"""Leases: what a principal attached to a binding does next.

Negotiation (:mod:`sandlot.broker.sessions`) attaches a principal to a scope's
binding and gives it a lease and tokens; this service serves the calls on that
session afterwards: its snapshot, token refresh, heartbeats (which keep the lease
and wake an idle or suspended sandbox), release (which revokes the caller's
tokens, and with ``terminate`` ends the sandbox) and the binding's event log.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio
from sqlalchemy import Connection, select, update

from sandlot.broker.audit import AuditContext, record
from sandlot.broker.bindings import BindingRow
from sandlot.broker.events import EventHub, append_event, read_events
from sandlot.broker.principals import Principal
from sandlot.broker.sandboxes import SandboxRow, SandboxService, get_sandbox
from sandlot.broker.scopes import check_scope_access
from sandlot.broker.sessions import SessionService
from sandlot.broker.settings import BrokerSettings
from sandlot.broker.store import Store
from sandlot.broker.store.schema import bindings, leases, sandboxes, tokens
from sandlot.protocol.common import Actor, Capability, expand_capabilities, rfc3339
from sandlot.protocol.errors import Forbidden, SequenceExpired, SessionExpired, SessionNotFound
from sandlot.protocol.sessions import (
    Credentials,
    HeartbeatResponse,
    RefreshResponse,
    SandboxRef,
    SessionSnapshot,
)
from sandlot.protocol.states import SandboxState


class LeaseService:
    def __init__(
        self,
        *,
        store: Store,
        settings: BrokerSettings,
        sandboxes: SandboxService,
        sessions: SessionService,
        hub: EventHub,
    ) -> None:
        self.store = store
        self.settings = settings
        self.sandboxes = sandboxes
        self.sessions = sessions
        self.hub = hub

    @property
    def clock(self) -> Any:
        return self.sandboxes.clock

    def _load(
        self, conn: Connection, principal: Principal, session_id: str
    ) -> tuple[BindingRow, SandboxRow]:
        row = conn.execute(select(bindings).where(bindings.c.id == session_id)).first()
        if row is None:
            raise SessionNotFound(f"no session {session_id}")
        binding = BindingRow.from_row(row)
        check_scope_access(conn, principal, binding.scope_key, binding.owner_user_id)
        sandbox = get_sandbox(conn, binding.sandbox_id)
        assert sandbox is not None
        return binding, sandbox

    def _held(
        self, conn: Connection, principal: Principal, session_id: str
    ) -> tuple[BindingRow, SandboxRow, Any]:
        """The live binding, its sandbox and the caller's unreleased lease, or 410."""
        binding, sandbox = self._load(conn, principal, session_id)
        if not binding.live or not sandbox.state.live:
            raise SessionExpired(f"session {session_id} has ended")
        lease = self._lease(conn, principal, binding.id)
        if lease is None or lease.released_at is not None:
            raise SessionExpired(f"session {session_id} was released by this actor")
        return binding, sandbox, lease

    def _lease(self, conn: Connection, principal: Principal, binding_id: str) -> Any:
        return conn.execute(
            select(leases).where(
                leases.c.binding_id == binding_id, leases.c.principal_id == principal.lease_holder
            )
        ).first()

    def snapshot(self, principal: Principal, session_id: str) -> SessionSnapshot:
        with self.store.read() as conn:
            binding, sandbox = self._load(conn, principal, session_id)
            lease = self._lease(conn, principal, binding.id)
        coords = self.sandboxes.coordinates(sandbox)
        return SessionSnapshot(
            session_id=binding.id,
            binding=self.sessions.binding_snapshot(
                binding,
                sandbox,
                created=False,
                lease_expires=lease.expires_at
                if lease is not None and lease.released_at is None
                else None,
                event_seq=binding.event_seq,
            ),
            sandbox=SandboxRef(
                id=sandbox.id,
                provider=sandbox.provider,
                http_base_url=coords.http_base_url,
                ws_base_url=coords.ws_base_url,
            ),
            dataplane=coords,
            policy=self.sessions.policy(sandbox.template),
        )

    def refresh(self, ctx: AuditContext, principal: Principal, session_id: str) -> RefreshResponse:
        self.sessions.warm_caches()
        with self.store.write() as conn:
            binding, sandbox, lease = self._held(conn, principal, session_id)
            now = self.clock()
            entitled = set(self.settings.policy_for(principal.actor_type).allowed)
            caps = sorted(
                (
                    Capability(c)
                    for c in lease.caps
                    if Capability(c) in expand_capabilities(entitled)
                ),
                key=lambda c: c.value,
            )
            # The actor that attached (``actor.id`` of the negotiation) keeps its tokens.
            actor = Actor(type=principal.actor_type, id=lease.actor_id)
            minted = self.sessions.mint(conn, principal, actor, binding, sandbox, caps, now)
            append_event(
                conn,
                bindings,
                binding.id,
                "binding.refreshed",
                {"binding": {"op": "refreshed", "principal": principal.id}},
                state=sandbox.state.value,
                actor=actor,
                now=now,
            )
            record(
                conn,
                replace(ctx, actor=actor),
                "session.refresh",
                scope_key=binding.scope_key,
                session_id=binding.id,
                sandbox_id=sandbox.id,
                now=now,
            )
        self.hub.notify(binding.id)
        expires_at = rfc3339(minted.expires_at) or ""
        return RefreshResponse(
            token=minted.token,
            expires_at=expires_at,
            credentials=Credentials(
                access_token=minted.token, expires_at=expires_at, granted_capabilities=caps
            ),
        )

    async def heartbeat(
        self, ctx: AuditContext, principal: Principal, session_id: str
    ) -> HeartbeatResponse:
        def tx() -> tuple[HeartbeatResponse, bool, str]:
            with self.store.write() as conn:
                binding, sandbox, _lease = self._held(conn, principal, session_id)
                now = self.clock()
                expires = now + self.settings.lease_ttl_seconds
                conn.execute(
                    update(leases)
                    .where(
                        leases.c.binding_id == binding.id,
                        leases.c.principal_id == principal.lease_holder,
                    )
                    .values(expires_at=expires)
                )
                conn.execute(
                    update(sandboxes).where(sandboxes.c.id == sandbox.id).values(last_active_at=now)
                )
                state = sandbox.state
                if state is SandboxState.IDLE:
                    self.sandboxes.apply_state_in(
                        conn, sandbox.id, SandboxState.ACTIVE, reason="heartbeat"
                    )
                    state = SandboxState.ACTIVE
            return (
                HeartbeatResponse(state=state.value, lease_expires_at=rfc3339(expires) or ""),
                state is SandboxState.SUSPENDED,
                sandbox.id,
            )

        resp, resume, sandbox_id = await anyio.to_thread.run_sync(tx)
        if resume:
            state = await self.sandboxes.resume(sandbox_id, reason="heartbeat")
            resp.state = state.value
        self.hub.notify(session_id)
        return resp

    async def release(
        self,
        ctx: AuditContext,
        principal: Principal,
        session_id: str,
        *,
        terminate: bool,
        wait: bool = True,
    ) -> SessionSnapshot | None:
        """End the caller's lease; ``terminate`` tears the sandbox down (see
        :meth:`SandboxService.terminate` for ``wait``) and returns the binding's snapshot."""

        def tx() -> tuple[str, list[Any]]:
            with self.store.write() as conn:
                binding, sandbox = self._load(conn, principal, session_id)
                if terminate and not (
                    principal.effective_user == binding.owner_user_id or principal.is_admin
                ):
                    raise Forbidden("only the scope's owner or an admin may terminate it")
                if not binding.live and not terminate:
                    raise SessionExpired(f"session {session_id} has ended")
                now = self.clock()
                conn.execute(
                    update(leases)
                    .where(
                        leases.c.binding_id == binding.id,
                        leases.c.principal_id == principal.lease_holder,
                        leases.c.released_at.is_(None),
                    )
                    .values(released_at=now)
                )
                revoked = self.sandboxes.revoke_tokens_in(
                    conn,
                    sandbox_id=sandbox.id,
                    binding_id=binding.id,
                    principal_id=principal.lease_holder,
                )
                if binding.live:
                    append_event(
                        conn,
                        bindings,
                        binding.id,
                        "binding.detached",
                        {
                            "binding": {
                                "op": "detached",
                                "principal": principal.id,
                                "revoked_tokens": len(revoked),
                            }
                        },
                        state=sandbox.state.value,
                        actor=principal.actor,
                        now=now,
                    )
                record(
                    conn,
                    ctx,
                    "session.terminate" if terminate else "session.release",
                    scope_key=binding.scope_key,
                    session_id=binding.id,
                    sandbox_id=sandbox.id,
                    details={"revoked_tokens": len(revoked)},
                    now=now,
                )
            return sandbox.id, revoked

        sandbox_id, revoked = await anyio.to_thread.run_sync(tx)
        self.hub.notify(session_id)
        await self.sandboxes.push_revocations(sandbox_id, revoked)
        if not terminate:
            return None
        await self.sandboxes.terminate(
            sandbox_id, reason="terminated by request", ctx=ctx, wait=wait
        )
        return await anyio.to_thread.run_sync(self.snapshot, principal, session_id)

    def session_for_token(self, claims: dict[str, Any]) -> str:
        """The alias ``/sandbox/refresh {token}``: the token must still be live."""
        with self.store.read() as conn:
            row = conn.execute(select(tokens).where(tokens.c.jti == claims.get("jti"))).first()
        if row is None or row.revoked_at is not None:
            raise SessionExpired("this token was revoked")
        return str(row.binding_id)

    # --- events -----------------------------------------------------------------------

    def events_after(
        self, principal: Principal, session_id: str, after: int
    ) -> list[dict[str, Any]]:
        with self.store.read() as conn:
            self._load(conn, principal, session_id)
            items, oldest = read_events(conn, session_id, after)
        if oldest is not None and after < oldest - 1:
            raise SequenceExpired(
                f"events after {after} are no longer retained (oldest is {oldest})",
                metadata={"oldest_sequence": oldest},
            )
        return items

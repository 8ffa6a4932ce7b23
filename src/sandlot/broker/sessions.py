"""Sessions: which sandbox serves a scope, who holds a lease on it, and their tokens.

A *binding* ties a scope (``thread:thr_1``) to a sandbox; it is live while its
sandbox is. ``ensure`` is atomic across workers and replicas: the live binding
of a scope is unique (``bindings.live_scope``), so a creator that loses the
race finds the winner's binding and attaches to it. Each principal attached
to a binding holds a *lease* (how long it counts as present, extended by
heartbeats) and gets *tokens* (how long it may call the dataplane, extended by
refresh); the two are independent.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, overload

import anyio
from sqlalchemy import Connection, select, update
from sqlalchemy.exc import IntegrityError

from sandlot.broker import failpoints
from sandlot.broker import statements as sql
from sandlot.broker.audit import INSERT as INSERT_AUDIT
from sandlot.broker.audit import AuditContext, audit_row
from sandlot.broker.bindings import BindingRow
from sandlot.broker.events import EventHub, append_event
from sandlot.broker.fleet import HOST_LOST_REASON
from sandlot.broker.idempotency import Claim
from sandlot.broker.keys import check_key_live
from sandlot.broker.poolclaims import PoolClaims, Reservation
from sandlot.broker.principals import Principal
from sandlot.broker.quickattach import QuickAttach
from sandlot.broker.ratelimit import Charge
from sandlot.broker.sandboxes import SandboxRow, SandboxService, get_sandbox
from sandlot.broker.scopes import check_scope_access
from sandlot.broker.settings import BrokerSettings
from sandlot.broker.store import Store
from sandlot.broker.store.schema import (
    bindings,
    leases,
    sandboxes,
    scopes,
)
from sandlot.broker.templates import TemplateService
from sandlot.broker.tokens import KeyRing
from sandlot.protocol.common import (
    Actor,
    Capability,
    PrincipalType,
    Scope,
    ScopeType,
    expand_capabilities,
    new_id,
    rfc3339,
)
from sandlot.protocol.errors import (
    CapabilityDenied,
    Forbidden,
    InvalidRequest,
    RateLimited,
    SandboxNotFound,
    SandlotError,
    SessionConflict,
    SessionExpired,
    SessionNotFound,
    Unauthenticated,
)
from sandlot.protocol.sessions import (
    BindingSnapshot,
    Credentials,
    Policy,
    SandboxRef,
    SessionGrant,
    SessionMode,
    SessionRequest,
    Template,
)
from sandlot.protocol.states import SandboxState

#: See :attr:`SessionService.scope_guard`.
ScopeGuard = Callable[[Principal, Scope], Awaitable[None]]

log = logging.getLogger("sandlot.broker.sessions")


@dataclass
class _Negotiated:
    grant: SessionGrant
    provision: SandboxRow | None
    template: Template | None
    resume: bool
    #: The negotiation's audit row, written last (:meth:`SessionService._settle`).
    audit: dict[str, Any]
    #: The scope's live binding and its sandbox, for :class:`QuickAttach` to remember.
    live: tuple[BindingRow, SandboxRow] | None = None


class _LostRace(Exception):
    """Another creator committed the scope's binding first: attach to it instead."""


class SessionService:
    def __init__(
        self,
        *,
        store: Store,
        settings: BrokerSettings,
        keyring: KeyRing,
        sandboxes: SandboxService,
        templates: TemplateService,
        hub: EventHub,
    ) -> None:
        self.store = store
        self.settings = settings
        self.keyring = keyring
        self.sandboxes = sandboxes
        self.templates = templates
        self.hub = hub
        self.pool_claims = PoolClaims(store, sandboxes)
        #: PostgreSQL: an attach to a live binding this process knows, in one round trip.
        self.quick = QuickAttach(self) if store.dialect == "postgresql" else None
        #: Checked before every negotiation with the scope the caller named (before any
        #: promotion): raises to refuse it. Set by a platform that owns the scopes, e.g.
        #: a LangGraph server whose threads the caller must be able to see.
        self.scope_guard: ScopeGuard | None = None

    @property
    def clock(self) -> Any:
        return self.sandboxes.clock

    # --- negotiation ----------------------------------------------------------------

    def effective_scope(self, req: SessionRequest) -> Scope:
        scope = req.effective_scope()
        if (
            self.settings.promote_thread_to_assistant
            and scope.type is ScopeType.THREAD
            and req.assistant_id
        ):
            return Scope(type=ScopeType.ASSISTANT, id=req.assistant_id)
        return scope

    def granted_capabilities(
        self, principal: Principal, requested: list[Capability] | None
    ) -> list[Capability]:
        policy = self.settings.policy_for(principal.actor_type)
        if requested is None:
            caps = policy.default
        else:
            denied = sorted(c.value for c in set(requested) - policy.allowed)
            if denied:
                raise CapabilityDenied(
                    f"{', '.join(denied)} not permitted for actor type {principal.actor_type}",
                    metadata={"capability": denied[0], "denied": denied},
                )
            caps = frozenset(requested)
        return sorted(expand_capabilities(caps), key=lambda c: c.value)

    @staticmethod
    def acting_actor(principal: Principal, requested: Actor | None) -> Actor:
        """Who acts: the token's ``act`` claim and the audit's actor (docs/BROKER.md).

        The type always comes from the key. An agent or service key may name any of
        its agents (``actor.id``); a human key acts only as its own human.
        """
        if requested is None:
            return principal.actor
        if requested.type is not principal.actor_type:
            raise Forbidden(
                f"this key acts as {principal.actor_type}, not {requested.type}",
                metadata={"actor_type": principal.actor_type.value},
            )
        if principal.type is PrincipalType.HUMAN and requested.id not in (
            principal.id,
            principal.user_id,
        ):
            raise Forbidden(
                "a human key acts only as its own human",
                metadata={"actor_id": principal.id},
            )
        return requested

    @overload
    async def negotiate(
        self, ctx: AuditContext, principal: Principal, req: SessionRequest
    ) -> SessionGrant: ...

    @overload
    async def negotiate(
        self,
        ctx: AuditContext,
        principal: Principal,
        req: SessionRequest,
        *,
        claim: Claim | None,
        charge: Charge | None = None,
    ) -> SessionGrant | None: ...

    async def negotiate(
        self,
        ctx: AuditContext,
        principal: Principal,
        req: SessionRequest,
        *,
        claim: Claim | None = None,
        charge: Charge | None = None,
    ) -> SessionGrant | None:
        """Attach or create; ``claim`` (an ``Idempotency-Key``) is settled in the same
        transaction, and ``charge`` takes the request's rate-limit token in it too.
        ``None``: the claim holds an earlier identical request's answer."""
        try:
            ctx = replace(ctx, actor=self.acting_actor(principal, req.actor))
            if self.scope_guard is not None and req.sandbox_id is None:
                await self.scope_guard(principal, req.effective_scope())
            scope = self.effective_scope(req)
            caps = self.granted_capabilities(principal, req.requested_capabilities)
            reserved = await self._reserve_pooled(req, scope)
            try:
                result = await anyio.to_thread.run_sync(
                    self._negotiate_tx, ctx, principal, req, scope, caps, claim, reserved, charge
                )
            except BaseException:
                if reserved is not None:
                    await self.pool_claims.release(reserved)
                raise
        except SandlotError as exc:
            if charge is not None and not isinstance(exc, RateLimited):
                # The token went with the transaction that failed: a refused request
                # counts against the rate all the same.
                await anyio.to_thread.run_sync(self._charge_alone, charge)
            raise
        if reserved is not None and (
            result is None or result.grant.sandbox.id != reserved.sandbox_id
        ):
            await self.pool_claims.release(reserved)
        if reserved is not None and reserved.template is not None:
            # The next pooled ensure finds its sandbox claimed already.
            self.pool_claims.replenish(reserved.template, reserved.provider)
        if result is None:
            return None
        if result.provision is not None:
            failpoints.hit("after_binding_insert")
            self.sandboxes.spawn(self.sandboxes.provision(result.provision, result.template))
        elif result.resume:
            state = await self.sandboxes.resume(result.grant.sandbox.id, reason="ensure")
            result.grant.binding.state = state.value
        self.hub.notify(result.grant.session_id)
        return result.grant

    async def _reserve_pooled(self, req: SessionRequest, scope: Scope) -> Reservation | None:
        """A pool sandbox claimed at the provider for a binding this request may create
        (:mod:`sandlot.broker.poolclaims`); None when the provider records no claims."""
        if (
            not self.pool_claims.enabled
            or not req.mode.creates
            or req.sandbox_id is not None
            or req.sandbox_hint
        ):
            return None
        template = self.templates.get(req.template or self.settings.default_template)
        provider = self.sandboxes.choose_provider(template, req.provider_preference)
        return await self.pool_claims.reserve(scope.key(), template, provider)

    def warm_caches(self) -> None:
        """Reload what transactions read from memory (never open a second connection in one)."""
        self.keyring.refresh_if_stale()
        self.templates.list()

    def _charge_alone(self, charge: Charge) -> None:
        """Take a failed request's rate-limit token in a transaction of its own."""
        # The request's own error is what it answers, whatever happens here.
        with contextlib.suppress(SandlotError), self.store.write() as conn:
            charge.take_in(conn)

    def _settle(
        self, conn: Connection, result: _Negotiated, claim: Claim | None, charge: Charge | None
    ) -> None:
        """The negotiation's last writes: its audit row, the answer of its key (``claim``)
        and its rate-limit token, taken last so that the bucket's row stays locked only
        until the commit. On PostgreSQL in one statement (one round trip, not three)."""
        body = result.grant.model_dump(mode="json") if claim is not None else None
        if conn.dialect.name != "postgresql" or (claim is None and charge is None):
            conn.execute(INSERT_AUDIT, result.audit)
            if claim is not None:
                claim.finish_in(conn, 200, body)
            if charge is not None:
                charge.take_in(conn)
            return
        params = {f"a_{k}": v for k, v in result.audit.items()}
        if claim is not None:
            params.update(claim.finish_params(200, body))
        take: dict[str, Any] = {}
        if charge is not None:
            take = charge.limiter.take_params(charge.who)
            params.update(take)
        row = conn.execute(sql.settle_statement(claim is not None, charge is not None), params)
        taken = row.first() is not None
        if claim is not None:
            claim.finished(200, body)
        if charge is not None and not taken:
            charge.limiter.refuse(conn, take)

    def _negotiate_tx(
        self,
        ctx: AuditContext,
        principal: Principal,
        req: SessionRequest,
        scope: Scope,
        caps: list[Capability],
        claim: Claim | None = None,
        reserved: Reservation | None = None,
        charge: Charge | None = None,
    ) -> _Negotiated | None:
        self.warm_caches()
        template: Template | None = None
        if req.mode.creates:
            template = self.templates.get(req.template or self.settings.default_template)
        if self.quick is not None and reserved is None:
            quick = self.quick.attach(ctx, principal, req, scope, caps, claim, charge)
            if quick is not None:
                return _Negotiated(quick.grant, None, template, False, {})
        for _ in range(5):
            try:
                with self.store.write() as conn:
                    if claim is not None and claim.begin_in(conn):
                        if charge is not None:
                            charge.take_in(conn)
                        return None
                    result = self._negotiate_in(
                        conn, ctx, principal, req, scope, caps, template, reserved
                    )
                    # A resume changes the answer after this transaction.
                    self._settle(conn, result, None if result.resume else claim, charge)
                if self.quick is not None and result.live is not None:
                    self.quick.learn(*result.live)
                return result
            except _LostRace:
                continue
            except IntegrityError:
                # PostgreSQL: the unique live binding of the scope was taken meanwhile.
                continue
            except RateLimited:
                if claim is not None:
                    # Its claim went with the transaction: the key is free, as if the
                    # request had been refused before it (nothing to record or abandon).
                    claim.owned = False
                raise
        raise SessionConflict("the scope changed too often while negotiating, retry")

    def _negotiate_in(
        self,
        conn: Connection,
        ctx: AuditContext,
        principal: Principal,
        req: SessionRequest,
        scope: Scope,
        caps: list[Capability],
        template: Template | None,
        reserved: Reservation | None = None,
    ) -> _Negotiated:
        now = self.clock()
        key = scope.key()
        user = principal.effective_user
        actor = ctx.actor or principal.actor
        owner = None
        live: BindingRow | None = None
        live_sandbox: SandboxRow | None = None
        if req.sandbox_id is not None:
            served = self._live_binding_of_sandbox(conn, principal, req.sandbox_id)
            if served is not None:
                live = BindingRow.from_row(served)
                # The binding it serves (its own, or a scope's): report that scope.
                key, scope = live.scope_key, Scope.parse(live.scope_key)
        else:
            row = conn.execute(sql.LIVE_BINDING, {"key": key}).first()
            if row is not None:
                live, live_sandbox = BindingRow.from_row(row, "b_"), SandboxRow.from_row(row)
        if live is not None:
            # A binding's owner is its scope's owner: no need to read the scope.
            check_scope_access(conn, principal, key, live.owner_user_id)
        elif req.sandbox_id is None:
            owner = conn.execute(sql.SCOPE_OWNER, {"key": key}).first()
            if owner is not None:
                check_scope_access(conn, principal, key, owner.owner_user_id)
        created = False
        provision: SandboxRow | None = None
        resume = False
        if live is not None:
            if req.mode is SessionMode.CREATE_ONLY:
                raise SessionConflict(
                    f"scope {key} already has a live session", metadata={"session_id": live.id}
                )
            binding = live
            found = live_sandbox or get_sandbox(conn, binding.sandbox_id)
            assert found is not None
            sandbox, resume = self._wake(conn, found, now)
        elif req.sandbox_id is not None:
            found = get_sandbox(conn, req.sandbox_id)
            assert found is not None
            binding = self._bind_standalone(conn, found, actor, now)
            sandbox, resume = self._wake(conn, found, now)
            created = True
        else:
            if not req.mode.creates:
                raise SessionNotFound(f"no live session for scope {key}", metadata={"scope": key})
            if req.mode is SessionMode.ENSURE:
                self._refuse_if_lost_with_host(conn, key)
            assert template is not None
            if owner is None:
                conn.execute(
                    scopes.insert().values(scope_key=key, owner_user_id=user, created_at=now)
                )
            # The scope's owner owns its sandbox (and is charged for it), whoever of
            # the users it is shared with asked for it.
            owner_id = owner.owner_user_id if owner else user
            sandbox, provision = self._sandbox_for_new_binding(
                conn, req, template, owner_id, key, reserved, requester=user
            )
            binding = self._insert_binding(conn, key, sandbox, owner_id, actor, now)
            created = True
        # PostgreSQL: the lease is written with the token, in one statement (the lease's
        # row still locked before the binding's, as everywhere).
        together = conn.dialect.name == "postgresql" and principal.key_id is not None
        lease_expires, lease = self._attach(
            conn, principal, actor, binding, caps, now, write=not together
        )
        minted = None
        if together:
            minted = self.mint(conn, principal, actor, binding, sandbox, caps, now, lease=lease)
        seq = append_event(
            conn,
            bindings,
            binding.id,
            "binding.attached",
            {"binding": {"op": "attached", "principal": principal.id, "caps": caps}},
            state=sandbox.state.value,
            actor=actor,
            now=now,
        )
        if minted is None:
            minted = self.mint(conn, principal, actor, binding, sandbox, caps, now)
        audit = audit_row(
            ctx,
            "session.ensure" if req.mode.creates else "session.attach",
            outcome="created" if created else "attached",
            scope_key=key,
            session_id=binding.id,
            sandbox_id=sandbox.id,
            details={"mode": req.mode.value, "caps": [c.value for c in caps]},
            now=now,
        )
        grant = self.grant(
            binding,
            sandbox,
            scope,
            req,
            created=created,
            lease_expires=lease_expires,
            event_seq=seq,
            token=minted,
            caps=caps,
        )
        known = (binding, sandbox) if req.sandbox_id is None else None
        return _Negotiated(grant, provision, template, resume, audit, known)

    def _wake(self, conn: Connection, sandbox: SandboxRow, now: float) -> tuple[SandboxRow, bool]:
        """An attach counts as activity: the sandbox as it is now, and whether to resume it."""
        # The lease now counts as presence; the row's activity stamp needs no rewrite
        # more than once a second.
        if now - sandbox.last_active_at > 1.0:
            conn.execute(sql.TOUCH_SANDBOX, {"sb": sandbox.id, "now": now})
        if sandbox.state is SandboxState.IDLE:
            self.sandboxes.apply_state_in(conn, sandbox.id, SandboxState.ACTIVE, reason="attach")
            sandbox = get_sandbox(conn, sandbox.id) or sandbox
        return sandbox, sandbox.state is SandboxState.SUSPENDED

    @staticmethod
    def _live_binding_of_sandbox(conn: Connection, principal: Principal, sandbox_id: str) -> Any:
        """The live binding a sandbox serves (``None``: none yet, and the caller owns it).

        Attaching by ``sandbox_id`` (docs/BROKER.md): a sandbox that serves a scope is
        attached through that scope's binding, so whoever may attach to the scope may
        (checked by the caller); one that serves none only by its owner or an admin.
        """
        sandbox = get_sandbox(conn, sandbox_id)
        if sandbox is None or not sandbox.state.live or sandbox.pool is not None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", metadata={"sandbox_id": sandbox_id})
        live = conn.execute(
            select(bindings).where(
                bindings.c.sandbox_id == sandbox_id, bindings.c.live_scope.is_not(None)
            )
        ).first()
        mine = sandbox.owner_user_id == principal.effective_user or principal.is_admin
        if live is None and not mine:
            raise Forbidden("this sandbox belongs to another user")
        return live

    def _bind_standalone(
        self, conn: Connection, sandbox: SandboxRow, actor: Actor, now: float
    ) -> BindingRow:
        """A binding of its own (scope ``sandbox:sb_…``) for a sandbox that serves no scope.

        The sandbox stays unbound (``scope`` null in its snapshot); the binding gives it
        what every session has: leases, refresh, heartbeat, release and events.
        """
        key = Scope(type=ScopeType.SANDBOX, id=sandbox.id).key()
        return self._insert_binding(conn, key, sandbox, sandbox.owner_user_id, actor, now)

    @staticmethod
    def _insert_binding(
        conn: Connection,
        key: str,
        sandbox: SandboxRow,
        owner: str | None,
        actor: Actor,
        now: float,
    ) -> BindingRow:
        """A new live binding of ``key`` to ``sandbox``, with its ``binding.created`` event
        (``_LostRace`` when another one won the scope meanwhile)."""
        binding_id = new_id("ssn", 10)
        try:
            with conn.begin_nested():
                conn.execute(
                    bindings.insert().values(
                        id=binding_id,
                        scope_key=key,
                        live_scope=key,
                        sandbox_id=sandbox.id,
                        owner_user_id=owner,
                        created_at=now,
                        event_seq=0,
                    )
                )
        except IntegrityError as exc:
            raise _LostRace() from exc
        append_event(
            conn,
            bindings,
            binding_id,
            "binding.created",
            {"binding": {"op": "created", "scope": key, "sandbox_id": sandbox.id}},
            state=sandbox.state.value,
            actor=actor,
            now=now,
        )
        row = conn.execute(select(bindings).where(bindings.c.id == binding_id)).first()
        return BindingRow.from_row(row)

    def _sandbox_for_new_binding(
        self,
        conn: Connection,
        req: SessionRequest,
        template: Template,
        user: str,
        key: str,
        reserved: Reservation | None = None,
        *,
        requester: str | None = None,
    ) -> tuple[SandboxRow, SandboxRow | None]:
        """The sandbox a new binding gets: the hinted one, a warm one (``reserved``, when
        the provider records claims), or a new one.

        ``user`` is the scope's owner: a new or pooled sandbox is theirs (and counts
        against their quota), and a hint must name one of their sandboxes, whoever
        (``requester``, a user the scope is shared with) asked."""
        if req.sandbox_hint:
            found = conn.execute(
                select(sandboxes).where(
                    (sandboxes.c.id == req.sandbox_hint)
                    | (sandboxes.c.live_name == f"{user}:{req.sandbox_hint}")
                )
            ).first()
            if found is None or found.owner_user_id != user:
                if requester is not None and requester != user:
                    raise InvalidRequest(
                        f"sandbox_hint {req.sandbox_hint!r} is not a sandbox of the scope's "
                        "owner: a shared scope is served only by its owner's sandboxes",
                        metadata={"sandbox_hint": req.sandbox_hint},
                    )
                raise InvalidRequest(
                    f"sandbox_hint {req.sandbox_hint!r} is not a sandbox of yours",
                    metadata={"sandbox_hint": req.sandbox_hint},
                )
            hinted = SandboxRow.from_row(found)
            if not hinted.state.live:
                raise SessionExpired(f"sandbox {hinted.id} is {hinted.state}")
            in_use = conn.execute(
                select(bindings.c.id, bindings.c.owner_user_id).where(
                    bindings.c.sandbox_id == hinted.id, bindings.c.live_scope.is_not(None)
                )
            ).first()
            if in_use is not None:
                # The session is named only to its own user (a shared scope may be another's).
                raise SessionConflict(
                    f"sandbox {hinted.id} already serves another scope",
                    metadata={"session_id": in_use.id} if in_use.owner_user_id == user else {},
                )
            conn.execute(update(sandboxes).where(sandboxes.c.id == hinted.id).values(scope_key=key))
            return hinted, None
        provider = self.sandboxes.choose_provider(template, req.provider_preference)
        claimed = self._claim_from_pool(conn, template, user, key, provider, reserved)
        if claimed is not None:
            return claimed, None
        new = self.sandboxes.insert(
            conn, template=template, owner_user_id=user, scope_key=key, provider=provider
        )
        return new, new

    @staticmethod
    def _refuse_if_lost_with_host(conn: Connection, key: str) -> None:
        """An ``ensure`` never replaces, unasked, a sandbox lost with its host: its files
        are gone, and a fresh sandbox under the same scope would hide that. The scope's
        last binding ended with the loss; ``create_only`` starts a new one knowingly."""
        last = conn.execute(
            select(bindings.c.id, bindings.c.sandbox_id, sandboxes.c.state, sandboxes.c.reason)
            .join(sandboxes, sandboxes.c.id == bindings.c.sandbox_id)
            .where(bindings.c.scope_key == key)
            .order_by(bindings.c.created_at.desc())
            .limit(1)
        ).first()
        if (
            last is None
            or last.state != SandboxState.FAILED.value
            or last.reason != HOST_LOST_REASON
        ):
            return
        raise SessionExpired(
            f"the sandbox of scope {key} was lost with its host; its files are gone. "
            "Ensure with mode create_only to start a new sandbox",
            metadata={
                "scope": key,
                "session_id": last.id,
                "sandbox_id": last.sandbox_id,
                "reason": HOST_LOST_REASON,
            },
        )

    def _claim_from_pool(
        self,
        conn: Connection,
        template: Template,
        user: str,
        key: str,
        provider: str | None,
        reserved: Reservation | None = None,
    ) -> SandboxRow | None:
        wanted = [sandboxes.c.provider == provider] if provider is not None else []
        if reserved is not None:
            wanted.append(sandboxes.c.id == reserved.sandbox_id)
        elif self.pool_claims.enabled:
            return None  # a claim the provider did not record would hand a pod out twice
        pooled = conn.execute(
            select(sandboxes.c.id)
            .where(
                sandboxes.c.pool.is_not(None),
                sandboxes.c.template == template.name,
                *wanted,
                sandboxes.c.state == SandboxState.ACTIVE.value,
            )
            .order_by(sandboxes.c.created_at)
            .limit(1)
        ).first()
        if pooled is None:
            return None
        self.sandboxes.check_quota(conn, user)
        now = self.clock()
        taken = conn.execute(
            update(sandboxes)
            .where(sandboxes.c.id == pooled.id, sandboxes.c.pool.is_not(None))
            .values(
                pool=None,
                owner_user_id=user,
                scope_key=key,
                last_active_at=now,
                hard_deadline=now + (template.hard_ttl_seconds or self.settings.hard_ttl_seconds),
            )
        ).rowcount
        if not taken:
            return None
        append_event(
            conn,
            sandboxes,
            pooled.id,
            "sandbox.claimed",
            {"phase": {"from": "active", "to": "active", "reason": "claimed from pool"}},
            state="active",
            now=now,
        )
        return get_sandbox(conn, pooled.id)

    def _attach(
        self,
        conn: Connection,
        principal: Principal,
        actor: Actor,
        binding: BindingRow,
        caps: list[Capability],
        now: float,
        *,
        write: bool = True,
    ) -> tuple[float, dict[str, Any]]:
        """The lease's expiry and row; written here unless ``write`` is false (then
        :meth:`mint` writes it with the token)."""
        expires, row = self.lease_row(principal, actor, binding, caps, now)
        if not write:
            return expires, row
        renewed = conn.execute(
            sql.RENEW_LEASE,
            {
                "b_binding": binding.id,
                "b_principal": principal.lease_holder,
                "b_user": row["user_id"],
                "b_actor_type": row["actor_type"],
                "b_actor_id": row["actor_id"],
                "b_caps": row["caps"],
                "b_expires": expires,
            },
        ).rowcount
        if not renewed:
            conn.execute(leases.insert(), row)
        return expires, row

    def lease_row(
        self,
        principal: Principal,
        actor: Actor,
        binding: BindingRow,
        caps: list[Capability],
        now: float,
    ) -> tuple[float, dict[str, Any]]:
        """The expiry and row of ``principal``'s lease on ``binding``, attaching now."""
        expires = now + self.settings.lease_ttl_seconds
        return expires, {
            "binding_id": binding.id,
            "principal_id": principal.lease_holder,
            "user_id": principal.effective_user,
            "actor_type": principal.actor_type.value,
            # The actor that attached last: refresh mints its tokens for it.
            "actor_id": actor.id,
            "caps": [c.value for c in caps],
            "expires_at": expires,
            "released_at": None,
        }

    def mint(
        self,
        conn: Connection,
        principal: Principal,
        actor: Actor,
        binding: BindingRow,
        sandbox: SandboxRow,
        caps: list[Capability],
        now: float,
        *,
        lease: dict[str, Any] | None = None,
    ) -> Any:
        """A token for ``principal`` (refused if its key was revoked meanwhile);
        PostgreSQL: with ``lease`` (:meth:`_attach`'s row) written in the same statement."""
        combined = conn.dialect.name == "postgresql" and principal.key_id is not None
        if not combined:
            check_key_live(conn, principal.key_id)
        minted = self.keyring.mint(
            principal_id=principal.id,
            actor=actor,
            session_id=binding.id,
            sandbox_id=sandbox.id,
            scope_key=binding.scope_key,
            caps=caps,
            generation=sandbox.generation,
            ttl=self.settings.token_ttl_seconds,
            now=now,
        )
        row = {
            "jti": minted.jti,
            "binding_id": binding.id,
            "sandbox_id": sandbox.id,
            "principal_id": principal.lease_holder,
            "key_id": principal.key_id,
            "user_id": principal.effective_user,
            "issued_at": minted.issued_at,
            "expires_at": minted.expires_at,
        }
        if not combined:
            conn.execute(sql.INSERT_TOKEN, row)
            return minted
        if lease is None:
            inserted = conn.execute(sql.INSERT_TOKEN_IF_KEY_LIVE, row).first()
        else:
            params = {**row, **{f"l_{k}": v for k, v in lease.items()}}
            inserted = conn.execute(sql.INSERT_TOKEN_AND_LEASE, params).first()
        if inserted is None:
            raise Unauthenticated("invalid API key")
        return minted

    def policy(self, template_name: str | None = None) -> Policy:
        # From the template cache only: this runs inside transactions.
        tpl = self.templates.peek(template_name) if template_name else None
        return Policy(
            idle_timeout_seconds=(tpl.idle_timeout_seconds if tpl else None)
            or self.settings.idle_timeout_seconds,
            hard_ttl_seconds=(tpl.hard_ttl_seconds if tpl else None)
            or self.settings.hard_ttl_seconds,
            token_ttl_seconds=self.settings.token_ttl_seconds,
            lease_ttl_seconds=self.settings.lease_ttl_seconds,
        )

    def binding_snapshot(
        self,
        binding: BindingRow,
        sandbox: SandboxRow,
        *,
        created: bool,
        lease_expires: float | None,
        event_seq: int,
    ) -> BindingSnapshot:
        return BindingSnapshot(
            id=binding.id,
            scope=Scope.parse(binding.scope_key),
            sandbox_id=sandbox.id,
            provider=sandbox.provider,
            state=sandbox.state.value if binding.live or not sandbox.state.live else "terminated",
            created=created,
            lease_expires_at=rfc3339(lease_expires),
            last_event_sequence=event_seq,
            created_at=rfc3339(binding.created_at),
            owner_user_id=binding.owner_user_id,
        )

    def grant(
        self,
        binding: BindingRow,
        sandbox: SandboxRow,
        scope: Scope,
        req: SessionRequest,
        *,
        created: bool,
        lease_expires: float,
        event_seq: int,
        token: Any,
        caps: list[Capability],
    ) -> SessionGrant:
        coords = self.sandboxes.coordinates(sandbox)
        expires_at = rfc3339(token.expires_at) or ""
        return SessionGrant(
            session_id=binding.id,
            thread_id=req.thread_id or (scope.id if scope.type is ScopeType.THREAD else None),
            sandbox=SandboxRef(
                id=sandbox.id,
                provider=sandbox.provider,
                http_base_url=coords.http_base_url,
                ws_base_url=coords.ws_base_url,
            ),
            token=token.token,
            expires_at=expires_at,
            binding=self.binding_snapshot(
                binding, sandbox, created=created, lease_expires=lease_expires, event_seq=event_seq
            ),
            dataplane=coords,
            credentials=Credentials(
                access_token=token.token, expires_at=expires_at, granted_capabilities=caps
            ),
            policy=self.policy(sandbox.template),
            refresh_url=f"/v1/sandbox/sessions/{binding.id}/refresh",
        )

    def check_actor(self, actor: Actor | None, principal: Principal) -> None:
        if actor is not None and actor.type is not principal.actor_type:
            raise Forbidden("actor type does not match the key")

    @staticmethod
    def now() -> float:
        return time.time()

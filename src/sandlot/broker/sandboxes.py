"""Sandboxes as the broker sees them: rows in the store kept in step with a provider.

The store is the authority over what *should* exist; the provider reports
what *does*. Every state change goes through :meth:`SandboxService.apply_state`,
which checks the transition, records a phase event on the sandbox's log and
on the log of the live binding that uses it, and ends that binding when the
sandbox is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from sqlalchemy import Connection, bindparam, false, func, or_, select, true, update

from sandlot.broker import failpoints
from sandlot.broker.audit import AuditContext, record
from sandlot.broker.events import EventHub, append_event
from sandlot.broker.fleet import HOST_LOST_REASON, HostRegistry
from sandlot.broker.settings import BrokerSettings
from sandlot.broker.store import Store
from sandlot.broker.store.schema import bindings, leases, sandboxes, tokens
from sandlot.broker.templates import TemplateService
from sandlot.protocol.common import new_id, rfc3339
from sandlot.protocol.errors import (
    ProviderUnavailable,
    QuotaExceeded,
    ResourceConflict,
    SandboxNotFound,
    SandlotError,
)
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxSnapshot, Template
from sandlot.protocol.states import SandboxState, can_transition
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import Provider, ProviderStatus, SandboxSpec
from sandlot.providers.remote import HOST_UNREACHABLE, dataplane_coordinates

log = logging.getLogger("sandlot.broker.sandboxes")
#: Seconds a stopping broker waits for provider calls in flight (each is bounded, a
#: host's to 30 s, but one stop should not wait for all of them in turn).
STOP_DRAIN_SECONDS = 10.0

Clock = Callable[[], float]

#: Seconds an accepted teardown is left to the process that accepted it before the
#: reaper finishes it (the provider's deletion normally takes a fraction of a second).
TEARDOWN_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class SandboxRow:
    id: str
    name: str | None
    owner_user_id: str | None
    template: str
    provider: str
    state: SandboxState
    generation: int
    scope_key: str | None
    pool: str | None
    created_at: float
    last_active_at: float
    idle_since: float | None
    hard_deadline: float
    idle_timeout: int
    event_seq: int
    reason: str | None
    updated_at: float
    #: The sandbox host that runs it (None: any, see :mod:`sandlot.broker.hosts`).
    host: str | None = None
    dataplane_http: str | None = None
    dataplane_ws: str | None = None

    @classmethod
    def from_row(cls, r: Any) -> SandboxRow:
        return cls(
            id=r.id,
            name=r.name,
            owner_user_id=r.owner_user_id,
            template=r.template,
            provider=r.provider,
            state=SandboxState(r.state),
            generation=r.generation,
            scope_key=r.scope_key,
            pool=r.pool,
            created_at=r.created_at,
            last_active_at=r.last_active_at,
            idle_since=r.idle_since,
            hard_deadline=r.hard_deadline,
            idle_timeout=r.idle_timeout,
            event_seq=r.event_seq,
            reason=r.reason,
            updated_at=r.updated_at,
            host=r.host,
            dataplane_http=r.dataplane_http,
            dataplane_ws=r.dataplane_ws,
        )


_GET_SANDBOX = select(sandboxes).where(sandboxes.c.id == bindparam("id"))


def get_sandbox(conn: Connection, sandbox_id: str) -> SandboxRow | None:
    row = conn.execute(_GET_SANDBOX, {"id": sandbox_id}).first()
    return SandboxRow.from_row(row) if row is not None else None


LIVE_STATES = [s.value for s in SandboxState if s.live]


class SandboxService:
    def __init__(
        self,
        *,
        store: Store,
        provider: Provider,
        settings: BrokerSettings,
        templates: TemplateService,
        hub: EventHub,
        clock: Clock = time.time,
        host: str | None = None,
        fleet: HostRegistry | None = None,
        remote: Provider | None = None,
    ) -> None:
        self.store = store
        self.provider = provider
        #: The sandbox host this process is, for a provider bound to one (else None).
        self.host = host if provider.host_bound else None
        #: With registered hosts (``hosts.mode`` ``registered`` or ``mixed``): new sandboxes
        #: are placed on them (``mixed``: this process's own host among them).
        self.fleet = fleet
        #: The provider APIs of the other hosts in the store
        #: (:class:`~sandlot.broker.fleet.FleetProvider`): what this process does to a
        #: sandbox another host runs (resume, suspend, create after placement) goes there.
        self.remote = remote
        self.settings = settings
        self.templates = templates
        self.hub = hub
        self.clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()
        self._teardowns: dict[str, asyncio.Task[bool]] = {}

    # --- rows -----------------------------------------------------------------------

    def insert(
        self,
        conn: Connection,
        *,
        template: Template,
        owner_user_id: str | None,
        name: str | None = None,
        scope_key: str | None = None,
        pool: str | None = None,
        provider: str | None = None,
    ) -> SandboxRow:
        """Insert a new sandbox row in ``provisioning`` (the caller's transaction).

        ``provider``: the configured provider chosen for it (:meth:`choose_provider`);
        None: the template's pin, else the default. With registered hosts, the row names
        the host placed on (``provider``: only hosts that run it; None: any) and that
        host's dataplane (placed on this process's own host, ``mixed``: as embedded); the
        provider is asked to create it after the transaction commits (:meth:`provision`).
        """
        now = self.clock()
        if owner_user_id is not None and pool is None:
            self.check_quota(conn, owner_user_id)
        sandbox_id = new_id("sb", 10)
        idle = template.idle_timeout_seconds or self.settings.idle_timeout_seconds
        ttl = template.hard_ttl_seconds or self.settings.hard_ttl_seconds
        live_name = f"{owner_user_id}:{name}" if name else None
        if live_name is not None:
            taken = conn.execute(
                select(sandboxes.c.id).where(sandboxes.c.live_name == live_name)
            ).first()
            if taken is not None:
                raise ResourceConflict(f"a live sandbox named {name!r} already exists")
        host: str | None
        placed = self.fleet.place(conn, provider=provider) if self.fleet is not None else None
        if placed is not None and placed.id != self.host:
            host, provider_name = placed.id, placed.provider
            coords = dataplane_coordinates(placed.dataplane_url, sandbox_id)
        else:
            host, provider_name = self.host, provider or self.provider.choose(template)
            coords = self.provider.assign(sandbox_id, provider_name).dataplane(sandbox_id)
        conn.execute(
            sandboxes.insert().values(
                id=sandbox_id,
                name=name,
                owner_user_id=owner_user_id,
                template=template.name,
                provider=provider_name,
                state=SandboxState.PROVISIONING.value,
                generation=1,
                scope_key=scope_key,
                pool=pool,
                created_at=now,
                updated_at=now,
                last_active_at=now,
                hard_deadline=now + ttl,
                idle_timeout=idle,
                live_name=live_name,
                event_seq=0,
                host=host,
                dataplane_http=coords.http_base_url,
                dataplane_ws=coords.ws_base_url,
            )
        )
        append_event(
            conn,
            sandboxes,
            sandbox_id,
            "sandbox.created",
            {"phase": {"from": None, "to": "provisioning", "reason": "created"}},
            state="provisioning",
            now=now,
        )
        row = get_sandbox(conn, sandbox_id)
        assert row is not None
        return row

    def choose_provider(self, template: Template, preference: str = "auto") -> str | None:
        """The provider a new sandbox of ``template`` goes to: the template's pin, else
        ``preference`` (``auto``: the default). With registered hosts, None for any host's
        provider (placement chooses), else the name hosts must run."""
        if self.fleet is not None:
            return template.provider or (None if preference == "auto" else preference)
        return self.provider.choose(template, preference)

    def check_quota(self, conn: Connection, user_id: str) -> None:
        """Refuse a new sandbox past the user's quota. The check holds the user's lock to
        the end of the caller's transaction (which inserts the sandbox), so creations at
        several replicas are counted one after the other."""
        self.store.serialize(conn, f"sandlot:quota:{user_id}")
        live = conn.execute(
            select(func.count())
            .select_from(sandboxes)
            .where(
                sandboxes.c.owner_user_id == user_id,
                sandboxes.c.state.in_(LIVE_STATES),
                sandboxes.c.pool.is_(None),
            )
        ).scalar_one()
        limit = self.settings.max_live_sandboxes_per_user
        if live >= limit:
            raise QuotaExceeded(
                f"user {user_id} already has {live} live sandboxes (limit {limit})",
                metadata={"limit": limit, "live": live},
            )

    def spec_for(self, row: SandboxRow, template: Template | None = None) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id=row.id,
            generation=row.generation,
            template=template or self.templates.get(row.template),
            owner_user_id=row.owner_user_id,
            name=row.name,
            provider=row.provider,
            pool=row.pool,
        )

    def snapshot(self, row: SandboxRow) -> SandboxSnapshot:
        return SandboxSnapshot(
            id=row.id,
            name=row.name,
            template=row.template,
            state=row.state.value,
            provider=row.provider,
            dataplane=self.coordinates(row),
            created_at=rfc3339(row.created_at) or "",
            last_event_sequence=row.event_seq,
            owner_user_id=row.owner_user_id,
            scope=row.scope_key,
            generation=row.generation,
        )

    def coordinates(self, row: SandboxRow) -> DataplaneCoordinates:
        """Where its dataplane answers: its host asks its provider (the address may change
        across a restart); other replicas read what the host recorded."""
        if not self.is_hosted_here(row) and row.dataplane_http and row.dataplane_ws:
            return DataplaneCoordinates(
                http_base_url=row.dataplane_http, ws_base_url=row.dataplane_ws
            )
        return self.provider.assign(row.id, row.provider).dataplane(row.id)

    def record_coordinates(self, sandbox_ids: list[str]) -> None:
        """Record where this host's sandboxes answer now (after a restart re-adopts them)."""
        if self.host is None or not sandbox_ids:
            return
        with self.store.write() as conn:
            for sandbox_id in sandbox_ids:
                # The provider knows its own sandboxes again (load_state).
                coords = self.provider.dataplane(sandbox_id)
                conn.execute(
                    update(sandboxes)
                    .where(sandboxes.c.id == sandbox_id)
                    .values(dataplane_http=coords.http_base_url, dataplane_ws=coords.ws_base_url)
                )

    def is_hosted_here(self, row: SandboxRow) -> bool:
        """Whether this process's provider runs the sandbox (see :mod:`sandlot.broker.hosts`)."""
        if self.host is None:
            # No host of its own: every sandbox (one machine, or a provider every replica
            # reaches alike), or none (``registered``: the hosts run them all).
            return self.fleet is None
        return row.host is None or row.host == self.host

    def reaches(self, row: SandboxRow) -> bool:
        """Whether this process can act on the sandbox: its own, or another host's
        through that host's provider API."""
        return self.is_hosted_here(row) or (self.remote is not None and row.host is not None)

    def provider_for(self, row: SandboxRow) -> Provider:
        """The provider that acts on the sandbox: this process's for its own, else its
        host's provider API (``503 PROVIDER_UNAVAILABLE`` when none is reachable)."""
        if self.is_hosted_here(row):
            return self.provider
        if self.remote is None or row.host is None:
            raise ProviderUnavailable(
                f"sandbox {row.id} runs on another host, which this process cannot reach",
                metadata={"sandbox_id": row.id, "host": row.host},
            )
        return self.remote

    def _hosted_here(self) -> Any:
        """The SQL form of :meth:`is_hosted_here`."""
        if self.host is None:
            return true() if self.fleet is None else false()
        return or_(sandboxes.c.host.is_(None), sandboxes.c.host == self.host)

    # --- provider calls ------------------------------------------------------------

    #: Hosts a new sandbox is tried on, the first placement's included.
    PLACEMENTS = 3

    async def provision(self, row: SandboxRow, template: Template | None = None) -> None:
        """Ask the provider to create the sandbox; accepted at once, completes in background.

        A registered host that cannot be reached (the request never left: nothing was
        made there) gets the sandbox placed again on another host, up to
        :attr:`PLACEMENTS` hosts in all, before it fails.
        """
        unreachable: list[str] = []
        while True:
            spec = self.spec_for(row, template)
            try:
                status = await self.provider_for(row).create(spec)
                if status.state is SandboxState.PROVISIONING:
                    failpoints.hit("mid_provision")
                break
            except ProviderUnavailable as exc:
                if (
                    exc.metadata.get("reason") == HOST_UNREACHABLE
                    and row.host is not None
                    and len(unreachable) + 1 < self.PLACEMENTS
                ):
                    unreachable.append(row.host)
                    moved = await anyio.to_thread.run_sync(
                        self._place_again, row, unreachable, exc.message
                    )
                    if moved is not None:
                        row = moved
                        continue
                await self.apply_state(row.id, SandboxState.FAILED, reason=exc.message)
                return
            except SandlotError as exc:
                await self.apply_state(row.id, SandboxState.FAILED, reason=exc.message)
                return
            except Exception as exc:
                log.exception("provider create failed for %s", row.id)
                await self.apply_state(row.id, SandboxState.FAILED, reason=type(exc).__name__)
                return
        if status.state is not SandboxState.PROVISIONING:
            await self.apply_state(row.id, status.state, reason=status.reason)

    def _place_again(self, row: SandboxRow, unreachable: list[str], why: str) -> SandboxRow | None:
        """Move a sandbox still ``provisioning`` on an unreachable host to another host
        (its row, its dataplane's coordinates, an event on its and its binding's logs);
        ``None`` if it changed meanwhile or no other host has room."""
        assert self.fleet is not None
        with self.store.write() as conn:
            current = get_sandbox(conn, row.id)
            if (
                current is None
                or current.state is not SandboxState.PROVISIONING
                or current.host != row.host
            ):
                return None
            try:
                placed = self.fleet.place(conn, provider=row.provider, exclude=unreachable)
            except ProviderUnavailable as exc:
                log.warning("sandbox %s could not be placed again: %s", row.id, exc.message)
                return None
            if placed.id == self.host:
                coords = self.provider.assign(row.id, row.provider).dataplane(row.id)
            else:
                coords = dataplane_coordinates(placed.dataplane_url, row.id)
            now = self.clock()
            changed = conn.execute(
                update(sandboxes)
                .where(
                    sandboxes.c.id == row.id,
                    sandboxes.c.state == SandboxState.PROVISIONING.value,
                    sandboxes.c.host == row.host,
                )
                .values(
                    host=placed.id,
                    dataplane_http=coords.http_base_url,
                    dataplane_ws=coords.ws_base_url,
                    updated_at=now,
                )
            ).rowcount
            if not changed:
                return None
            reason = f"placed on host {placed.id}: host {row.host} cannot be reached ({why})"
            phase = {"from": "provisioning", "to": "provisioning", "reason": reason}
            append_event(
                conn, sandboxes, row.id, "sandbox.placed", {"phase": phase},
                state="provisioning", now=now,
            )  # fmt: skip
            binding_id = self._binding_of(conn, row.id, ended=False)
            if binding_id is not None:
                append_event(
                    conn, bindings, binding_id, "binding.placed", {"phase": phase},
                    state="provisioning", now=now,
                )  # fmt: skip
            moved = get_sandbox(conn, row.id)
        log.warning("sandbox %s %s", row.id, reason)
        self.hub.notify(row.id)
        if binding_id is not None:
            self.hub.notify(binding_id)
        return moved

    def spawn(self, coro: Any) -> None:
        """Run background provider work, keeping a reference until it finishes."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_provider_status(self, sandbox_id: str, status: ProviderStatus) -> None:
        """Listener handed to the provider: reality changed."""
        await self.apply_state(sandbox_id, status.state, reason=status.reason)

    async def apply_state(
        self, sandbox_id: str, state: SandboxState, *, reason: str | None = None
    ) -> bool:
        changed = await anyio.to_thread.run_sync(self._apply_state_tx, sandbox_id, state, reason)
        return changed

    def _apply_state_tx(self, sandbox_id: str, state: SandboxState, reason: str | None) -> bool:
        with self.store.write() as conn:
            changed, binding_id = self.apply_state_in(conn, sandbox_id, state, reason=reason)
        if changed:
            self.hub.notify(sandbox_id)
            if binding_id:
                self.hub.notify(binding_id)
        return changed

    def apply_state_in(
        self,
        conn: Connection,
        sandbox_id: str,
        state: SandboxState,
        *,
        reason: str | None = None,
        ctx: AuditContext | None = None,
    ) -> tuple[bool, str | None]:
        """Checked transition inside the caller's transaction; returns (changed, binding).

        The update holds only if the state is still the one checked: on PostgreSQL two
        replicas' transactions may both read ``active``, and the later writer must not
        overwrite the earlier one's ``terminating`` with ``idle``. The later one re-reads
        (the other has committed by then) and checks its transition again.
        """
        for _ in range(5):
            row = get_sandbox(conn, sandbox_id)
            if row is None or row.state == state or not can_transition(row.state, state):
                return False, None
            now = self.clock()
            values: dict[str, Any] = {"state": state.value, "updated_at": now, "reason": reason}
            if state is SandboxState.IDLE:
                values["idle_since"] = now
            elif state is SandboxState.ACTIVE:
                values["idle_since"] = None
                values["last_active_at"] = now
            if not state.live:
                values["live_name"] = None
            changed = conn.execute(
                update(sandboxes)
                .where(sandboxes.c.id == sandbox_id, sandboxes.c.state == row.state.value)
                .values(**values)
            ).rowcount
            if changed:
                break
        else:
            return False, None
        phase = {"from": row.state.value, "to": state.value, "reason": reason}
        append_event(
            conn,
            sandboxes,
            sandbox_id,
            f"sandbox.{state.value}",
            {"phase": phase},
            state=state.value,
            now=now,
        )
        binding_id = self._binding_of(conn, sandbox_id, ended=row.state is SandboxState.TERMINATING)
        if binding_id is not None:
            append_event(
                conn,
                bindings,
                binding_id,
                f"binding.{state.value}",
                {"phase": phase},
                state=state.value,
                now=now,
            )
            if not state.live and row.state.live:
                self.end_binding(conn, binding_id, now=now)
        if not state.live and row.state is not SandboxState.TERMINATING:
            # A teardown is recorded once, when it is accepted.
            record(
                conn,
                ctx,
                "sandbox.fail" if state is SandboxState.FAILED else "sandbox.terminate",
                sandbox_id=sandbox_id,
                session_id=binding_id,
                scope_key=row.scope_key,
                details={"reason": reason},
                now=now,
            )
        return True, binding_id

    @staticmethod
    def _binding_of(conn: Connection, sandbox_id: str, *, ended: bool) -> str | None:
        """The live binding served by the sandbox; with ``ended``, the last one it served
        (a teardown's completion goes on the log of the binding it ended)."""
        query = select(bindings.c.id).where(bindings.c.sandbox_id == sandbox_id)
        if ended:
            query = query.order_by(bindings.c.created_at.desc()).limit(1)
        else:
            query = query.where(bindings.c.live_scope.is_not(None))
        binding = conn.execute(query).first()
        return binding.id if binding is not None else None

    def end_binding(self, conn: Connection, binding_id: str, *, now: float) -> None:
        conn.execute(
            update(bindings)
            .where(bindings.c.id == binding_id)
            .values(live_scope=None, ended_at=now)
        )
        conn.execute(
            update(leases)
            .where(leases.c.binding_id == binding_id, leases.c.released_at.is_(None))
            .values(released_at=now)
        )

    def revoke_tokens_in(
        self,
        conn: Connection,
        *,
        sandbox_id: str,
        binding_id: str | None = None,
        principal_id: str | None = None,
    ) -> list[RevokedToken]:
        """Mark matching live tokens revoked; return them for the dataplane."""
        now = self.clock()
        cond = [
            tokens.c.sandbox_id == sandbox_id,
            tokens.c.revoked_at.is_(None),
            tokens.c.expires_at > now,
        ]
        if binding_id is not None:
            cond.append(tokens.c.binding_id == binding_id)
        if principal_id is not None:
            cond.append(tokens.c.principal_id == principal_id)
        rows = conn.execute(select(tokens.c.jti, tokens.c.expires_at).where(*cond)).all()
        if rows:
            conn.execute(update(tokens).where(*cond).values(revoked_at=now))
        return [RevokedToken(r.jti, r.expires_at) for r in rows]

    async def push_revocations(
        self, sandbox_id: str, revoked: list[RevokedToken], provider: Provider | None = None
    ) -> None:
        """Push revoked tokens to the sandbox's dataplane (``provider``: the one that runs
        it, this process's by default)."""
        if not revoked:
            return
        try:
            await (provider or self.provider).revoke(sandbox_id, revoked)
        except Exception:
            # The tokens stay revoked in the store; the dataplane also refuses a
            # token whose sandbox generation or existence no longer matches.
            log.exception("revocation push failed for %s", sandbox_id)

    async def terminate(
        self, sandbox_id: str, *, reason: str, ctx: AuditContext | None = None, wait: bool = True
    ) -> SandboxRow:
        """Tear a sandbox down: accept, then delete it through the provider.

        Acceptance is one transaction: every token revoked, the binding ended, the
        sandbox ``terminating`` (out of use at once; a crash from here on is finished
        by the reaper). The provider's deletion then moves it to ``terminated``; with
        ``wait=False`` that runs in the background and the caller gets the accepted row,
        whose ``event_seq`` is where to wait from; with ``wait=True`` the row after the
        deletion (still ``terminating`` if the provider failed: the reaper retries).
        """

        def tx() -> tuple[list[RevokedToken], str | None, bool, SandboxRow]:
            with self.store.write() as conn:
                revoked = self.revoke_tokens_in(conn, sandbox_id=sandbox_id)
                changed, binding_id = self.apply_state_in(
                    conn, sandbox_id, SandboxState.TERMINATING, reason=reason, ctx=ctx
                )
                row = get_sandbox(conn, sandbox_id)
            if row is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id}")
            return revoked, binding_id, changed, row

        revoked, binding_id, changed, row = await anyio.to_thread.run_sync(tx)
        failpoints.hit("mid_release")
        if changed:
            self.hub.notify(sandbox_id)
            if binding_id:
                self.hub.notify(binding_id)
        if not self.reaches(row):
            # Its host's reaper deletes it (finish_terminating); its dataplane already
            # refuses the revoked tokens, pushed there by its host's RevocationWatcher.
            return row
        provider = self.provider_for(row)
        if provider is self.provider:
            await self.push_revocations(sandbox_id, revoked, provider)
        else:
            # Another host's: in the background (its own watcher reads them too).
            self.spawn(self.push_revocations(sandbox_id, revoked, provider))
        if row.state is SandboxState.TERMINATED:
            # Deleted before: the provider is asked once more (a retry after a failure;
            # another host's reaper removes what it still runs).
            if provider is self.provider:
                await self._delete(sandbox_id, provider)
            return row
        teardown = self._teardown(sandbox_id, reason, provider)
        if not wait or provider is not self.provider:
            # Another host's deletion is not waited for: an unreachable host would hold the
            # caller for its timeouts, and that host's reaper finishes it anyway.
            return row
        # Shielded: a caller that goes away does not stop a teardown half way.
        await asyncio.shield(teardown)
        return await anyio.to_thread.run_sync(self.get, sandbox_id)

    def _teardown(
        self, sandbox_id: str, reason: str, provider: Provider | None = None
    ) -> asyncio.Task[bool]:
        """The one provider deletion of an accepted teardown (joined by later requests)."""
        task = self._teardowns.get(sandbox_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._finish(sandbox_id, reason, provider or self.provider)
            )
            self._teardowns[sandbox_id] = task
            self._tasks.add(task)

            def forget(t: asyncio.Task[bool]) -> None:
                self._teardowns.pop(sandbox_id, None)
                self._tasks.discard(t)

            task.add_done_callback(forget)
        return task

    async def _finish(self, sandbox_id: str, reason: str, provider: Provider) -> bool:
        if not await self._delete(sandbox_id, provider):
            return False
        try:
            await self.apply_state(sandbox_id, SandboxState.TERMINATED, reason=reason)
        except Exception:
            log.exception("could not record the end of %s (the reaper will retry)", sandbox_id)
            return False
        return True

    async def _delete(self, sandbox_id: str, provider: Provider | None = None) -> bool:
        try:
            await (provider or self.provider).delete(sandbox_id)
        except Exception:
            log.exception("provider delete failed for %s (the reaper will retry)", sandbox_id)
            return False
        return True

    def terminating(self, *, hosted_here: bool = False) -> list[SandboxRow]:
        """Sandboxes whose teardown was accepted and not yet finished."""
        q = select(sandboxes).where(sandboxes.c.state == SandboxState.TERMINATING.value)
        if hosted_here:
            q = q.where(self._hosted_here())
        with self.store.read() as conn:
            rows = conn.execute(q).all()
        return [SandboxRow.from_row(r) for r in rows]

    async def finish_terminating(self, grace: float = TEARDOWN_GRACE_SECONDS) -> list[str]:
        """Complete the teardowns a crash or a provider failure left ``terminating``.

        One accepted less than ``grace`` seconds ago is left to the process that
        accepted it (another worker, maybe), unless this process is running it.
        """
        rows = await anyio.to_thread.run_sync(partial(self.terminating, hosted_here=True))
        done = []
        now = self.clock()
        for row in rows:
            if row.id not in self._teardowns and now - row.updated_at < grace:
                continue
            if await asyncio.shield(self._teardown(row.id, row.reason or "terminated")):
                done.append(row.id)
        return done

    async def suspend(self, sandbox_id: str, *, reason: str) -> None:
        provider = self.provider
        with contextlib.suppress(SandboxNotFound):
            # Which configured provider runs it (a worker may not have seen it yet), and
            # where: another host's sandbox is suspended by that host.
            row = await anyio.to_thread.run_sync(self.get, sandbox_id)
            provider = self.provider_for(row)
            if provider is self.provider:
                self.provider.assign(row.id, row.provider)
        if provider is self.provider and not self.provider.can_suspend(sandbox_id):
            await self.terminate(sandbox_id, reason=reason)
            return
        try:
            status = await provider.suspend(sandbox_id)
        except SandboxNotFound:
            await self.apply_state(sandbox_id, SandboxState.FAILED, reason="sandbox vanished")
            return
        await self.apply_state(sandbox_id, status.state, reason=reason)

    async def resume(self, sandbox_id: str, *, reason: str) -> SandboxState:
        row = await anyio.to_thread.run_sync(self.get, sandbox_id)
        # Another host's sandbox is resumed by that host, through its provider API.
        provider = self.provider_for(row)
        try:
            status = await provider.resume(sandbox_id)
        except SandboxNotFound:
            await self.apply_state(sandbox_id, SandboxState.FAILED, reason="sandbox vanished")
            return SandboxState.FAILED
        except SandlotError:
            raise
        except Exception as exc:
            raise ProviderUnavailable("the provider could not resume the sandbox") from exc
        await self.apply_state(sandbox_id, status.state, reason=reason)
        return status.state

    async def fail_with_host(self, sandbox_id: str, state: SandboxState) -> bool:
        """A sandbox whose host was declared lost: a live one fails (``host_lost``: tokens
        revoked, its binding ended, phase events on both logs); a teardown under way is
        recorded as finished (nothing is left to delete that anyone can reach). Once: the
        transition is conditional, so of several reapers one changes it."""

        def tx() -> tuple[bool, str | None]:
            with self.store.write() as conn:
                if state is SandboxState.TERMINATING:
                    return self.apply_state_in(
                        conn, sandbox_id, SandboxState.TERMINATED, reason=HOST_LOST_REASON
                    )
                self.revoke_tokens_in(conn, sandbox_id=sandbox_id)
                return self.apply_state_in(
                    conn, sandbox_id, SandboxState.FAILED, reason=HOST_LOST_REASON
                )

        changed, binding_id = await anyio.to_thread.run_sync(tx)
        if changed:
            log.warning("sandbox %s failed: its host was lost", sandbox_id)
            self.hub.notify(sandbox_id)
            if binding_id:
                self.hub.notify(binding_id)
        return changed

    # --- queries --------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRow:
        with self.store.read() as conn:
            row = get_sandbox(conn, sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        return row

    def list_live(self, *, hosted_here: bool = False) -> list[SandboxRow]:
        """Live sandboxes (``hosted_here``: only those this process's provider runs)."""
        q = select(sandboxes).where(sandboxes.c.state.in_(LIVE_STATES))
        if hosted_here:
            q = q.where(self._hosted_here())
        with self.store.read() as conn:
            rows = conn.execute(q).all()
        return [SandboxRow.from_row(r) for r in rows]

    def list_for(self, user_id: str | None, *, include_ended: bool = False) -> list[SandboxRow]:
        q = select(sandboxes).where(sandboxes.c.pool.is_(None)).order_by(sandboxes.c.created_at)
        if user_id is not None:
            q = q.where(sandboxes.c.owner_user_id == user_id)
        if not include_ended:
            q = q.where(sandboxes.c.state.in_(LIVE_STATES))
        with self.store.read() as conn:
            rows = conn.execute(q).all()
        return [SandboxRow.from_row(r) for r in rows]

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for background provider work (used at shutdown and by tests); after
        ``timeout`` seconds, what is left is cancelled (as a crash would end it: the
        next start recovers it)."""
        try:
            async with asyncio.timeout(timeout):
                while self._tasks:
                    await asyncio.gather(*list(self._tasks), return_exceptions=True)
        except TimeoutError:
            left = list(self._tasks)
            log.warning("%d provider calls still running after %g s: cancelled", len(left), timeout)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

"""The reaper: idleness, suspension, hard TTL, orphans, stuck provisioning and teardowns, pools,
lost sandbox hosts (:mod:`sandlot.broker.fleet`).

One pass (:meth:`Reaper.run_once`) is a pure function of the store, the
provider and the clock, so tests drive it with an injected clock. The loop
runs it every ``reaper_interval_seconds``; its state lives in the store, so a
restarted broker carries on where the last one stopped. Work in progress is
never reaped: a running command or an attached client is activity.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import anyio
from sqlalchemy import delete, select, update

from sandlot.broker.events import EventHub
from sandlot.broker.fleet import HostRegistry
from sandlot.broker.idempotency import IdempotencyStore
from sandlot.broker.pools import PoolService
from sandlot.broker.sandboxes import SandboxRow, SandboxService
from sandlot.broker.settings import BrokerSettings
from sandlot.broker.store import Store
from sandlot.broker.store.schema import bindings, leases, sandboxes, tokens
from sandlot.protocol.errors import ProviderUnavailable
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import AdoptionRecord

log = logging.getLogger("sandlot.broker.reaper")


@dataclass
class ReaperReport:
    """What one pass did (returned for tests and logged at debug level)."""

    activated: list[str] = field(default_factory=list)
    idled: list[str] = field(default_factory=list)
    suspended: list[str] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    pool_created: list[str] = field(default_factory=list)
    #: Sandboxes failed (or teardowns finished) because their host was lost.
    host_lost: list[str] = field(default_factory=list)


class Reaper:
    #: How often a sandbox that is busy on the dataplane gets its activity stamp rewritten.
    TOUCH_SECONDS = 30.0

    def __init__(
        self,
        *,
        store: Store,
        settings: BrokerSettings,
        sandboxes: SandboxService,
        pools: PoolService,
        idempotency: IdempotencyStore,
        hub: EventHub,
        registry: HostRegistry | None = None,
    ) -> None:
        #: The hosts' registry (a server store): each pass sweeps lost hosts.
        self.registry = registry
        self.store = store
        self.settings = settings
        self.sandboxes = sandboxes
        self.pools = pools
        self.idempotency = idempotency
        self.hub = hub
        #: Whether passes refill pools (a ``sandlot host`` leaves that to the brokers).
        self.refill_pools = True
        #: Whether passes purge expired idempotency claims and tokens (the brokers' own
        #: reapers do; a pass run for a host through the API does not, :mod:`.hostapi`).
        self.purge = True
        self._next_sweep = 0.0
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def provider(self):  # type: ignore[no-untyped-def]
        return self.sandboxes.provider

    def now(self) -> float:
        return self.sandboxes.clock()

    async def recover(self, lost_ids: Collection[str] | None = None) -> list[str]:
        """At start: re-adopt what the store believes is live; re-drive or fail the rest.

        ``lost_ids``: what the host found lost when it re-adopted its sandboxes itself
        (a host that reaches the store through the brokers' API, :mod:`.hostapi`);
        None: the provider re-adopts them here."""
        live = await anyio.to_thread.run_sync(self._hosted_here)
        records = []
        for row in live:
            try:
                template = self.sandboxes.templates.get(row.template)
            except Exception:
                await self.sandboxes.apply_state(
                    row.id, SandboxState.FAILED, reason="template gone"
                )
                continue
            records.append(
                AdoptionRecord(
                    row.id,
                    row.generation,
                    template,
                    row.state,
                    provider=row.provider,
                    pool=row.pool,
                )
            )
        if lost_ids is None:
            lost = set(await self.provider.load_state(records))
        else:
            lost = set(lost_ids) & {r.sandbox_id for r in records}
        adopted = [r.sandbox_id for r in records if r.sandbox_id not in lost]
        await anyio.to_thread.run_sync(self.sandboxes.record_coordinates, adopted)
        for row in live:
            if row.id not in lost:
                continue
            if row.state is SandboxState.PROVISIONING:
                # Killed mid-provision: the provider never finished; start over.
                log.info("re-provisioning %s after restart", row.id)
                self.sandboxes.spawn(self.sandboxes.provision(row))
            else:
                await self.sandboxes.apply_state(
                    row.id, SandboxState.FAILED, reason="sandbox lost across a restart"
                )
        # Teardowns the previous process accepted and did not finish.
        await self.sandboxes.finish_terminating(grace=0.0)
        return sorted(lost)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with _suppress_cancel():
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper pass failed")
            await asyncio.sleep(self.settings.reaper_interval_seconds)

    async def run_once(self) -> ReaperReport:
        async with self._lock:
            report = ReaperReport()
            live = await anyio.to_thread.run_sync(self._hosted_here)
            held = await anyio.to_thread.run_sync(self._sandboxes_with_live_leases)
            for row in live:
                await self._visit(row, held, report)
            report.terminated += await self.sandboxes.finish_terminating()
            await self._remove_orphans(live, report)
            if self.registry is not None and time.monotonic() >= self._next_sweep:
                # Heartbeats change no faster than this: no need to look more often.
                self._next_sweep = time.monotonic() + self.registry.heartbeat_seconds
                report.host_lost += await self._sweep_lost_hosts(self.registry)
            if self.refill_pools:
                await self._refill_pools(report)
            if self.purge:
                await anyio.to_thread.run_sync(self._purge)
            return report

    def _hosted_here(self) -> list[SandboxRow]:
        """The live sandboxes this process's provider runs: the only ones it may reap."""
        return self.sandboxes.list_live(hosted_here=True)

    def _sandboxes_with_live_leases(self) -> set[str]:
        now = self.now()
        with self.store.read() as conn:
            rows = conn.execute(
                select(bindings.c.sandbox_id)
                .join(leases, leases.c.binding_id == bindings.c.id)
                .where(
                    bindings.c.live_scope.is_not(None),
                    leases.c.released_at.is_(None),
                    leases.c.expires_at > now,
                )
                .distinct()
            ).all()
        return {r.sandbox_id for r in rows}

    async def _visit(self, row: SandboxRow, held: set[str], report: ReaperReport) -> None:
        now = self.now()
        if now >= row.hard_deadline:
            await self.sandboxes.terminate(row.id, reason="hard TTL reached")
            report.terminated.append(row.id)
            return
        if row.state is SandboxState.PROVISIONING:
            if now - row.created_at > self.settings.provision_timeout_seconds:
                await self.sandboxes.apply_state(
                    row.id, SandboxState.FAILED, reason="provisioning timed out"
                )
                report.failed.append(row.id)
            return
        if row.state is SandboxState.FAILED:
            await self.sandboxes.terminate(row.id, reason=row.reason or "failed")
            report.terminated.append(row.id)
            return
        if row.pool is not None or row.state is SandboxState.SUSPENDED:
            return
        try:
            activity = await self.provider.activity(row.id)
        except Exception:
            activity = None
        last_active = row.last_active_at
        if activity is not None and activity.last_active_at:
            last_active = max(last_active, activity.last_active_at)
        working = activity is not None and activity.busy
        if row.id in held or working:
            # A held lease is presence enough; running work is stamped now and then so
            # that the idle clock starts from the end of the work, not from its start.
            if working and now - row.last_active_at > self.TOUCH_SECONDS:
                await anyio.to_thread.run_sync(self._touch, row.id, now)
            if row.state is SandboxState.IDLE:
                await self.sandboxes.apply_state(row.id, SandboxState.ACTIVE, reason="activity")
                report.activated.append(row.id)
            return
        if row.state is SandboxState.ACTIVE:
            await self.sandboxes.apply_state(
                row.id, SandboxState.IDLE, reason="no lease, no activity"
            )
            report.idled.append(row.id)
            idle_since = now
        else:
            idle_since = row.idle_since or now
        if last_active > idle_since:
            idle_since = last_active
        if now - idle_since >= row.idle_timeout:
            await self.sandboxes.suspend(row.id, reason="idle timeout")
            if self.provider.can_suspend(row.id):
                report.suspended.append(row.id)
            else:
                report.terminated.append(row.id)

    def _touch(self, sandbox_id: str, now: float) -> None:
        with self.store.write() as conn:
            conn.execute(
                update(sandboxes).where(sandboxes.c.id == sandbox_id).values(last_active_at=now)
            )

    async def _remove_orphans(self, live: list[SandboxRow], report: ReaperReport) -> None:
        try:
            existing = await self.provider.list_sandboxes()
        except Exception:
            log.exception("provider cannot list sandboxes; orphan removal skipped")
            return
        # Re-read after listing: a sandbox created meanwhile is in the store by now.
        # Every host's count as known (ids are unique); only this host's can vanish here.
        current = await anyio.to_thread.run_sync(self.sandboxes.list_live)
        # A sandbox being torn down is no orphan: its teardown finishes it.
        ending = await anyio.to_thread.run_sync(self.sandboxes.terminating)
        known = {r.id for r in current} | {r.id for r in ending}
        for sandbox_id in sorted(existing - known):
            log.info("removing orphaned sandbox %s", sandbox_id)
            try:
                await self.provider.delete(sandbox_id)
                report.orphans_removed.append(sandbox_id)
            except Exception:
                log.exception("could not remove orphan %s", sandbox_id)
        # The other way round, only from ``live``, read before the listing: a sandbox
        # past provisioning then existed at the provider before the listing began, so
        # its absence means it vanished. One that became ready while the provider was
        # listing (a busy server's listing and re-read can be far apart) may be missing
        # from the listing only because it was created after it: no orphan.
        still_live = {r.id for r in current if r.state is not SandboxState.PROVISIONING}
        for row in live:
            if (
                row.id in existing
                or row.id not in still_live
                or row.state is SandboxState.PROVISIONING
                or not self.sandboxes.is_hosted_here(row)
            ):
                continue
            # A binding whose sandbox is gone: end it instead of handing out dead tokens.
            await self.sandboxes.apply_state(row.id, SandboxState.FAILED, reason="sandbox vanished")
            await self.sandboxes.terminate(row.id, reason="sandbox vanished")
            report.orphans_removed.append(row.id)

    async def _sweep_lost_hosts(self, registry: HostRegistry) -> list[str]:
        """Declare lapsed hosts lost and fail their sandboxes (:mod:`sandlot.broker.fleet`);
        the sandboxes this pass changed."""
        declared = await anyio.to_thread.run_sync(registry.declare_lost)
        for host in declared:
            log.warning("sandbox host %s missed its heartbeats: declared lost", host)
        pending = await anyio.to_thread.run_sync(registry.sandboxes_of_lost_hosts)
        changed = []
        for sandbox_id, state in pending:
            if await self.sandboxes.fail_with_host(sandbox_id, state):
                changed.append(sandbox_id)
        return changed

    async def _refill_pools(self, report: ReaperReport) -> None:
        deficits = await anyio.to_thread.run_sync(self.pools.deficits)
        for pool, missing in deficits:
            template = self.sandboxes.templates.get(pool.template)
            for _ in range(missing):
                try:
                    row = await anyio.to_thread.run_sync(self._insert_pooled, template, pool.name)
                except ProviderUnavailable as exc:
                    log.info("pool %s not refilled: %s", pool.name, exc.message)
                    return
                if row is None:
                    break  # another replica's reaper refilled it meanwhile
                report.pool_created.append(row.id)
                self.sandboxes.spawn(self.sandboxes.provision(row, template))

    def _insert_pooled(self, template: Template, pool: str) -> SandboxRow | None:
        """One more sandbox for ``pool``, if it still misses one (counted under the pool's
        lock, so that two replicas' reapers never both fill the same gap)."""
        with self.store.write() as conn:
            if self.pools.missing_locked(conn, pool) == 0:
                return None
            return self.sandboxes.insert(conn, template=template, owner_user_id=None, pool=pool)

    def _purge(self) -> None:
        self.idempotency.purge_expired()
        with self.store.write() as conn:
            conn.execute(delete(tokens).where(tokens.c.expires_at < self.now() - 3600))


class _suppress_cancel:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return exc_type is asyncio.CancelledError

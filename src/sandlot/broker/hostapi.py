"""Sandbox hosts that reach the store through the brokers' API.

A ``sandlot host --broker URL --key KEY`` holds no database URL. What a host with the
store does itself (:mod:`sandlot.cli.host`: register and beat in ``hosts``, re-adopt
its sandboxes, reap them, report their states, read revocations) it asks a broker to
do, through the authenticated routes of :mod:`sandlot.broker.routes.hosts`; its key
(:mod:`sandlot.broker.hostkeys`) names the host, so every call acts on that host's
row and sandboxes only.

The broker does that work with the same code as for a host with the store: the
registry (:class:`~sandlot.broker.fleet.HostRegistry`) for registration, heartbeats,
placement and loss, unchanged; and for the host's sandboxes a :class:`HostScope`, a
:class:`~sandlot.broker.sandboxes.SandboxService` and a
:class:`~sandlot.broker.reaper.Reaper` bound to that host whose provider is the host's
provider API (:class:`~sandlot.providers.remote.RemoteProvider`), as the fleet's is.

- Re-adoption: at start the host reads its live sandboxes (:meth:`HostApi.adoption`),
  re-adopts them in its own provider before it serves, then has a broker re-drive or
  fail the ones it lost and finish interrupted teardowns (:meth:`HostApi.recover`).
- Reaping: the host asks for one pass over its sandboxes every
  ``policy.reaper_interval_seconds`` (:meth:`HostApi.reap`); it waits for each answer,
  so one pass at a time runs for it, at whichever replica took the request. The pass
  asks the host's provider API for activity, suspends and deletes, as a host's own
  reaper asks its provider.
- States: the provider's status changes reach the store through
  :meth:`HostApi.report_status`, which the host retries until a broker took them.
- Revocations: the host reads them every 0.2 s (:meth:`HostApi.revocations`, its
  sandboxes' tokens and every revoked API key) and pushes them to its dataplane.
- API keys used on its dataplane (``X-Api-Key``) are checked by a broker
  (:meth:`HostApi.resolve_key`); the dataplane verifies tokens with the brokers'
  public keys (``/.well-known/jwks.json``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy import select

from sandlot.broker.events import EventHub
from sandlot.broker.fleet import HostRecord, HostRegistry, Registration
from sandlot.broker.hostkeys import HostKeyService
from sandlot.broker.idempotency import IdempotencyStore
from sandlot.broker.pools import PoolService
from sandlot.broker.reaper import Reaper
from sandlot.broker.revocations import read_revocations
from sandlot.broker.sandboxes import (
    LIVE_STATES,
    STOP_DRAIN_SECONDS,
    SandboxRow,
    SandboxService,
)
from sandlot.broker.settings import BrokerSettings
from sandlot.broker.store import Store
from sandlot.broker.store.schema import sandboxes
from sandlot.broker.templates import TemplateService
from sandlot.protocol.errors import NotSupported, ResourceConflict, SandboxNotFound
from sandlot.protocol.tokens import TOKEN_LEEWAY_SECONDS
from sandlot.providers.base import ProviderStatus
from sandlot.providers.remote import RemoteProvider

log = logging.getLogger("sandlot.broker.hostapi")


@dataclass(frozen=True)
class HostRegistrationRequest:
    """What a host says about itself when it registers (validated by the route)."""

    provider: str
    provider_url: str
    provider_secret: str
    dataplane_url: str
    capacity: int


class HostSandboxes(SandboxService):
    """The sandboxes of exactly one host (a sandbox with no host is never one of them:
    it belongs to a provider every replica reaches, not to this host)."""

    def is_hosted_here(self, row: SandboxRow) -> bool:
        return row.host is not None and row.host == self.host

    def _hosted_here(self) -> Any:
        return sandboxes.c.host == self.host


class HostScope:
    """A broker's services bound to one registered host's sandboxes."""

    def __init__(self, api: HostApi, record: HostRecord) -> None:
        assert record.provider_url is not None and record.credential is not None
        self.record = record
        self.provider = RemoteProvider(
            {
                "url": record.provider_url,
                "secret": record.credential,
                "dataplane_url": record.dataplane_url,
                "name": record.provider,
            }
        )
        self.sandboxes = HostSandboxes(
            store=api.store,
            provider=self.provider,
            settings=api.settings,
            templates=api.templates,
            hub=api.hub,
            clock=api.sandboxes.clock,
            host=record.id,
        )
        self.reaper = Reaper(
            store=api.store,
            settings=api.settings,
            sandboxes=self.sandboxes,
            pools=api.pools,
            idempotency=api.idempotency,
            hub=api.hub,
        )
        # The brokers' own reapers refill pools, purge and sweep lost hosts.
        self.reaper.refill_pools = False
        self.reaper.purge = False

    def matches(self, record: HostRecord) -> bool:
        return (record.provider_url, record.credential, record.dataplane_url) == (
            self.record.provider_url,
            self.record.credential,
            self.record.dataplane_url,
        )

    async def close(self) -> None:
        await self.sandboxes.drain(STOP_DRAIN_SECONDS)
        await self.provider.close()


class HostApi:
    """What a broker does for hosts that reach the store through its API."""

    #: Seconds a retired scope is kept for the calls through it (each ends within 30 s).
    RETIRE_SECONDS = 60.0

    def __init__(
        self,
        *,
        store: Store,
        settings: BrokerSettings,
        registry: HostRegistry | None,
        sandboxes: SandboxService,
        templates: TemplateService,
        pools: PoolService,
        idempotency: IdempotencyStore,
        hub: EventHub,
    ) -> None:
        """The broker's own services; ``sandboxes``: its service (for reads and clock)."""
        self.store = store
        self.settings = settings
        self._registry = registry
        self.sandboxes = sandboxes
        self.templates = templates
        self.pools = pools
        self.idempotency = idempotency
        self.hub = hub
        self.keys = HostKeyService(store)
        self._scopes: dict[str, HostScope] = {}
        #: Scopes of hosts that registered again with another address or secret, and
        #: when: closed :data:`RETIRE_SECONDS` later (calls through them may be running).
        self._retired: list[tuple[float, HostScope]] = []
        self._retiring = threading.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def registry(self) -> HostRegistry:
        if self._registry is None:
            raise NotSupported(
                "sandbox hosts register with brokers on a server store (PostgreSQL); "
                "this broker runs on SQLite"
            )
        return self._registry

    def settings_for(self, host_id: str) -> dict[str, Any]:
        """What a host needs from the brokers' configuration."""
        s = self.settings
        record = self.registry.get(host_id)
        return {
            "host_id": host_id,
            "issuer": s.issuer,
            "heartbeat_seconds": s.host_heartbeat_seconds,
            "lost_after_seconds": s.host_lost_after_seconds,
            "reaper_interval_seconds": s.reaper_interval_seconds,
            "state": record.state if record is not None else None,
        }

    # --- registration and heartbeats (the registry, unchanged) -------------------------

    def register(self, host_id: str, req: HostRegistrationRequest) -> bool:
        """Record the host ``up`` with its provider API and capacity; True if it had been
        declared lost."""
        return self.registry.register(
            Registration(
                host_id=host_id,
                provider=req.provider,
                dataplane_url=req.dataplane_url,
                capacity=req.capacity,
                provider_url=req.provider_url,
                credential=req.provider_secret,
            )
        )

    def heartbeat(self, host_id: str, capacity: int | None) -> str | None:
        return self.registry.heartbeat(host_id, capacity)

    # --- the host's sandboxes -------------------------------------------------------

    def scope(self, host_id: str) -> HostScope:
        record = self.registry.get(host_id)
        if record is None or record.provider_url is None or record.credential is None:
            raise ResourceConflict(
                f"host {host_id} is not registered: register first",
                metadata={"reason": "not_registered"},
            )
        with self._retiring:
            scope = self._scopes.get(host_id)
            if scope is None or not scope.matches(record):
                if scope is not None:
                    self._retired.append((time.monotonic(), scope))
                scope = HostScope(self, record)
                self._scopes[host_id] = scope
        return scope

    async def _scope(self, host_id: str, check: Callable[[], Any] | None = None) -> HostScope:
        """:meth:`scope` off the event loop (after ``check``), and the scopes retired long
        enough ago closed."""

        def find() -> HostScope:
            if check is not None:
                check()
            return self.scope(host_id)

        scope = await anyio.to_thread.run_sync(find)
        with self._retiring:
            now = time.monotonic()
            done = [s for t, s in self._retired if now - t > self.RETIRE_SECONDS]
            self._retired = [(t, s) for t, s in self._retired if now - t <= self.RETIRE_SECONDS]
        for old in done:  # in the background: a close waits for its calls to end
            task = asyncio.get_running_loop().create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return scope

    def adoption(self, host_id: str) -> list[dict[str, Any]]:
        """The host's sandboxes the store believes live, for its provider to re-adopt."""
        with self.store.read() as conn:
            rows = [
                SandboxRow.from_row(r)
                for r in conn.execute(
                    select(sandboxes).where(
                        sandboxes.c.host == host_id, sandboxes.c.state.in_(LIVE_STATES)
                    )
                ).all()
            ]
        out = []
        for row in rows:
            try:
                template = self.templates.get(row.template)
            except Exception:
                template = None  # failed by recover (the reaper's rule)
            out.append(
                {
                    "sandbox_id": row.id,
                    "generation": row.generation,
                    "template": template.model_dump(mode="json") if template else None,
                    "state": row.state.value,
                    "provider": row.provider,
                }
            )
        return out

    async def recover(self, host_id: str, lost: Collection[str]) -> list[str]:
        """After the host re-adopted its sandboxes: re-drive or fail the ones it lost,
        record where the rest answer, finish interrupted teardowns."""
        scope = await self._scope(host_id)
        return await scope.reaper.recover(lost_ids=lost)

    async def reap(self, host_id: str) -> dict[str, list[str]]:
        """One reaper pass over the host's sandboxes (idleness, TTLs, teardowns, orphans)."""
        scope = await self._scope(host_id)
        report = await scope.reaper.run_once()
        return {k: v for k, v in vars(report).items() if v}

    async def report_status(self, host_id: str, sandbox_id: str, status: ProviderStatus) -> bool:
        """A state the host's provider reported for one of its sandboxes; True if recorded
        (False: already there, or a transition the sandbox no longer allows)."""

        def check() -> None:
            with self.store.read() as conn:
                row = conn.execute(
                    select(sandboxes.c.host, sandboxes.c.state).where(sandboxes.c.id == sandbox_id)
                ).first()
            if row is None or row.host != host_id:
                raise SandboxNotFound(f"no sandbox {sandbox_id} on host {host_id}")

        scope = await self._scope(host_id, check)
        return await scope.sandboxes.apply_state(sandbox_id, status.state, reason=status.reason)

    def revocations(self, host_id: str, *, since: float, keys_since: float) -> dict[str, Any]:
        """Tokens of the host's sandboxes revoked since ``since`` and API keys revoked since
        ``keys_since`` (with the host's live sandboxes, where keys go)."""
        found = read_revocations(
            self.store,
            since=since,
            keys_since=keys_since,
            now=self.sandboxes.clock() - TOKEN_LEEWAY_SECONDS,
            host=host_id,
        )
        return {
            "tokens": [
                {
                    "jti": r.jti,
                    "sandbox_id": r.sandbox_id,
                    "expires_at": r.expires_at,
                    "revoked_at": r.revoked_at,
                }
                for r in found.tokens
            ],
            "keys": [{"id": k.id, "revoked_at": k.revoked_at} for k in found.keys],
            "live": found.live,
        }

    def owns(self, host_id: str, sandbox_id: str) -> bool:
        with self.store.read() as conn:
            row = conn.execute(
                select(sandboxes.c.host).where(
                    sandboxes.c.id == sandbox_id, sandboxes.c.state.in_(LIVE_STATES)
                )
            ).first()
        return row is not None and row.host == host_id

    async def close(self) -> None:
        scopes = [*self._scopes.values(), *(s for _, s in self._retired)]
        self._scopes.clear()
        self._retired.clear()
        await asyncio.gather(*(s.close() for s in scopes), *self._closing, return_exceptions=True)

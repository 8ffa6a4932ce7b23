"""The broker: its services wired together, started and stopped as one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sandlot.broker import failpoints
from sandlot.broker.audit import AuditLog
from sandlot.broker.events import EventHub, EventReconciler, StoreListener
from sandlot.broker.fleet import FleetProvider, HostHeartbeat, HostRegistry, Registration
from sandlot.broker.hostapi import HostApi
from sandlot.broker.hosts import host_id
from sandlot.broker.idempotency import IdempotencyStore
from sandlot.broker.keys import KeyService
from sandlot.broker.leases import LeaseService
from sandlot.broker.pools import PoolService
from sandlot.broker.ratelimit import RateLimiter, SharedRateLimiter
from sandlot.broker.reaper import Reaper
from sandlot.broker.revocations import RevocationWatcher
from sandlot.broker.sandboxes import STOP_DRAIN_SECONDS, SandboxService
from sandlot.broker.scopes import MemberService
from sandlot.broker.sessions import SessionService
from sandlot.broker.settings import BrokerSettings, ConfigError
from sandlot.broker.store import Store
from sandlot.broker.templates import TemplateService, VolumeService
from sandlot.broker.tokens import KeyRing
from sandlot.providers.base import Provider

log = logging.getLogger("sandlot.broker")


def prepare_store(settings: BrokerSettings) -> Store:
    """Migrate the store and write the configured templates, pools and first signing key.

    Run once before worker processes start, so they never race on set-up.
    """
    store = Store(settings.resolved_store_url)
    store.migrate()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    templates = TemplateService(store)
    templates.sync_config(settings.templates)
    PoolService(store, templates).sync_config(settings.pools)
    KeyRing(store, issuer=settings.issuer, max_token_ttl=settings.token_ttl_seconds).ensure_key()
    return store


class Broker:
    def __init__(
        self,
        settings: BrokerSettings,
        provider: Provider | None,
        *,
        store: Store | None = None,
        clock: Callable[[], float] = time.time,
        run_reaper: bool = True,
        provider_api: tuple[str, str] | None = None,
    ) -> None:
        """``provider``: None with ``hosts.mode = "registered"`` (the registered hosts'
        providers, reached through :class:`FleetProvider`). ``provider_api``: where other
        processes reach this process's provider and the credential it asks for (a
        ``sandlot host``, a replica on a server store), registered with its host."""
        self.settings = settings
        self.store = store or Store(settings.resolved_store_url)
        self.hub = EventHub()
        self.templates = TemplateService(self.store)
        self.volumes = VolumeService(self.store, settings.max_volumes_per_user)
        self.pools = PoolService(self.store, self.templates)
        self.keys = KeyService(self.store, settings.admins)
        self.keyring = KeyRing(
            self.store, issuer=settings.issuer, max_token_ttl=settings.token_ttl_seconds
        )
        self.audit = AuditLog(self.store)
        self.idempotency = IdempotencyStore(self.store, settings.idempotency_ttl_seconds)
        rate, burst = settings.negotiation_rate_per_second, settings.negotiation_burst
        # Replicas on PostgreSQL share their buckets; one server's (SQLite) are its own.
        self.ratelimit = (
            SharedRateLimiter(self.store, rate, burst)
            if self.store.dialect == "postgresql"
            else RateLimiter(rate, burst)
        )
        #: Sandbox hosts register and beat in a server store (one SQLite store is one machine).
        self.hosts = (
            None
            if self.store.dialect == "sqlite"
            else HostRegistry(
                self.store,
                heartbeat_seconds=settings.host_heartbeat_seconds,
                lost_after_seconds=settings.host_lost_after_seconds,
            )
        )
        registered = settings.sandbox_hosts == "registered"
        places = settings.sandbox_hosts in ("registered", "mixed")
        if places and self.hosts is None:
            raise ConfigError(
                f"hosts.mode = {settings.sandbox_hosts!r} needs a server store (PostgreSQL)"
            )
        #: The other hosts' provider APIs (to act on the sandboxes they run).
        self.remote = FleetProvider(self.hosts) if self.hosts is not None else None
        if provider is None:
            if self.remote is None or not registered:
                raise ConfigError("a broker without registered hosts needs a provider")
            provider = self.remote
        elif places and not provider.host_bound:
            raise ConfigError(
                "hosts.mode = 'mixed' needs a provider that runs sandboxes on this machine"
                f" (not {provider.name!r}): use 'registered' or 'embedded'"
            )
        self.provider: Provider = provider
        self.sandboxes = SandboxService(
            store=self.store,
            provider=provider,
            settings=settings,
            templates=self.templates,
            hub=self.hub,
            clock=clock,
            # One SQLite store is one machine's; replicas share a server database.
            host=None if self.store.dialect == "sqlite" else host_id(settings.data_dir),
            fleet=self.hosts if places else None,
            remote=self.remote,
        )
        self.sessions = SessionService(
            store=self.store,
            settings=settings,
            keyring=self.keyring,
            sandboxes=self.sandboxes,
            templates=self.templates,
            hub=self.hub,
        )
        self.leases = LeaseService(
            store=self.store,
            settings=settings,
            sandboxes=self.sandboxes,
            sessions=self.sessions,
            hub=self.hub,
        )
        self.members = MemberService(self.store, self.sandboxes.clock)
        self.reaper = Reaper(
            store=self.store,
            settings=settings,
            sandboxes=self.sandboxes,
            pools=self.pools,
            idempotency=self.idempotency,
            hub=self.hub,
            registry=self.hosts,
        )
        #: This process's own host, registered while it serves (it runs sandboxes).
        self.heartbeat: HostHeartbeat | None = None
        if self.hosts is not None and self.sandboxes.host is not None and not registered:
            self.heartbeat = HostHeartbeat(
                self.hosts,
                Registration(
                    host_id=self.sandboxes.host,
                    provider=provider.name,
                    dataplane_url=settings.dataplane_url or settings.base_url,
                    capacity=settings.host_capacity,
                    provider_url=provider_api[0] if provider_api else None,
                    credential=provider_api[1] if provider_api else None,
                ),
            )
        #: What this broker does for hosts that reach the store through its API.
        self.host_api = HostApi(
            store=self.store,
            settings=settings,
            registry=self.hosts,
            sandboxes=self.sandboxes,
            templates=self.templates,
            pools=self.pools,
            idempotency=self.idempotency,
            hub=self.hub,
        )
        self.revocations = RevocationWatcher(self.store, provider, clock)
        #: Other processes' events, on a store that can tell (PostgreSQL).
        self.listener = (
            StoreListener(self.store.url, self.hub) if self.store.dialect == "postgresql" else None
        )
        #: The reconciling read of this process's event subscribers.
        self.reconciler = EventReconciler(self.store, self.hub)
        self.run_reaper = run_reaper
        self.started = False
        failpoints.arm(settings.failpoints)

    async def start(self, *, migrate: bool = True, recover: bool = True) -> None:
        """Start serving; ``recover=False`` for worker processes that own no sandboxes."""
        self.hub.bind_loop(asyncio.get_running_loop())
        if self.listener is not None:
            self.listener.start()
        self.reconciler.start()
        if migrate:
            await asyncio.to_thread(self._prepare)
        else:
            await asyncio.to_thread(self.keyring.reload)
        await self.provider.start(self.sandboxes.on_provider_status)
        if recover and self.heartbeat is not None:
            await self.heartbeat.register()
            self.heartbeat.start()
        if recover and self.settings.sandbox_hosts == "registered":
            # The hosts run, re-adopt and revoke for their own sandboxes.
            recover = False
        if recover:
            await self.reaper.recover()
            # The process that serves the sandboxes pushes every revocation to them,
            # whichever process recorded it (a worker, ``sandlot keys revoke``).
            await self.revocations.run_once()
            self.revocations.start()
        if self.run_reaper:
            self.reaper.start()
        self.started = True

    def _prepare(self) -> None:
        self.store.migrate()
        self.templates.sync_config(self.settings.templates)
        self.pools.sync_config(self.settings.pools)
        self.keyring.ensure_key()

    async def stop(self) -> None:
        await self.reconciler.stop()
        if self.listener is not None:
            await asyncio.to_thread(self.listener.stop)
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        await self.revocations.stop()
        await self.reaper.stop()
        await self.sessions.pool_claims.close()
        await self.host_api.close()
        await self.sandboxes.drain(STOP_DRAIN_SECONDS)
        await self.provider.close()
        if self.remote is not None and self.remote is not self.provider:
            await self.remote.close()
        self.store.dispose()
        self.started = False

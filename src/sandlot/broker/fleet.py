"""Sandbox hosts in a fleet: registration, heartbeats, placement and loss.

On a server store (PostgreSQL) every process that runs sandboxes registers its host
(:mod:`sandlot.broker.hosts`) in the ``hosts`` table and stamps a heartbeat every
``hosts.heartbeat_seconds``: a ``sandlot host`` process, a replica's embedded host, the
sandbox host of ``--workers``. A ``sandlot host`` also records where brokers reach its
provider API (:func:`sandlot.providers.remote.provider_router`) and the credential it
asks for; an embedded host records none, and only its own process uses it.

Placement (brokers with ``hosts.mode = "registered"``), one rule: among the hosts that
are ``up``, have a provider API, beat within the last three heartbeats, and run the
requested provider (``provider_preference``, unless ``auto``), the one with the most
free slots (``capacity`` minus its sandboxes that are live or terminating); ties go to
the smallest host id. No such host: ``503 PROVIDER_UNAVAILABLE`` (retryable, ``metadata
.reason = "no_capacity"``). Placements are serialized by a transaction-level advisory
lock, so two replicas never both fill a host's last slot.

Heartbeats and their ages are read on the database's clock, so the clocks of hosts and
brokers need not agree.

Loss: a host whose heartbeat is older than ``hosts.lost_after_seconds`` is declared
``lost`` by one conditional update (whichever replica's reaper gets there first; the
others' updates change nothing). Every reaper pass then fails the live sandboxes of
lost hosts (``reason = "host_lost"``), each by a conditional transition, so each
failure and its events happen once; a teardown that was under way is recorded as
finished. A host that comes back marks itself ``up`` again, re-adopts the sandboxes
still live in the store, and its reaper removes the ones that were failed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from sqlalchemy import Connection, Float, cast, func, select, update
from sqlalchemy.exc import IntegrityError

from sandlot.broker.store import Store
from sandlot.broker.store.schema import hosts, sandboxes
from sandlot.protocol.errors import ProviderUnavailable, SandboxNotFound
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxActivity
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import AdoptionRecord, Provider, ProviderStatus, SandboxSpec
from sandlot.providers.remote import RemoteProvider, dataplane_coordinates

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("sandlot.broker.fleet")

HOST_UP = "up"
HOST_LOST = "lost"
#: The reason a sandbox of a lost host fails with (its phase events carry it).
HOST_LOST_REASON = "host_lost"
#: Sandboxes that take a slot on their host.
_OCCUPYING = [s.value for s in SandboxState if s.live] + [SandboxState.TERMINATING.value]
_LIVE = [s.value for s in SandboxState if s.live]
#: The database's time (PostgreSQL), in seconds since the epoch.
_DB_NOW = select(cast(func.extract("epoch", func.now()), Float))
#: A host is placed on while its last heartbeat is at most this many heartbeats old.
PLACEABLE_HEARTBEATS = 3.0


@dataclass(frozen=True)
class HostRecord:
    id: str
    provider: str
    provider_url: str | None
    credential: str | None
    dataplane_url: str
    capacity: int
    state: str
    started_at: float
    heartbeat_at: float
    lost_at: float | None

    @classmethod
    def from_row(cls, r: Any) -> HostRecord:
        return cls(
            id=r.id,
            provider=r.provider,
            provider_url=r.provider_url,
            credential=r.credential,
            dataplane_url=r.dataplane_url,
            capacity=r.capacity,
            state=r.state,
            started_at=r.started_at,
            heartbeat_at=r.heartbeat_at,
            lost_at=r.lost_at,
        )


@dataclass(frozen=True)
class Registration:
    """What a process that runs sandboxes says about its host."""

    host_id: str
    provider: str
    dataplane_url: str
    capacity: int
    #: Where brokers reach its provider API, and the secret it asks for (``sandlot host``).
    provider_url: str | None = None
    credential: str | None = None


class HostRegistry:
    """The ``hosts`` table: registration, heartbeats, placement, loss."""

    def __init__(
        self,
        store: Store,
        *,
        heartbeat_seconds: float,
        lost_after_seconds: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: a fixed clock for tests; else the database's (its transaction time)."""
        self.store = store
        self.heartbeat_seconds = heartbeat_seconds
        self.lost_after_seconds = lost_after_seconds
        self.clock = clock

    def _now(self, conn: Connection) -> float:
        if self.clock is not None:
            return self.clock()
        if self.store.dialect == "postgresql":
            return float(conn.execute(_DB_NOW).scalar_one())
        return time.time()

    # --- a host's own side ---------------------------------------------------------

    def register(self, reg: Registration) -> bool:
        """Record the host as ``up`` now; True if it had been declared lost."""
        values: dict[str, Any] = {
            "provider": reg.provider,
            "provider_url": reg.provider_url,
            "credential": reg.credential,
            "dataplane_url": reg.dataplane_url,
            "capacity": reg.capacity,
            "state": HOST_UP,
            "lost_at": None,
        }
        for _ in range(3):
            with self.store.write() as conn:
                now = self._now(conn)
                values.update(started_at=now, heartbeat_at=now)
                was = conn.execute(select(hosts.c.state).where(hosts.c.id == reg.host_id)).first()
                if was is not None:
                    conn.execute(update(hosts).where(hosts.c.id == reg.host_id).values(**values))
                    return bool(was.state == HOST_LOST)
                try:
                    with conn.begin_nested():
                        conn.execute(hosts.insert().values(id=reg.host_id, **values))
                except IntegrityError:
                    continue  # registered at the same instant by another process of the host
                return False
        return False

    def heartbeat(self, host_id: str, capacity: int | None = None) -> str | None:
        """Stamp the host's heartbeat (and mark it ``up``; ``capacity``: as it reports it
        now); its state before (None: unknown)."""
        with self.store.write() as conn:
            now = self._now(conn)
            was = conn.execute(select(hosts.c.state).where(hosts.c.id == host_id)).first()
            if was is None:
                return None
            values: dict[str, Any] = {"heartbeat_at": now, "state": HOST_UP, "lost_at": None}
            if capacity is not None:
                values["capacity"] = capacity
            conn.execute(update(hosts).where(hosts.c.id == host_id).values(**values))
            return str(was.state)

    # --- brokers' side ---------------------------------------------------------------

    def get(self, host_id: str) -> HostRecord | None:
        with self.store.read() as conn:
            row = conn.execute(select(hosts).where(hosts.c.id == host_id)).first()
        return HostRecord.from_row(row) if row is not None else None

    def all(self) -> list[HostRecord]:
        with self.store.read() as conn:
            rows = conn.execute(select(hosts).order_by(hosts.c.id)).all()
        return [HostRecord.from_row(r) for r in rows]

    def place(
        self, conn: Connection, *, provider: str | None = None, exclude: Sequence[str] = ()
    ) -> HostRecord:
        """The host a new sandbox goes to, by the module's rule (the caller's transaction),
        never one of ``exclude`` (hosts a creation could not reach).

        The lock is held to the end of the caller's transaction, which inserts the
        sandbox row: the next placement counts it.
        """
        self.store.serialize(conn, "sandlot:placement")
        now = self._now(conn)
        fresh = now - PLACEABLE_HEARTBEATS * self.heartbeat_seconds
        query = select(hosts).where(
            hosts.c.state == HOST_UP,
            hosts.c.provider_url.is_not(None),
            hosts.c.heartbeat_at >= fresh,
        )
        if provider is not None:
            query = query.where(hosts.c.provider == provider)
        if exclude:
            query = query.where(hosts.c.id.not_in(list(exclude)))
        candidates = [HostRecord.from_row(r) for r in conn.execute(query).all()]
        if not candidates:
            raise ProviderUnavailable(
                "no sandbox host is available"
                + (f" for provider {provider!r}" if provider else "")
                + ", retry later",
                metadata={"reason": "no_host", "provider": provider},
            )
        rows = conn.execute(
            select(sandboxes.c.host, func.count())
            .where(
                sandboxes.c.host.in_([h.id for h in candidates]),
                sandboxes.c.state.in_(_OCCUPYING),
            )
            .group_by(sandboxes.c.host)
        ).all()
        used: dict[str, int] = {str(host): int(count) for host, count in rows}
        free = {h.id: h.capacity - int(used.get(h.id, 0)) for h in candidates}
        best = min(candidates, key=lambda h: (-free[h.id], h.id))
        if free[best.id] <= 0:
            raise ProviderUnavailable(
                "every sandbox host is full, retry later",
                metadata={"reason": "no_capacity", "hosts": len(candidates)},
            )
        return best

    def declare_lost(self) -> list[str]:
        """Declare ``lost`` the hosts whose heartbeat lapsed; the ids this call declared."""
        declared: list[str] = []
        # A read first: most passes find nothing to declare and write nothing.
        with self.store.read() as conn:
            cutoff = self._now(conn) - self.lost_after_seconds
            lapsed = conn.execute(
                select(hosts.c.id).where(hosts.c.state == HOST_UP, hosts.c.heartbeat_at < cutoff)
            ).all()
        if not lapsed:
            return declared
        with self.store.write() as conn:
            now = self._now(conn)
            cutoff = now - self.lost_after_seconds
            for row in lapsed:
                changed = conn.execute(
                    update(hosts)
                    .where(
                        hosts.c.id == row.id,
                        hosts.c.state == HOST_UP,
                        hosts.c.heartbeat_at < cutoff,
                    )
                    .values(state=HOST_LOST, lost_at=now)
                ).rowcount
                if changed:
                    declared.append(str(row.id))
        return declared

    def sandboxes_of_lost_hosts(self) -> list[tuple[str, SandboxState]]:
        """Sandboxes still live or terminating on hosts declared lost."""
        with self.store.read() as conn:
            rows = conn.execute(
                select(sandboxes.c.id, sandboxes.c.state)
                .join(hosts, hosts.c.id == sandboxes.c.host)
                .where(hosts.c.state == HOST_LOST, sandboxes.c.state.in_(_OCCUPYING))
                .order_by(sandboxes.c.id)
            ).all()
        return [(str(r.id), SandboxState(r.state)) for r in rows]


class HostHeartbeat:
    """A process's registration and heartbeat loop."""

    def __init__(self, registry: HostRegistry, registration: Registration) -> None:
        self.registry = registry
        self.registration = registration
        self._task: asyncio.Task[None] | None = None

    async def register(self) -> None:
        was_lost = await anyio.to_thread.run_sync(self.registry.register, self.registration)
        if was_lost:
            log.warning(
                "this sandbox host (%s) had been declared lost: its sandboxes failed and are "
                "removed by the reaper",
                self.registration.host_id,
            )

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.registry.heartbeat_seconds)
            try:
                was = await anyio.to_thread.run_sync(
                    self.registry.heartbeat, self.registration.host_id
                )
                if was is None:
                    await self.register()
                elif was == HOST_LOST:
                    log.warning(
                        "this sandbox host (%s) was declared lost meanwhile: its sandboxes "
                        "failed and are removed by the reaper",
                        self.registration.host_id,
                    )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("heartbeat of sandbox host %s failed", self.registration.host_id)


class FleetProvider(Provider):
    """The provider of brokers that place sandboxes on registered hosts: each call goes to
    the provider API of the sandbox's host (a :class:`RemoteProvider` per host)."""

    name = "fleet"
    supports_suspend = True
    host_bound = False
    #: Seconds a host's record (URL, credential) is reused before it is read again.
    RECORD_TTL = 2.0
    #: Seconds a host's client is kept once replaced (each call ends within 30 s).
    RETIRE_SECONDS = 60.0

    def __init__(self, registry: HostRegistry) -> None:
        super().__init__({})
        self.registry = registry
        self._records: dict[str, tuple[float, HostRecord | None]] = {}
        self._clients: dict[tuple[str, str, str], RemoteProvider] = {}
        #: Clients of a host's registration before its last, and when they were replaced.
        self._retired: list[tuple[float, RemoteProvider]] = []

    def _record(self, host_id: str) -> HostRecord | None:
        now = time.monotonic()
        cached = self._records.get(host_id)
        if cached is not None and now - cached[0] < self.RECORD_TTL:
            return cached[1]
        record = self.registry.get(host_id)
        self._records[host_id] = (now, record)
        return record

    def _host_of(self, sandbox_id: str) -> str:
        with self.registry.store.read() as conn:
            row = conn.execute(select(sandboxes.c.host).where(sandboxes.c.id == sandbox_id)).first()
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        if row.host is None:
            raise ProviderUnavailable(f"sandbox {sandbox_id} has no registered host")
        return str(row.host)

    async def _for(self, sandbox_id: str) -> RemoteProvider:
        def find() -> HostRecord:
            host = self._host_of(sandbox_id)
            record = self._record(host)
            if record is None or record.provider_url is None or record.credential is None:
                raise ProviderUnavailable(
                    f"the host of sandbox {sandbox_id} serves no provider API",
                    metadata={"host": host},
                )
            return record

        record = await anyio.to_thread.run_sync(find)
        assert record.provider_url is not None and record.credential is not None
        key = (record.id, record.provider_url, record.credential)
        client = self._clients.get(key)
        if client is None:
            # The host registered again with another address or secret: its client
            # before is closed once the calls through it are over.
            now = time.monotonic()
            for old in [k for k in self._clients if k[0] == record.id]:
                self._retired.append((now, self._clients.pop(old)))
            client = RemoteProvider(
                {
                    "url": record.provider_url,
                    "secret": record.credential,
                    "dataplane_url": record.dataplane_url,
                    "name": record.provider,
                }
            )
            self._clients[key] = client
        if self._retired and time.monotonic() - self._retired[0][0] > self.RETIRE_SECONDS:
            done = [c for t, c in self._retired if time.monotonic() - t > self.RETIRE_SECONDS]
            self._retired = [(t, c) for t, c in self._retired if c not in done]
            await asyncio.gather(*(c.close() for c in done), return_exceptions=True)
        return client

    async def close(self) -> None:
        for client in [*self._clients.values(), *(c for _, c in self._retired)]:
            await client.close()
        self._clients.clear()
        self._retired.clear()

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        return await (await self._for(spec.sandbox_id)).create(spec)

    async def status(self, sandbox_id: str) -> ProviderStatus:
        return await (await self._for(sandbox_id)).status(sandbox_id)

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        return await (await self._for(sandbox_id)).suspend(sandbox_id)

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        return await (await self._for(sandbox_id)).resume(sandbox_id)

    async def delete(self, sandbox_id: str) -> None:
        await (await self._for(sandbox_id)).delete(sandbox_id)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        # Brokers read the coordinates their placement recorded; this is the fallback.
        record = self._record(self._host_of(sandbox_id))
        if record is None:
            raise ProviderUnavailable(f"the host of sandbox {sandbox_id} is not registered")
        return dataplane_coordinates(record.dataplane_url, sandbox_id)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        await (await self._for(sandbox_id)).revoke(sandbox_id, tokens)

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        return await (await self._for(sandbox_id)).activity(sandbox_id)

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        # Each host re-adopts its own sandboxes.
        return []

    async def list_sandboxes(self) -> set[str]:
        # Each host's reaper removes its own orphans.
        return set()

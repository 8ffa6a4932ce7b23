"""Warm pools: ready sandboxes per template, claimed by ``ensure``, refilled by the reaper."""

from __future__ import annotations

import builtins
from collections.abc import Mapping

from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from sandlot.broker.sandboxes import LIVE_STATES
from sandlot.broker.store import Store
from sandlot.broker.store.schema import pools, sandboxes
from sandlot.broker.templates import TemplateService
from sandlot.protocol.errors import InvalidRequest, ResourceConflict, ResourceNotFound
from sandlot.protocol.sessions import Pool, PoolSnapshot
from sandlot.protocol.states import SandboxState


class PoolService:
    def __init__(self, store: Store, templates: TemplateService) -> None:
        self.store = store
        self.templates = templates

    def sync_config(self, configured: Mapping[str, Pool]) -> None:
        insert = pg_insert if self.store.dialect == "postgresql" else sqlite_insert
        with self.store.write() as conn:
            for pool in configured.values():
                stmt = insert(pools).values(**pool.model_dump(), source="config")
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["name"],
                        set_={
                            "template": stmt.excluded.template,
                            "min_ready": stmt.excluded.min_ready,
                            "max_ready": stmt.excluded.max_ready,
                            "source": "config",
                        },
                    )
                )

    def list(self) -> list[PoolSnapshot]:
        with self.store.read() as conn:
            rows = conn.execute(select(pools).order_by(pools.c.name)).all()
            counts = {
                (r.pool, r.state): r.n
                for r in conn.execute(
                    select(sandboxes.c.pool, sandboxes.c.state, func.count().label("n"))
                    .where(sandboxes.c.pool.is_not(None), sandboxes.c.state.in_(LIVE_STATES))
                    .group_by(sandboxes.c.pool, sandboxes.c.state)
                )
            }
        return [
            PoolSnapshot(
                name=r.name,
                template=r.template,
                min_ready=r.min_ready,
                max_ready=r.max_ready,
                ready=counts.get((r.name, SandboxState.ACTIVE.value), 0),
                provisioning=counts.get((r.name, SandboxState.PROVISIONING.value), 0),
            )
            for r in rows
        ]

    def get(self, name: str) -> PoolSnapshot:
        for p in self.list():
            if p.name == name:
                return p
        raise ResourceNotFound(f"no pool {name!r}")

    def create(self, pool: Pool) -> PoolSnapshot:
        self.templates.get(pool.template)
        with self.store.write() as conn:
            # Its name and its template's: each has at most one pool, whichever replica asks.
            self.store.serialize(conn, "sandlot:pools")
            if conn.execute(select(pools.c.name).where(pools.c.name == pool.name)).first():
                raise ResourceConflict(f"pool {pool.name!r} already exists")
            same_template = conn.execute(
                select(pools.c.name).where(pools.c.template == pool.template)
            ).first()
            if same_template is not None:
                raise InvalidRequest(
                    f"template {pool.template!r} already has pool {same_template.name!r}"
                )
            conn.execute(pools.insert().values(**pool.model_dump(), source="api"))
        return self.get(pool.name)

    def delete(self, name: str) -> builtins.list[str]:
        """Delete the pool; returns the ids of its unclaimed sandboxes (to terminate)."""
        with self.store.write() as conn:
            if conn.execute(delete(pools).where(pools.c.name == name)).rowcount == 0:
                raise ResourceNotFound(f"no pool {name!r}")
            rows = conn.execute(
                select(sandboxes.c.id).where(
                    sandboxes.c.pool == name, sandboxes.c.state.in_(LIVE_STATES)
                )
            ).all()
        return [r.id for r in rows]

    def missing_locked(self, conn: Connection, name: str) -> int:
        """How many sandboxes pool ``name`` is missing, its row locked until ``conn``'s
        transaction ends (PostgreSQL; SQLite's write transaction excludes the others):
        replicas refilling at once count one after the other, each seeing the sandboxes
        the other inserted."""
        row = conn.execute(
            select(pools.c.min_ready, pools.c.max_ready)
            .where(pools.c.name == name)
            .with_for_update()
        ).first()
        if row is None:
            return 0
        have = conn.execute(
            select(func.count())
            .select_from(sandboxes)
            .where(
                sandboxes.c.pool == name,
                sandboxes.c.state.in_([SandboxState.ACTIVE.value, SandboxState.PROVISIONING.value]),
            )
        ).scalar_one()
        return _missing(int(row.min_ready), int(row.max_ready), int(have))

    def deficits(self) -> builtins.list[tuple[Pool, int]]:
        """How many sandboxes each pool is missing to reach ``min_ready``."""
        out = []
        for snap in self.list():
            missing = _missing(snap.min_ready, snap.max_ready, snap.ready + snap.provisioning)
            if missing:
                fields = {"name", "template", "min_ready", "max_ready"}
                out.append((Pool(**snap.model_dump(include=fields)), missing))
        return out


def _missing(min_ready: int, max_ready: int, have: int) -> int:
    """Sandboxes a pool lacks, ready and provisioning ones counted as ``have``."""
    return max(0, min(min_ready, max_ready) - have)

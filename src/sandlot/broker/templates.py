"""Templates and volumes: what a sandbox is made from, kept in the store.

Templates of the configuration are written to the store at start (source
``config``); templates created through the API have source ``api``. Reads go
through a short-lived cache because every negotiation that creates a sandbox
needs its template.

A template that does not say how much disk its sandboxes get
(``resources.disk_mb``) gets :data:`DEFAULT_DISK_MB`: no sandbox may fill the
host's filesystem unless a template asks for that much room.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from pydantic import ValidationError
from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from sandlot.broker.store import Store
from sandlot.broker.store.schema import templates, volumes
from sandlot.protocol.common import rfc3339
from sandlot.protocol.errors import (
    InvalidRequest,
    QuotaExceeded,
    ResourceConflict,
    ResourceNotFound,
)
from sandlot.protocol.sessions import Template, Volume

log = logging.getLogger("sandlot.broker.templates")

#: ``resources.disk_mb`` of a template that names none (the shipped ``default`` has the same).
DEFAULT_DISK_MB = 1024


def with_disk_limit(tpl: Template) -> Template:
    """``tpl`` with :data:`DEFAULT_DISK_MB` if it sets no disk limit of its own."""
    if tpl.resources.disk_mb is not None:
        return tpl
    resources = tpl.resources.model_copy(update={"disk_mb": DEFAULT_DISK_MB})
    return tpl.model_copy(update={"resources": resources})


class TemplateService:
    CACHE_SECONDS = 2.0

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, Template] = {}
        #: Stored templates this version refuses, and why (said when one is asked for).
        self._invalid: dict[str, str] = {}
        self._cached_at = 0.0
        self._lock = threading.Lock()

    def sync_config(self, configured: Mapping[str, Template]) -> None:
        """Write the configuration's templates to the store (they win over older copies)."""
        now = time.time()
        insert = pg_insert if self.store.dialect == "postgresql" else sqlite_insert
        with self.store.write() as conn:
            for tpl in map(with_disk_limit, configured.values()):
                stmt = insert(templates).values(
                    name=tpl.name,
                    spec=tpl.model_dump(mode="json"),
                    source="config",
                    created_at=now,
                )
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["name"],
                        set_={"spec": stmt.excluded.spec, "source": "config"},
                    )
                )
        self._invalidate()

    def _invalidate(self) -> None:
        with self._lock:
            self._cached_at = 0.0

    def _load(self) -> dict[str, Template]:
        if time.monotonic() - self._cached_at < self.CACHE_SECONDS:
            return self._cache
        with self.store.read() as conn:
            rows = conn.execute(select(templates)).all()
        loaded: dict[str, Template] = {}
        invalid: dict[str, str] = {}
        for r in rows:
            try:
                loaded[r.name] = with_disk_limit(Template.model_validate(r.spec))
            except ValidationError as exc:
                # Stored by a version that allowed it: the others stay usable.
                invalid[r.name] = "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3]
                )
        if invalid.keys() != self._invalid.keys():
            for name, why in invalid.items():
                log.warning("stored template %r is no longer valid (%s)", name, why)
        with self._lock:
            self._cache = loaded
            self._invalid = invalid
            self._cached_at = time.monotonic()
        return loaded

    def get(self, name: str) -> Template:
        tpl = self._load().get(name)
        if tpl is None and name not in self._invalid:
            # Made since (perhaps through another replica): a miss reads the store again.
            self._invalidate()
            tpl = self._load().get(name)
        if tpl is None:
            why = self._invalid.get(name)
            if why is not None:
                raise ResourceConflict(
                    f"template {name!r} as stored is no longer valid ({why}): an admin "
                    "replaces it (delete, then create)",
                    metadata={"template": name},
                )
            raise ResourceNotFound(f"no template {name!r}", metadata={"template": name})
        return tpl

    def peek(self, name: str) -> Template | None:
        """The cached template, without touching the store (safe inside a transaction)."""
        return self._cache.get(name)

    def list(self) -> list[Template]:
        return sorted(self._load().values(), key=lambda t: t.name)

    def create(self, tpl: Template) -> Template:
        tpl = with_disk_limit(tpl)
        with self.store.write() as conn:
            self.store.serialize(conn, f"template:{tpl.name}")
            exists = conn.execute(
                select(templates.c.name).where(templates.c.name == tpl.name)
            ).first()
            if exists is not None:
                raise ResourceConflict(f"template {tpl.name!r} already exists")
            self._check_volumes(conn, tpl)
            conn.execute(
                templates.insert().values(
                    name=tpl.name,
                    spec=tpl.model_dump(mode="json"),
                    source="api",
                    created_at=time.time(),
                )
            )
        self._invalidate()
        return tpl

    @staticmethod
    def _check_volumes(conn: Connection, tpl: Template) -> None:
        for vm in tpl.volume_mounts:
            if (
                conn.execute(select(volumes.c.name).where(volumes.c.name == vm.volume)).first()
                is None
            ):
                raise InvalidRequest(f"template names unknown volume {vm.volume!r}")

    def delete(self, name: str) -> None:
        with self.store.write() as conn:
            row = conn.execute(select(templates).where(templates.c.name == name)).first()
            if row is None:
                raise ResourceNotFound(f"no template {name!r}")
            if row.source == "config":
                raise ResourceConflict(f"template {name!r} comes from the configuration")
            # Of concurrent deletes, one deletes it; the others find it gone.
            if conn.execute(delete(templates).where(templates.c.name == name)).rowcount == 0:
                raise ResourceNotFound(f"no template {name!r}")
        self._invalidate()


class VolumeService:
    def __init__(self, store: Store, max_per_user: int = 100) -> None:
        self.store = store
        #: Volumes one user may have (``[quotas] max_volumes_per_user``): without a bound,
        #: a user's volumes grew the store, and every listing, without end.
        self.max_per_user = max_per_user

    def create(self, name: str, owner_user_id: str) -> Volume:
        now = time.time()
        with self.store.write() as conn:
            # One user's creations take turns, so the count holds under concurrency.
            self.store.serialize(conn, f"volumes-of:{owner_user_id}")
            self.store.serialize(conn, f"volume:{name}")
            if conn.execute(select(volumes.c.name).where(volumes.c.name == name)).first():
                raise ResourceConflict(f"volume {name!r} already exists")
            owned = conn.execute(
                select(func.count())
                .select_from(volumes)
                .where(volumes.c.owner_user_id == owner_user_id)
            ).scalar_one()
            if owned >= self.max_per_user:
                raise QuotaExceeded(
                    f"at most {self.max_per_user} volumes per user",
                    metadata={"resource": "volumes", "limit": self.max_per_user},
                )
            conn.execute(
                volumes.insert().values(name=name, owner_user_id=owner_user_id, created_at=now)
            )
        return Volume(name=name, created_at=rfc3339(now))

    def list(self, owner_user_id: str | None) -> list[Volume]:
        q = select(volumes).order_by(volumes.c.name)
        if owner_user_id is not None:
            q = q.where(volumes.c.owner_user_id == owner_user_id)
        with self.store.read() as conn:
            return [Volume(name=r.name, created_at=rfc3339(r.created_at)) for r in conn.execute(q)]

    def get(self, name: str, owner_user_id: str | None) -> Volume:
        for v in self.list(owner_user_id):
            if v.name == name:
                return v
        raise ResourceNotFound(f"no volume {name!r}")

    def delete(self, name: str, owner_user_id: str | None) -> None:
        q = delete(volumes).where(volumes.c.name == name)
        if owner_user_id is not None:
            q = q.where(volumes.c.owner_user_id == owner_user_id)
        with self.store.write() as conn:
            for row in conn.execute(select(templates.c.name, templates.c.spec)):
                try:
                    tpl = Template.model_validate(row.spec)
                except ValidationError:
                    continue
                if any(vm.volume == name for vm in tpl.volume_mounts):
                    raise ResourceConflict(f"volume {name!r} is used by template {tpl.name!r}")
            if conn.execute(q).rowcount == 0:
                raise ResourceNotFound(f"no volume {name!r}")


__all__ = ["TemplateService", "VolumeService"]

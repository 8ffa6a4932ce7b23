"""Host keys: the credential of a sandbox host that registers through the brokers' API.

A ``sandlot host`` without access to the store (``--broker URL --key KEY``) proves
who it is with a key an admin issued (``sandlot keys create-host``, or ``POST
/v1/hosts/keys``). A key stands for one host id: it reads ``slh_<hex>_<secret>`` and
its holder is host ``h_<hex>``, so a key can act only on the sandboxes placed on its
own host. Only the SHA-256 of the secret is stored (256 bits of entropy: a fast hash
is enough, as for API keys); the plain key is shown once. A revoked key stops working
at every replica within :attr:`HostKeyService.CACHE_SECONDS`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select, update

from sandlot.broker.store import Store
from sandlot.broker.store.schema import host_keys
from sandlot.protocol.errors import (
    InvalidRequest,
    ResourceConflict,
    ResourceNotFound,
    Unauthenticated,
)

_KEY_RE = re.compile(r"^slh_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
_HOST_RE = re.compile(r"^h_([0-9a-f]{16})$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}$")


@dataclass(frozen=True)
class HostKeyInfo:
    host_id: str
    name: str | None
    created_at: float
    revoked_at: float | None


def host_of_key(raw: str) -> str:
    """The host id a key stands for (``InvalidRequest`` if it is not a host key)."""
    m = _KEY_RE.match(raw.strip())
    if m is None:
        raise InvalidRequest("not a host key (slh_…)")
    return f"h_{m.group(1)}"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class HostKeyService:
    #: How long a looked-up key is trusted without reading the store again.
    CACHE_SECONDS = 1.0

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, tuple[float, str | None]] = {}

    def create(self, *, name: str | None = None, host_id: str | None = None) -> tuple[str, str]:
        """Issue a key for a new host (or for ``host_id``, whose key it replaces);
        returns (key, host id). The plain key is returned once and never stored."""
        if name is not None and not _NAME_RE.match(name):
            raise InvalidRequest("a host key's name must be 1-200 letters, digits or _.@-")
        if host_id is None:
            hexid = secrets.token_hex(8)
        else:
            m = _HOST_RE.match(host_id)
            if m is None:
                raise InvalidRequest("a host id reads h_ and 16 hexadecimal digits")
            hexid = m.group(1)
        secret = secrets.token_urlsafe(32)
        values = {"secret_hash": _hash(secret), "name": name, "created_at": time.time()}
        with self.store.write() as conn:
            self.store.serialize(conn, f"host-key:{hexid}")
            found = conn.execute(
                select(host_keys.c.revoked_at).where(host_keys.c.id == f"h_{hexid}")
            ).first()
            if found is not None and found.revoked_at is None:
                raise ResourceConflict(f"host h_{hexid} already has a key: revoke it first")
            if found is None:
                conn.execute(host_keys.insert().values(id=f"h_{hexid}", **values))
            else:
                conn.execute(
                    update(host_keys)
                    .where(host_keys.c.id == f"h_{hexid}")
                    .values(revoked_at=None, **values)
                )
        self._cache.pop(f"h_{hexid}", None)
        return f"slh_{hexid}_{secret}", f"h_{hexid}"

    def authenticate(self, raw: str | None) -> str:
        """The host id of a valid, unrevoked key; ``Unauthenticated`` otherwise."""
        if not raw:
            raise Unauthenticated("a host key is required (Authorization: Bearer slh_…)")
        m = _KEY_RE.match(raw.strip())
        if m is None:
            raise Unauthenticated("invalid host key")
        host_id = f"h_{m.group(1)}"
        digest = _hash(m.group(2))
        now = time.monotonic()
        cached = self._cache.get(host_id)
        if cached is None or now - cached[0] > self.CACHE_SECONDS:
            with self.store.read() as conn:
                row = conn.execute(
                    select(host_keys.c.secret_hash, host_keys.c.revoked_at).where(
                        host_keys.c.id == host_id
                    )
                ).first()
            cached = (now, row.secret_hash if row is not None and row.revoked_at is None else None)
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[host_id] = cached
        if cached[1] is None or not hmac.compare_digest(cached[1], digest):
            raise Unauthenticated("invalid host key")
        return host_id

    def list(self) -> list[HostKeyInfo]:
        with self.store.read() as conn:
            rows = conn.execute(select(host_keys).order_by(host_keys.c.created_at)).all()
        return [HostKeyInfo(r.id, r.name, r.created_at, r.revoked_at) for r in rows]

    def revoke(self, host_id: str) -> None:
        with self.store.write() as conn:
            changed = conn.execute(
                update(host_keys)
                .where(host_keys.c.id == host_id, host_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            ).rowcount
        if not changed:
            raise ResourceNotFound(f"no active host key for {host_id}")
        self._cache.pop(host_id, None)

"""API keys: created for a principal of a user, stored hashed, looked up by prefix.

A key reads ``sl_<prefix>_<secret>``. Only the prefix (an index) and the
SHA-256 of the secret are stored. The secret has 256 bits of entropy, so a
fast hash is enough (slow password hashes protect *guessable* secrets), and it
keeps authentication off the critical path of every request.

Revoking a key revokes, in the same transaction, every live token minted for
its callers; revoking a user's keys also revokes the tokens minted for that
user by a service acting on their behalf. Only the store is written, so the
CLI can do it while servers run: each server that serves sandboxes finds the
new revocations in the store within a fraction of a second and pushes them to
its dataplane (:mod:`sandlot.broker.revocations`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Connection, bindparam, or_, select, update

from sandlot.broker.principals import Principal
from sandlot.broker.store import Store
from sandlot.broker.store.schema import api_keys, tokens
from sandlot.protocol.common import PrincipalType, new_id
from sandlot.protocol.errors import InvalidRequest, ResourceNotFound, Unauthenticated

_KEY_RE = re.compile(r"^sl_([a-z0-9]{12})_([A-Za-z0-9_-]{43})$")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}$")


@dataclass(frozen=True)
class KeyInfo:
    id: str
    prefix: str
    user_id: str
    principal_type: str
    principal_id: str
    name: str | None
    created_at: float
    revoked_at: float | None


_BY_PREFIX = select(api_keys).where(api_keys.c.prefix == bindparam("prefix"))
_KEY_REVOKED = select(api_keys.c.revoked_at).where(api_keys.c.id == bindparam("id"))
#: On PostgreSQL the row stays share-locked until the minting transaction commits, so a
#: concurrent revocation waits for it and then revokes the token it minted.
_KEY_REVOKED_LOCKED = _KEY_REVOKED.with_for_update(read=True)


def check_key_live(conn: Connection, key_id: str | None, *, lock: bool = True) -> None:
    """Inside a transaction that mints a token: the caller's key is not revoked.

    A server trusts a looked-up key for up to a second; a key revoked meanwhile
    (by another process) must not mint a token its revocation did not see. A caller
    the hosting platform authenticated (``key_id`` ``None``) has no key to check.
    ``lock=False`` only reads the row (in a read-only transaction).
    """
    if key_id is None:
        return
    locked = lock and conn.dialect.name == "postgresql"
    stmt = _KEY_REVOKED_LOCKED if locked else _KEY_REVOKED
    row = conn.execute(stmt, {"id": key_id}).first()
    if row is None or row.revoked_at is not None:
        raise Unauthenticated("invalid API key")


def looks_like_key(raw: str | None) -> bool:
    """Whether ``raw`` has the shape of a sandlot API key (``sl_…``): not whether it is valid."""
    return raw is not None and _KEY_RE.match(raw.strip()) is not None


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyService:
    #: How long a looked-up key is trusted without reading the store again; a key
    #: revoked from another process stops working within this time.
    CACHE_SECONDS = 1.0

    def __init__(self, store: Store, admins: frozenset[str] = frozenset()) -> None:
        self.store = store
        self.admins = admins
        self._cache: dict[str, tuple[float, str, Principal | None]] = {}
        #: key id -> (when read, whether live): what :meth:`key_live` read last.
        self._live: dict[str, tuple[float, bool]] = {}

    def create(
        self,
        *,
        user_id: str,
        principal_type: PrincipalType,
        principal_id: str | None = None,
        name: str | None = None,
    ) -> tuple[str, KeyInfo]:
        """Create a key; the plain key is returned once and never stored."""
        if not _ID_RE.match(user_id):
            raise InvalidRequest("user id must be 1-200 letters, digits or _.@-")
        principal_id = principal_id or f"{principal_type.value}:{user_id}"
        if not _ID_RE.match(principal_id.replace(":", "_")):
            raise InvalidRequest("principal id must be 1-200 letters, digits or _.@:-")
        prefix = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        info = KeyInfo(
            id=new_id("key", 8),
            prefix=prefix,
            user_id=user_id,
            principal_type=principal_type.value,
            principal_id=principal_id,
            name=name,
            created_at=time.time(),
            revoked_at=None,
        )
        with self.store.write() as conn:
            conn.execute(
                api_keys.insert().values(
                    id=info.id,
                    prefix=prefix,
                    secret_hash=_hash(secret),
                    user_id=user_id,
                    principal_type=info.principal_type,
                    principal_id=principal_id,
                    name=name,
                    created_at=info.created_at,
                )
            )
        return f"sl_{prefix}_{secret}", info

    def authenticate(self, raw: str | None) -> Principal:
        """Who ``raw`` is (a read of the store when it is not cached: call it off the
        event loop, or :meth:`from_cache` first)."""
        prefix, digest = self._parse(raw)
        now = time.monotonic()
        cached = self._cache.get(prefix)
        if cached is None or now - cached[0] > self.CACHE_SECONDS:
            cached = (now, *self._lookup(prefix))
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[prefix] = cached
        return self._check(cached, digest)

    def from_cache(self, raw: str | None) -> Principal | None:
        """Who ``raw`` is, without the store: ``None`` when that needs :meth:`authenticate`
        (not cached, or cached too long ago). Unauthenticated for a key that is
        malformed, or known to be wrong."""
        prefix, digest = self._parse(raw)
        cached = self._cache.get(prefix)
        if cached is None or time.monotonic() - cached[0] > self.CACHE_SECONDS:
            return None
        return self._check(cached, digest)

    def key_live_cached(self, key_id: str | None) -> bool | None:
        """Whether the key that authenticated a caller still works, without the store:
        ``None`` when that needs :meth:`key_live`. A caller the hosting platform
        authenticated (``key_id`` ``None``) has no key to lose."""
        if key_id is None:
            return True
        cached = self._live.get(key_id)
        if cached is None or time.monotonic() - cached[0] > self.CACHE_SECONDS:
            return None
        return cached[1]

    def key_live(self, key_id: str | None) -> bool:
        """Whether the key still works (not revoked), read from the store at most once
        per :attr:`CACHE_SECONDS` per key: what a long-lived stream a key opened checks
        (call it off the event loop, or :meth:`key_live_cached` first)."""
        live = self.key_live_cached(key_id)
        if live is not None:
            return live
        assert key_id is not None
        try:
            with self.store.read() as conn:
                check_key_live(conn, key_id, lock=False)
            live = True
        except Unauthenticated:
            live = False
        if len(self._live) > 10_000:
            self._live.clear()
        self._live[key_id] = (time.monotonic(), live)
        return live

    @staticmethod
    def _parse(raw: str | None) -> tuple[str, str]:
        if not raw:
            raise Unauthenticated("an API key is required (Authorization: Bearer <key>)")
        m = _KEY_RE.match(raw.strip())
        if m is None:
            raise Unauthenticated("invalid API key")
        prefix, secret = m.groups()
        return prefix, _hash(secret)

    @staticmethod
    def _check(cached: tuple[float, str, Principal | None], digest: str) -> Principal:
        _, secret_hash, principal = cached
        if principal is None or not hmac.compare_digest(secret_hash, digest):
            raise Unauthenticated("invalid API key")
        return principal

    def _lookup(self, prefix: str) -> tuple[str, Principal | None]:
        with self.store.read() as conn:
            row = conn.execute(_BY_PREFIX, {"prefix": prefix}).first()
        if row is not None:
            # A key refused here is refused to the streams it opened from now on too.
            self._live[row.id] = (time.monotonic(), row.revoked_at is None)
        if row is None or row.revoked_at is not None:
            return "", None
        return row.secret_hash, Principal(
            type=PrincipalType(row.principal_type),
            id=row.principal_id,
            user_id=row.user_id,
            key_id=row.id,
            is_admin=row.user_id in self.admins,
        )

    def list(self, user_id: str | None = None) -> list[KeyInfo]:
        query = select(api_keys).order_by(api_keys.c.created_at)
        if user_id is not None:
            query = query.where(api_keys.c.user_id == user_id)
        with self.store.read() as conn:
            rows = conn.execute(query).all()
        return [
            KeyInfo(
                id=r.id,
                prefix=r.prefix,
                user_id=r.user_id,
                principal_type=r.principal_type,
                principal_id=r.principal_id,
                name=r.name,
                created_at=r.created_at,
                revoked_at=r.revoked_at,
            )
            for r in rows
        ]

    def revoke(self, key_id: str, *, user_id: str | None = None) -> int:
        """Revoke a key and every live token minted with it; returns how many tokens."""
        query = update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
        if user_id is not None:
            query = query.where(api_keys.c.user_id == user_id)
        now = time.time()
        with self.store.write() as conn:
            if conn.execute(query.values(revoked_at=now)).rowcount == 0:
                raise ResourceNotFound(f"no active key {key_id}")
            count = _revoke_tokens(conn, tokens.c.key_id == key_id, now)
        self._cache.clear()
        self._live.clear()
        return count

    def revoke_user(self, user_id: str) -> tuple[int, int]:
        """Revoke every key of a user and every live token minted for them (by their own
        keys, or by a service acting on their behalf); returns (keys, tokens)."""
        now = time.time()
        with self.store.write() as conn:
            ids = [
                r.id
                for r in conn.execute(
                    select(api_keys.c.id).where(
                        api_keys.c.user_id == user_id, api_keys.c.revoked_at.is_(None)
                    )
                )
            ]
            if ids:
                conn.execute(update(api_keys).where(api_keys.c.id.in_(ids)).values(revoked_at=now))
            count = _revoke_tokens(
                conn, or_(tokens.c.user_id == user_id, tokens.c.key_id.in_(ids)), now
            )
        self._cache.clear()
        self._live.clear()
        return len(ids), count


def _revoke_tokens(conn: Connection, which: ColumnElement[bool], now: float) -> int:
    """Mark live tokens revoked; the servers push them to their dataplanes."""
    return int(
        conn.execute(
            update(tokens)
            .where(which, tokens.c.revoked_at.is_(None), tokens.c.expires_at > now)
            .values(revoked_at=now)
        ).rowcount
    )

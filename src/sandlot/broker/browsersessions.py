"""The web workspace's browser sessions and one-time sign-in links, in the broker's store.

``sandlot serve`` keeps them here rather than in a process's memory, so that every
worker process and every replica on the store knows them: the link ``sandlot open``
prints signs a browser in whichever replica the balancer sends it to, the browser's
next request may reach another one, a sign-out or a revoked key ends the session
everywhere, and a restart signs nobody out.

What the store holds, and why it cannot sign anyone in by itself:

- a session is found by the SHA-256 of its cookie's id (the id is kept by the browser
  alone); the user's API key, which the server negotiates with on the user's behalf, is
  sealed (AES-GCM) under a key derived from the cookie's id, so only a request carrying
  the cookie can open it; the CSRF token is derived from the cookie's id too, and not
  stored;
- a link is found by its id; its secret is kept as its SHA-256, and the key is sealed
  under the secret; redeeming deletes the row, so one request spends it, whichever
  replica serves it.

A session's ``last_seen`` is written at most every :attr:`StoredSessions.touch_seconds`
(a minute, or a tenth of the idle time if that is shorter): an idle session may end that
much before its idle time has passed since its last request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import ColumnElement, delete, func, or_, select, update
from sqlalchemy.engine import Connection, Row

from sandlot.broker.store import Store
from sandlot.broker.store.schema import web_links, web_sessions
from sandlot.web.auth import BrowserSession, LoginLink, checked_next, secret_digest

_SEAL_LABEL = b"sandlot.web.seal\0"
#: A link's id, as :meth:`StoredLinks.create` makes it (``secrets.token_hex(8)``).
_LINK_ID = re.compile(r"[0-9a-f]{16}")
_CSRF_LABEL = b"sandlot.web.csrf"


def seal(secret: str, bound_to: str, value: str | None) -> str | None:
    """``value`` encrypted under a key derived from ``secret`` (a cookie's id or a link's
    secret: 256 random bits), bound to the row's key ``bound_to``."""
    if value is None:
        return None
    nonce = secrets.token_bytes(12)
    sealed = AESGCM(_seal_key(secret)).encrypt(nonce, value.encode(), bound_to.encode())
    return base64.urlsafe_b64encode(nonce + sealed).decode()


def unseal(secret: str, bound_to: str, sealed: str | None) -> str | None:
    """What :func:`seal` sealed; raises ``ValueError`` for anything else."""
    if sealed is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(sealed.encode())
        opened = AESGCM(_seal_key(secret)).decrypt(raw[:12], raw[12:], bound_to.encode())
    except (InvalidTag, ValueError) as exc:
        raise ValueError("the sealed value does not open with this secret") from exc
    return opened.decode()


def _seal_key(secret: str) -> bytes:
    return hashlib.sha256(_SEAL_LABEL + secret.encode()).digest()


def csrf_token(cookie_id: str) -> str:
    """The CSRF token of the session whose cookie holds ``cookie_id``."""
    mac = hmac.new(cookie_id.encode(), _CSRF_LABEL, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


class StoredSessions:
    """Browser sessions in the store (a :class:`sandlot.web.auth.SessionStore`)."""

    blocking = True
    #: Sessions one user may hold; a new one ends their least recently used.
    MAX_PER_USER = 100

    def __init__(
        self,
        store: Store,
        *,
        idle_seconds: float,
        max_seconds: float,
        max_sessions: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.idle_seconds = idle_seconds
        self.max_seconds = max_seconds
        self.max_sessions = max_sessions
        self.touch_seconds = min(60.0, idle_seconds / 10)
        self._clock = clock

    def create(self, user_id: str, *, credential: str | None) -> tuple[str, BrowserSession]:
        raw = secrets.token_urlsafe(32)
        key = secret_digest(raw)
        now = self._clock()
        session = BrowserSession(
            user_id=user_id,
            credential=credential,
            csrf_token=csrf_token(raw),
            created_at=now,
            last_seen=now,
            expires_at=now + self.max_seconds,
            checked_at=now,
            key=key,
        )
        t = web_sessions.c
        with self.store.write() as conn:
            conn.execute(delete(web_sessions).where(self._dead(now)))
            # Oldest first: one user signing in again and again ends their own sessions,
            # not everyone else's.
            self._trim(conn, t.user_id == user_id, self.MAX_PER_USER)
            self._trim(conn, None, self.max_sessions)
            conn.execute(
                web_sessions.insert().values(
                    key=key,
                    user_id=user_id,
                    credential=seal(raw, key, credential),
                    created_at=now,
                    last_seen=now,
                    expires_at=session.expires_at,
                    checked_at=now,
                )
            )
        return raw, session

    def get(self, raw: str | None) -> BrowserSession | None:
        if not raw or len(raw) > 256:
            return None
        key = secret_digest(raw)
        now = self._clock()
        with self.store.read() as conn:
            row = conn.execute(select(web_sessions).where(web_sessions.c.key == key)).first()
        if row is None:
            return None
        if not self._live(row, now):
            self._delete(key)
            return None
        try:
            credential = unseal(raw, key, row.credential)
        except ValueError:
            return None
        last_seen = float(row.last_seen)
        if now - last_seen >= self.touch_seconds:
            with self.store.write() as conn:
                conn.execute(
                    update(web_sessions).where(web_sessions.c.key == key).values(last_seen=now)
                )
            last_seen = now
        return BrowserSession(
            user_id=row.user_id,
            credential=credential,
            csrf_token=csrf_token(raw),
            created_at=float(row.created_at),
            last_seen=last_seen,
            expires_at=float(row.expires_at),
            checked_at=float(row.checked_at),
            key=key,
        )

    def delete(self, raw: str | None) -> bool:
        if not raw or len(raw) > 256:
            return False
        return self._delete(secret_digest(raw))

    def discard(self, session: BrowserSession) -> None:
        self._delete(session.key)

    def checked(self, session: BrowserSession, at: float) -> None:
        session.checked_at = at
        with self.store.write() as conn:
            conn.execute(
                update(web_sessions).where(web_sessions.c.key == session.key).values(checked_at=at)
            )

    def end_user(self, user_id: str) -> int:
        with self.store.write() as conn:
            ended = conn.execute(delete(web_sessions).where(web_sessions.c.user_id == user_id))
        return int(ended.rowcount)

    def _delete(self, key: str) -> bool:
        with self.store.write() as conn:
            gone = conn.execute(delete(web_sessions).where(web_sessions.c.key == key))
        return bool(gone.rowcount)

    def _live(self, row: Row[tuple[object, ...]], now: float) -> bool:
        expires_at, last_seen = float(row.expires_at), float(row.last_seen)
        return now < expires_at and now - last_seen < self.idle_seconds

    def _dead(self, now: float) -> ColumnElement[bool]:
        t = web_sessions.c
        return or_(t.expires_at <= now, t.last_seen <= now - self.idle_seconds)

    def _trim(self, conn: Connection, where: ColumnElement[bool] | None, most: int) -> None:
        """Delete the least recently used sessions (of ``where``) so one more fits."""
        counted = select(func.count()).select_from(web_sessions)
        if where is not None:
            counted = counted.where(where)
        extra = int(conn.execute(counted).scalar_one()) - most + 1
        if extra <= 0:
            return
        oldest = select(web_sessions.c.key).order_by(web_sessions.c.last_seen).limit(extra)
        if where is not None:
            oldest = oldest.where(where)
        keys = list(conn.execute(oldest).scalars())
        conn.execute(delete(web_sessions).where(web_sessions.c.key.in_(keys)))


class StoredLinks:
    """One-time sign-in links in the store (a :class:`sandlot.web.auth.LinkStore`)."""

    blocking = True

    def __init__(
        self, store: Store, *, ttl_seconds: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.ttl_seconds = ttl_seconds
        self._clock = clock

    def create(self, user_id: str, *, credential: str | None = None, next_path: str = "/") -> str:
        link_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        now = self._clock()
        with self.store.write() as conn:
            conn.execute(delete(web_links).where(web_links.c.expires_at <= now))
            conn.execute(
                web_links.insert().values(
                    id=link_id,
                    secret_hash=secret_digest(secret),
                    user_id=user_id,
                    credential=seal(secret, link_id, credential),
                    next_path=checked_next(next_path),
                    expires_at=now + self.ttl_seconds,
                )
            )
        return f"{link_id}.{secret}"

    def redeem(self, token: str | None) -> LoginLink | None:
        if not token or len(token) > 256:
            return None
        link_id, _, secret = token.partition(".")
        # What ``create`` makes, nothing else reaches the database (PostgreSQL refuses a
        # NUL in text: a ``%00`` in the link would have been a 500).
        if not _LINK_ID.fullmatch(link_id):
            return None
        with self.store.write() as conn:
            row = conn.execute(select(web_links).where(web_links.c.id == link_id)).first()
            if row is None:
                return None
            spent = conn.execute(delete(web_links).where(web_links.c.id == link_id))
        if spent.rowcount != 1:  # another request spent it first
            return None
        if not hmac.compare_digest(row.secret_hash, secret_digest(secret)):
            return None
        if float(row.expires_at) <= self._clock():
            return None
        try:
            credential = unseal(secret, link_id, row.credential)
        except ValueError:
            return None
        return LoginLink(row.user_id, credential, row.next_path, float(row.expires_at))


__all__ = ["StoredLinks", "StoredSessions", "csrf_token", "seal", "unseal"]

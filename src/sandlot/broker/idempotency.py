"""Idempotency keys (draft-ietf-httpapi-idempotency-key-header).

A key is looked up together with the caller's identity. The first request
with a key records a fingerprint of its body and runs; a retry with the same
key and body gets the stored status and body back (errors included); the
same key with another body is 422.

The key is claimed, and the answer recorded, **in the transaction that does
the work** (:class:`Claim`): the answer is committed together with what it
describes, or not at all, and a key costs two statements in that transaction
rather than two transactions of its own. Writers are serialized (SQLite's
write lock; on PostgreSQL the claim's insert waits for a concurrent one with
the same key), so a retry sent while the first request runs waits for it and
gets its answer. What runs outside one transaction (the resume of a suspended
sandbox after ``ensure``) leaves the claim ``in_flight`` until
:meth:`IdempotencyStore.finish`; a retry meanwhile is 409
IDEMPOTENCY_IN_FLIGHT. An in-flight record left by a server that died (its
``owner`` process is gone, or after ``STALE_SECONDS`` for one on another
machine) is taken over.

:meth:`IdempotencyStore.begin` / :meth:`~IdempotencyStore.finish` claim and
settle a key in transactions of their own, for work that has none.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.expression import Executable

from sandlot.broker.store import Store
from sandlot.broker.store.schema import idempotency
from sandlot.protocol.errors import IdempotencyInFlight, IdempotencyKeyReused, InvalidRequest

MAX_KEY_LENGTH = 255


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name may hold spaces; fields after its closing paren are fixed.
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


#: This process's identity for in-flight records: host, pid and the pid's start time,
#: so a record left by a process that died on this host is recognised at once.
PROCESS_OWNER = (
    f"{socket.gethostname()}|{os.getpid()}|{_start_time(os.getpid())}|{uuid.uuid4().hex[:8]}"
)


def owner_alive(owner: str) -> bool:
    """Whether the process that wrote an in-flight record may still be working on it."""
    host, _, rest = owner.partition("|")
    pid_text, _, rest = rest.partition("|")
    started, _, _ = rest.partition("|")
    if host != socket.gethostname() or not pid_text.isdigit():
        return True  # another machine: only the timeout can tell
    return _start_time(int(pid_text)) == started


@dataclass(frozen=True)
class StoredResponse:
    status: int
    body: Any


def fingerprint(method: str, path: str, body: bytes) -> str:
    try:
        canonical = json.dumps(json.loads(body or b"null"), sort_keys=True, separators=(",", ":"))
    except ValueError:
        canonical = body.decode("latin-1")
    return hashlib.sha256(f"{method} {path}\n{canonical}".encode()).hexdigest()


def check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise InvalidRequest("Idempotency-Key must be 1-255 printable characters")


# Statements built once: building a SQLAlchemy statement and its cache key costs more
# than running it on SQLite. Bind names differ from column names (SQLAlchemy reserves
# those in INSERT and UPDATE).
_WHERE_KEY = (idempotency.c.principal_id == bindparam("p")) & (idempotency.c.key == bindparam("k"))
_GET = select(
    idempotency.c.fingerprint,
    idempotency.c.state,
    idempotency.c.owner,
    idempotency.c.status,
    idempotency.c.response,
    idempotency.c.created_at,
    idempotency.c.expires_at,
).where(_WHERE_KEY)
_CLAIM_VALUES = {
    "principal_id": bindparam("p"),
    "key": bindparam("k"),
    "fingerprint": bindparam("fp"),
    "state": "in_flight",
    "owner": bindparam("owner"),
    "created_at": bindparam("now"),
    "expires_at": bindparam("until"),
}
_RECORD_VALUES = {
    **_CLAIM_VALUES,
    "state": "done",
    "status": bindparam("st"),
    "response": bindparam("body"),
}
#: Records a claimed key's answer (parameters ``p``, ``k``, ``st``, ``body``).
FINISH = (
    update(idempotency)
    .where(_WHERE_KEY)
    .values(state="done", status=bindparam("st"), response=bindparam("body"))
)
_SETTLE = (
    update(idempotency)
    .where(_WHERE_KEY, idempotency.c.state == "in_flight")
    .values(state="done", status=bindparam("st"), response=bindparam("body"))
)
_TAKE_OVER = (
    update(idempotency)
    .where(_WHERE_KEY)
    .values(owner=bindparam("owner"), created_at=bindparam("now"))
)
_DELETE = delete(idempotency).where(_WHERE_KEY)
_ABANDON = delete(idempotency).where(_WHERE_KEY, idempotency.c.state == "in_flight")


def _insert_unless_present(dialect: str, values: dict[str, Any]) -> tuple[Executable, str]:
    """An INSERT that does nothing when the key is taken, and how to tell whether it
    inserted: ``rowcount`` (SQLite), ``returning`` (PostgreSQL, whose driver reports no
    row count for it), else ``savepoint`` (a plain INSERT; IntegrityError when taken)."""
    keys = ["principal_id", "key"]
    if dialect == "sqlite":
        return sqlite.insert(idempotency).values(values).on_conflict_do_nothing(keys), "rowcount"
    if dialect == "postgresql":
        stmt = postgresql.insert(idempotency).values(values)
        stmt = stmt.on_conflict_do_nothing(index_elements=keys)
        return stmt.returning(idempotency.c.key), "returning"
    return idempotency.insert().values(values), "savepoint"


class IdempotencyStore:
    STALE_SECONDS = 30.0

    def __init__(self, store: Store, ttl_seconds: int) -> None:
        self.store = store
        self.ttl = ttl_seconds
        self._claim, self._claim_how = _insert_unless_present(store.dialect, _CLAIM_VALUES)
        self._record, self._record_how = _insert_unless_present(store.dialect, _RECORD_VALUES)

    def claim(self, principal_id: str, key: str, fp: str) -> Claim:
        """A key to settle in the transaction of the work (:meth:`Claim.begin_in`)."""
        check_key(key)
        return Claim(self, principal_id, key, fp)

    # --- inside the caller's transaction ---------------------------------------------------

    def begin_in(
        self, conn: Connection, principal_id: str, key: str, fp: str
    ) -> StoredResponse | None:
        """Claim the key in ``conn``'s transaction, or return the stored response of an
        earlier identical request."""
        params = self._row(principal_id, key, fp)
        now = params["now"]
        # The common case, a new key, is one statement.
        if self._insert(conn, self._claim, self._claim_how, params):
            return None
        row = conn.execute(_GET, params).first()
        if row is None or row.expires_at < now:
            if row is not None:
                conn.execute(_DELETE, params)
            if self._insert(conn, self._claim, self._claim_how, params):
                return None
            raise IdempotencyInFlight("a request with this key is in progress", retry_after=1.0)
        if row.fingerprint != fp:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used with a different request body"
            )
        if row.state == "done":
            return StoredResponse(row.status, row.response)
        stale = row.owner != PROCESS_OWNER and (
            not owner_alive(row.owner) or now - row.created_at > self.STALE_SECONDS
        )
        if not stale:
            raise IdempotencyInFlight("a request with this key is in progress", retry_after=1.0)
        conn.execute(_TAKE_OVER, params)
        return None

    def finish_in(
        self, conn: Connection, principal_id: str, key: str, status: int, body: Any
    ) -> None:
        """Record the answer of a claimed key in ``conn``'s transaction."""
        conn.execute(FINISH, {"p": principal_id, "k": key, "st": status, "body": body})

    def record_in(
        self, conn: Connection, principal_id: str, key: str, fp: str, status: int, body: Any
    ) -> None:
        """Record an answer whether or not the key's claim was committed (an error raised
        in the transaction that held the claim rolled it back with the rest)."""
        if conn.execute(FINISH, {"p": principal_id, "k": key, "st": status, "body": body}).rowcount:
            return
        params = {**self._row(principal_id, key, fp), "st": status, "body": body}
        # Taken meanwhile by an identical request: its answer stands.
        self._insert(conn, self._record, self._record_how, params)

    def _row(self, principal_id: str, key: str, fp: str) -> dict[str, Any]:
        """The parameters of a key's row, claimed now by this process."""
        now = time.time()
        return {
            "p": principal_id,
            "k": key,
            "fp": fp,
            "owner": PROCESS_OWNER,
            "now": now,
            "until": now + self.ttl,
        }

    @staticmethod
    def _insert(conn: Connection, stmt: Executable, how: str, params: dict[str, Any]) -> bool:
        """Whether ``stmt`` inserted the row (else the key was taken)."""
        if how == "rowcount":
            return bool(conn.execute(stmt, params).rowcount)
        if how == "returning":
            return conn.execute(stmt, params).first() is not None
        try:
            with conn.begin_nested():
                conn.execute(stmt, params)
        except IntegrityError:
            return False
        return True

    # --- in transactions of their own ------------------------------------------------------

    def begin(self, principal_id: str, key: str, fp: str) -> StoredResponse | None:
        """Claim the key, or return the stored response of an earlier identical request."""
        check_key(key)
        with self.store.write() as conn:
            return self.begin_in(conn, principal_id, key, fp)

    def finish(self, principal_id: str, key: str, status: int, body: Any) -> None:
        with self.store.write() as conn:
            self.finish_in(conn, principal_id, key, status, body)

    def record(self, principal_id: str, key: str, fp: str, status: int, body: Any) -> None:
        with self.store.write() as conn:
            self.record_in(conn, principal_id, key, fp, status, body)

    def abandon(self, principal_id: str, key: str) -> None:
        """Forget a claim whose request failed before any outcome could be stored."""
        with self.store.write() as conn:
            conn.execute(_ABANDON, {"p": principal_id, "k": key})

    def purge_expired(self) -> int:
        with self.store.write() as conn:
            return int(
                conn.execute(
                    delete(idempotency).where(idempotency.c.expires_at < time.time())
                ).rowcount
            )


@dataclass
class Claim:
    """One request's ``Idempotency-Key``, settled in the transaction that does its work.

    The work's transaction calls :meth:`begin_in` first: ``True`` means an earlier
    identical request's answer is stored (:attr:`replay`) and the work must not run.
    Once the answer is known, still in that transaction, :meth:`finish_in` records it
    (:attr:`status`, :attr:`body`). Work whose answer comes only after its transaction
    leaves the claim in flight; the caller then settles it with
    :meth:`IdempotencyStore.finish`.
    """

    store: IdempotencyStore
    principal_id: str
    key: str
    fingerprint: str
    #: The stored answer of an earlier identical request.
    replay: StoredResponse | None = None
    #: Whether this request holds the key (claimed or taken over): only then may it
    #: record an outcome or abandon the claim.
    owned: bool = False
    status: int | None = None
    body: Any = None

    def begin_in(self, conn: Connection) -> bool:
        self.replay, self.status, self.body = None, None, None
        self.owned = False
        self.replay = self.store.begin_in(conn, self.principal_id, self.key, self.fingerprint)
        self.owned = self.replay is None
        return self.replay is not None

    def finish_in(self, conn: Connection, status: int, body: Any) -> None:
        self.store.finish_in(conn, self.principal_id, self.key, status, body)
        self.status, self.body = status, body

    def finish_params(self, status: int, body: Any) -> dict[str, Any]:
        """The parameters of :data:`FINISH` for this answer, for a statement that
        includes it; :meth:`finished` once it ran."""
        return {"p": self.principal_id, "k": self.key, "st": status, "body": body}

    def finished(self, status: int, body: Any) -> None:
        self.status, self.body = status, body

    def params(self) -> dict[str, Any]:
        """The parameters of this key's claim, made now by this process, for a call that
        claims it and records its answer at once (:mod:`sandlot.broker.quickattach`);
        :meth:`settled` once that committed."""
        return self.store._row(self.principal_id, self.key, self.fingerprint)

    def settled(self, status: int, body: Any) -> None:
        """The key was claimed and its answer recorded, in one transaction that committed."""
        self.replay, self.owned = None, True
        self.finished(status, body)

"""Idempotency keys (draft-ietf-httpapi-idempotency-key-header).

A key is looked up together with the caller's identity. The first request
with a key records a fingerprint of its body and runs; a retry with the same
key and body gets the stored status and body back (errors included); the
same key with another body is 422; a retry while the first is still running
is 409 IDEMPOTENCY_IN_FLIGHT. An in-flight record left by a server that died
(its ``owner`` process is gone, or after ``STALE_SECONDS`` for one on another
machine) is taken over, so
a client retrying after a crash gets an answer consistent with what was
committed: the retried ``ensure`` attaches to the binding that was created.
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

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

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


class IdempotencyStore:
    STALE_SECONDS = 30.0

    def __init__(self, store: Store, ttl_seconds: int) -> None:
        self.store = store
        self.ttl = ttl_seconds

    def begin(self, principal_id: str, key: str, fp: str) -> StoredResponse | None:
        """Claim the key, or return the stored response of an earlier identical request."""
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise InvalidRequest("Idempotency-Key must be 1-255 printable characters")
        now = time.time()
        with self.store.write() as conn:
            row = conn.execute(
                select(idempotency).where(
                    idempotency.c.principal_id == principal_id, idempotency.c.key == key
                )
            ).first()
            if row is not None and row.expires_at < now:
                conn.execute(
                    delete(idempotency).where(
                        idempotency.c.principal_id == principal_id, idempotency.c.key == key
                    )
                )
                row = None
            if row is None:
                try:
                    with conn.begin_nested():
                        conn.execute(
                            idempotency.insert().values(
                                principal_id=principal_id,
                                key=key,
                                fingerprint=fp,
                                state="in_flight",
                                owner=PROCESS_OWNER,
                                created_at=now,
                                expires_at=now + self.ttl,
                            )
                        )
                except IntegrityError as exc:
                    raise IdempotencyInFlight("a request with this key is in progress") from exc
                return None
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
            conn.execute(
                update(idempotency)
                .where(idempotency.c.principal_id == principal_id, idempotency.c.key == key)
                .values(owner=PROCESS_OWNER, created_at=now)
            )
            return None

    def finish(self, principal_id: str, key: str, status: int, body: Any) -> None:
        with self.store.write() as conn:
            conn.execute(
                update(idempotency)
                .where(idempotency.c.principal_id == principal_id, idempotency.c.key == key)
                .values(state="done", status=status, response=body)
            )

    def abandon(self, principal_id: str, key: str) -> None:
        """Forget a claim whose request failed before any outcome could be stored."""
        with self.store.write() as conn:
            conn.execute(
                delete(idempotency).where(
                    idempotency.c.principal_id == principal_id,
                    idempotency.c.key == key,
                    idempotency.c.state == "in_flight",
                )
            )

    def purge_expired(self) -> int:
        with self.store.write() as conn:
            return int(
                conn.execute(
                    delete(idempotency).where(idempotency.c.expires_at < time.time())
                ).rowcount
            )

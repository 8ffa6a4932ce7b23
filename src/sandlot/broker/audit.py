"""The audit log: who did what, when, to which scope, session and sandbox."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, select

from sandlot.broker.principals import Principal
from sandlot.broker.store import Store
from sandlot.broker.store.schema import audit
from sandlot.protocol.common import Actor

#: Inserts one audit row (:func:`audit_row`'s parameters).
INSERT = audit.insert()


@dataclass(frozen=True)
class AuditContext:
    """Who is acting, carried from the route into the services."""

    request_id: str | None
    principal: Principal | None
    #: The actor named by the request (``actor.id``), when it is not the principal itself.
    actor: Actor | None = None


def record(
    conn: Connection,
    ctx: AuditContext | None,
    action: str,
    *,
    outcome: str = "ok",
    scope_key: str | None = None,
    session_id: str | None = None,
    sandbox_id: str | None = None,
    details: dict[str, Any] | None = None,
    now: float | None = None,
) -> None:
    """Write one audit row inside the caller's transaction."""
    conn.execute(
        INSERT,
        audit_row(
            ctx,
            action,
            outcome=outcome,
            scope_key=scope_key,
            session_id=session_id,
            sandbox_id=sandbox_id,
            details=details,
            now=now,
        ),
    )


def audit_row(
    ctx: AuditContext | None,
    action: str,
    *,
    outcome: str = "ok",
    scope_key: str | None = None,
    session_id: str | None = None,
    sandbox_id: str | None = None,
    details: dict[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The row :func:`record` writes, to write later in the same transaction."""
    p = ctx.principal if ctx else None
    return {
        "ts": now if now is not None else time.time(),
        "request_id": ctx.request_id if ctx else None,
        "action": action,
        "outcome": outcome,
        "principal_id": p.id if p else "system",
        "user_id": p.effective_user if p else None,
        "actor_type": p.actor_type.value if p else None,
        "actor_id": ctx.actor.id if ctx and ctx.actor else p.id if p else None,
        "scope_key": scope_key,
        "session_id": session_id,
        "sandbox_id": sandbox_id,
        "details": details or {},
    }


#: Inserts one audit row from parameters named ``a_`` + its columns (to be combined with
#: other statements in one, see :mod:`sandlot.broker.sessions`).
INSERT_PREFIXED = audit.insert().values(
    {c.name: bindparam(f"a_{c.name}", type_=c.type) for c in audit.c if c.name != "id"}
)


class AuditLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def write(self, ctx: AuditContext | None, action: str, **kw: Any) -> None:
        with self.store.write() as conn:
            record(conn, ctx, action, **kw)

    def query(
        self,
        *,
        scope_key: str | None = None,
        actor_id: str | None = None,
        after: int = 0,
        limit: int = 500,
    ) -> list[dict[str, Any]]:
        q = select(audit).where(audit.c.id > after).order_by(audit.c.id).limit(limit)
        if scope_key:
            q = q.where(audit.c.scope_key == scope_key)
        if actor_id:
            q = q.where(audit.c.actor_id == actor_id)
        with self.store.read() as conn:
            rows = conn.execute(q).all()
        return [
            {
                "id": r.id,
                "timestamp": r.ts,
                "request_id": r.request_id,
                "action": r.action,
                "outcome": r.outcome,
                "principal_id": r.principal_id,
                "user_id": r.user_id,
                "actor": {"type": r.actor_type, "id": r.actor_id} if r.actor_type else None,
                "scope": r.scope_key,
                "session_id": r.session_id,
                "sandbox_id": r.sandbox_id,
                "details": r.details or {},
            }
            for r in rows
        ]

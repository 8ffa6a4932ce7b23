"""Who may use a scope: its owner, the users it is shared with, and admins.

A scope (``thread:thr_1``) is owned by the user whose negotiation first named
it; its owner (or an admin) shares it with other users by adding them as
members. Every session call on a scope's binding checks access here first, and a
refusal says nothing about the scope (a caller may have named only a session id).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from sqlalchemy import Connection, delete, select, update

from sandlot.broker.audit import AuditContext, record
from sandlot.broker.principals import Principal
from sandlot.broker.store import Store
from sandlot.broker.store.schema import (
    access_cuts,
    api_keys,
    bindings,
    leases,
    sandboxes,
    scope_members,
    scopes,
    tokens,
)
from sandlot.protocol.common import Scope
from sandlot.protocol.errors import Forbidden, SessionNotFound
from sandlot.protocol.sessions import MembersResponse


def check_scope_access(
    conn: Connection, principal: Principal, key: str, owner_user_id: str
) -> None:
    """Refuse (403, naming nothing) a principal who neither owns nor shares the scope."""
    user = principal.effective_user
    if user == owner_user_id or principal.is_admin:
        return
    member = conn.execute(
        select(scope_members.c.user_id).where(
            scope_members.c.scope_key == key, scope_members.c.user_id == user
        )
    ).first()
    if member is None:
        raise Forbidden("this scope belongs to another user")


def scope_owner(conn: Connection, key: str) -> str:
    row = conn.execute(select(scopes.c.owner_user_id).where(scopes.c.scope_key == key)).first()
    if row is None:
        raise SessionNotFound(f"no scope {key}")
    return str(row.owner_user_id)


def _check_owner(conn: Connection, principal: Principal, key: str, refusal: str) -> None:
    """Only the scope's owner (or an admin) changes who shares it."""
    if scope_owner(conn, key) != principal.effective_user and not principal.is_admin:
        raise Forbidden(refusal)


#: How long a removed member's API keys stay cut off the scope's sandboxes: longer than
#: a dataplane remembers who a key is, after which the key is refused there as a
#: non-member's (a member added again within it waits that long to use his keys there).
KEY_CUT_SECONDS = 30.0


class MemberService:
    """Sharing a scope with other users."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    def add_member(
        self, ctx: AuditContext, principal: Principal, scope: Scope, user_id: str
    ) -> MembersResponse:
        key = scope.key()
        with self.store.write() as conn:
            _check_owner(conn, principal, key, "only the scope's owner may share it")
            # Sharing twice at once is sharing once (its row's key would refuse the second).
            self.store.serialize(conn, f"members:{key}")
            exists = conn.execute(
                select(scope_members).where(
                    scope_members.c.scope_key == key, scope_members.c.user_id == user_id
                )
            ).first()
            if exists is None:
                conn.execute(
                    scope_members.insert().values(
                        scope_key=key, user_id=user_id, added_at=self.clock()
                    )
                )
            record(conn, ctx, "scope.share", scope_key=key, details={"user_id": user_id})
        return self.members(principal, scope)

    def remove_member(
        self, ctx: AuditContext, principal: Principal, scope: Scope, user_id: str
    ) -> None:
        key = scope.key()
        with self.store.write() as conn:
            _check_owner(conn, principal, key, "only the scope's owner may change its members")
            removed = conn.execute(
                scope_members.delete().where(
                    scope_members.c.scope_key == key, scope_members.c.user_id == user_id
                )
            ).rowcount
            revoked = 0
            if removed and user_id != scope_owner(conn, key):
                revoked = self._cut_off(conn, key, user_id)
            record(
                conn,
                ctx,
                "scope.unshare",
                scope_key=key,
                details={"user_id": user_id, "revoked_tokens": revoked},
            )

    def _cut_off(self, conn: Connection, key: str, user_id: str) -> int:
        """A removed member's leases on the scope's bindings end and its live tokens on
        them are revoked (the caller's transaction). The rows marked revoked reach the
        dataplane like those of a revoked key: the :class:`RevocationWatcher` of the
        process serving the sandbox pushes them (``sandlot.broker.revocations``).

        His API keys are cut off the scope's live sandboxes for :data:`KEY_CUT_SECONDS`
        (an ``access_cuts`` row per key and sandbox, pushed the same way): the sockets
        they opened on its dataplane close, and the dataplane refuses them there until
        its own memory of who a key is (seconds) has lapsed; they still reach his own
        sandboxes."""
        now = self.clock()
        conn.execute(delete(access_cuts).where(access_cuts.c.expires_at < now - 3600))
        live = (
            select(bindings.c.sandbox_id)
            .join(sandboxes, sandboxes.c.id == bindings.c.sandbox_id)
            .where(
                bindings.c.scope_key == key,
                sandboxes.c.state.not_in(("terminated", "failed")),
            )
            .distinct()
        )
        keys = (
            conn.execute(
                select(api_keys.c.id).where(
                    api_keys.c.user_id == user_id, api_keys.c.revoked_at.is_(None)
                )
            )
            .scalars()
            .all()
        )
        cuts = [
            {
                "id": f"cut_{secrets.token_hex(12)}",
                "sandbox_id": sandbox_id,
                "key_id": key_id,
                "cut_at": now,
                "expires_at": now + KEY_CUT_SECONDS,
            }
            for sandbox_id in conn.execute(live).scalars().all()
            for key_id in keys
        ]
        if cuts:
            conn.execute(access_cuts.insert(), cuts)
        of_scope = select(bindings.c.id).where(bindings.c.scope_key == key)
        conn.execute(
            update(leases)
            .where(
                leases.c.binding_id.in_(of_scope),
                leases.c.user_id == user_id,
                leases.c.released_at.is_(None),
            )
            .values(released_at=now)
        )
        return int(
            conn.execute(
                update(tokens)
                .where(
                    tokens.c.binding_id.in_(of_scope),
                    tokens.c.user_id == user_id,
                    tokens.c.revoked_at.is_(None),
                    tokens.c.expires_at > now,
                )
                .values(revoked_at=now)
            ).rowcount
        )

    def members(self, principal: Principal, scope: Scope) -> MembersResponse:
        key = scope.key()
        with self.store.read() as conn:
            owner = scope_owner(conn, key)
            check_scope_access(conn, principal, key, owner)
            rows = conn.execute(
                select(scope_members.c.user_id).where(scope_members.c.scope_key == key)
            ).all()
        return MembersResponse(
            scope=scope, owner_user_id=owner, members=sorted(r.user_id for r in rows)
        )

"""Statements of the negotiation hot path (:mod:`sandlot.broker.sessions`), built once:
building one costs more than running it."""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import bindparam, literal_column, select, update
from sqlalchemy.dialects import postgresql

from sandlot.broker.audit import INSERT_PREFIXED as INSERT_AUDIT_PREFIXED
from sandlot.broker.idempotency import FINISH
from sandlot.broker.ratelimit import TAKE
from sandlot.broker.store.schema import api_keys, bindings, leases, sandboxes, scopes, tokens

#: The live binding of a scope (its columns prefixed ``b_``) with its sandbox, in one read.
LIVE_BINDING = (
    select(*(c.label(f"b_{c.name}") for c in bindings.c), sandboxes)
    .join(sandboxes, sandboxes.c.id == bindings.c.sandbox_id)
    .where(bindings.c.live_scope == bindparam("key"))
)
SCOPE_OWNER = select(scopes.c.owner_user_id).where(scopes.c.scope_key == bindparam("key"))
TOUCH_SANDBOX = (
    update(sandboxes)
    .where(sandboxes.c.id == bindparam("sb"))
    .values(last_active_at=bindparam("now"))
)
RENEW_LEASE = (
    update(leases)
    .where(
        leases.c.binding_id == bindparam("b_binding"),
        leases.c.principal_id == bindparam("b_principal"),
    )
    .values(
        user_id=bindparam("b_user"),
        actor_type=bindparam("b_actor_type"),
        actor_id=bindparam("b_actor_id"),
        caps=bindparam("b_caps"),
        expires_at=bindparam("b_expires"),
        released_at=None,
    )
)
INSERT_TOKEN = tokens.insert()
TOKEN_COLUMNS = (
    "jti",
    "binding_id",
    "sandbox_id",
    "principal_id",
    "key_id",
    "user_id",
    "issued_at",
    "expires_at",
)
#: PostgreSQL: the token, only if its key is not revoked (``check_key_live``'s share lock
#: on the key's row included), in one statement; no row back: the key was revoked.
INSERT_TOKEN_IF_KEY_LIVE = (
    tokens.insert()
    .from_select(
        TOKEN_COLUMNS,
        select(*(bindparam(c, type_=tokens.c[c].type) for c in TOKEN_COLUMNS))
        .select_from(api_keys)
        .where(api_keys.c.id == bindparam("key_id"), api_keys.c.revoked_at.is_(None))
        .with_for_update(read=True),
    )
    .returning(tokens.c.jti)
)

#: PostgreSQL: a lease taken or renewed (parameters ``l_`` + its columns), in one upsert.
_lease = postgresql.insert(leases).values(
    {c.name: bindparam(f"l_{c.name}", type_=c.type) for c in leases.c}
)
UPSERT_LEASE = _lease.on_conflict_do_update(
    index_elements=[leases.c.binding_id, leases.c.principal_id],
    set_={c.name: _lease.excluded[c.name] for c in leases.c if not c.primary_key},
)
#: PostgreSQL: :data:`UPSERT_LEASE` and :data:`INSERT_TOKEN_IF_KEY_LIVE` in one statement.
INSERT_TOKEN_AND_LEASE = INSERT_TOKEN_IF_KEY_LIVE.add_cte(UPSERT_LEASE.cte("leased"))


@functools.cache
def settle_statement(claim: bool, charge: bool) -> Any:
    """PostgreSQL: a negotiation's last writes (its audit row, its key's answer, its
    rate-limit token) as one statement of data-modifying CTEs; a row back unless the
    rate-limit token was refused."""
    ctes = [INSERT_AUDIT_PREFIXED.cte("audited")]
    if claim:
        ctes.append(FINISH.cte("answered"))
    if charge:
        taken = TAKE.cte("taken")
        return select(taken.c.tokens).add_cte(*ctes)
    return select(literal_column("1")).add_cte(*ctes)

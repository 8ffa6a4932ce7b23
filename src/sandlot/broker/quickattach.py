"""PostgreSQL: ``ensure``/``attach`` on a scope's live binding in one round trip.

The general negotiation (:class:`sandlot.broker.sessions.SessionService`) reads the
scope's binding before it can mint the token and build the answer, then writes: a
transaction of several statements, each a round trip to the database. Here a replica
remembers, per scope, the binding and sandbox its last negotiation found; the next
request for that scope is minted and answered from them, and the server-side function
``sandlot_attach`` (migration 0007) checks them against the store and does every write
of the general path in one call, one transaction of its own: the idempotency claim,
the activity stamp, the lease, the token (if the caller's key is not revoked), the
``binding.attached`` event and its ``NOTIFY``, the audit row, the key's answer, the
rate-limit token. Whatever the function does not take (a key already claimed, a
binding or sandbox that changed or is not active, a revoked key, an empty rate
bucket, a scope shared by another user) is rolled back whole (``SL001``) and the
request runs the general path, which answers it as before: what is remembered is a
guess the database confirms, never an answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from sandlot.broker.audit import AuditContext, audit_row
from sandlot.broker.bindings import BindingRow
from sandlot.broker.events import RETAINED_EVENTS
from sandlot.broker.idempotency import Claim
from sandlot.broker.principals import Principal
from sandlot.broker.ratelimit import Charge
from sandlot.broker.sandboxes import SandboxRow
from sandlot.broker.settings import BrokerSettings
from sandlot.broker.store import Store
from sandlot.broker.tokens import KeyRing
from sandlot.protocol.common import Actor, Capability, Scope, rfc3339
from sandlot.protocol.sessions import SessionGrant, SessionMode, SessionRequest
from sandlot.protocol.states import SandboxState


class Sessions(Protocol):
    """What the quick attach takes from :class:`sandlot.broker.sessions.SessionService`."""

    store: Store
    settings: BrokerSettings
    keyring: KeyRing

    @property
    def clock(self) -> Any: ...

    def lease_row(
        self,
        principal: Principal,
        actor: Actor,
        binding: BindingRow,
        caps: list[Capability],
        now: float,
    ) -> tuple[float, dict[str, Any]]: ...

    def grant(
        self,
        binding: BindingRow,
        sandbox: SandboxRow,
        scope: Scope,
        req: SessionRequest,
        *,
        created: bool,
        lease_expires: float,
        event_seq: int,
        token: Any,
        caps: list[Capability],
    ) -> SessionGrant: ...


#: The function's refusal: nothing was written, run the general path.
DECLINED = "SL001"
#: Scopes remembered per process; beyond this the memory starts over.
MAX_KNOWN = 10_000
#: Stands for the event's sequence in the answer's JSON until the function knows it.
_SEQ_MARK = -7_340_211_993

CALL = text(
    "SELECT sandlot_attach(:scope, :binding, :sandbox, :generation, :provider, :template, "
    ":host, :dataplane_http, :dataplane_ws, :now, CAST(:claim AS json), "
    "CAST(:lease AS json), CAST(:token AS json), CAST(:event AS json), CAST(:audit AS json), "
    ":head, :tail, CAST(:take AS json), :retained)"
)


@dataclass(frozen=True)
class Attached:
    """What the function confirmed: the answer, its audit row already written."""

    grant: SessionGrant


class QuickAttach:
    """The one-round-trip attach of one broker process (PostgreSQL only)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self._known: dict[str, tuple[BindingRow, SandboxRow]] = {}

    def learn(self, binding: BindingRow, sandbox: SandboxRow) -> None:
        """Remember the live binding a negotiation found or made for its scope."""
        if len(self._known) >= MAX_KNOWN:
            self._known.clear()
        self._known[binding.scope_key] = (binding, sandbox)

    def forget(self, scope_key: str) -> None:
        self._known.pop(scope_key, None)

    def attach(
        self,
        ctx: AuditContext,
        principal: Principal,
        req: SessionRequest,
        scope: Scope,
        caps: list[Capability],
        claim: Claim | None,
        charge: Charge | None,
    ) -> Attached | None:
        """The grant, or ``None``: run the general path (nothing was written)."""
        key = scope.key()
        known = self._known.get(key)
        if (
            known is None
            or req.sandbox_id is not None
            or req.mode is SessionMode.CREATE_ONLY
            or principal.key_id is None
        ):
            return None
        binding, sandbox = known
        if binding.owner_user_id != principal.effective_user and not principal.is_admin:
            return None  # a member's access is read from the store: the general path
        sandbox = replace(sandbox, state=SandboxState.ACTIVE)
        s = self.sessions
        now = s.clock()
        actor = ctx.actor or principal.actor
        lease_expires, lease = s.lease_row(principal, actor, binding, caps, now)
        minted = s.keyring.mint(
            principal_id=principal.id,
            actor=actor,
            session_id=binding.id,
            sandbox_id=sandbox.id,
            scope_key=binding.scope_key,
            caps=caps,
            generation=sandbox.generation,
            ttl=s.settings.token_ttl_seconds,
            now=now,
        )
        grant = s.grant(
            binding,
            sandbox,
            scope,
            req,
            created=False,
            lease_expires=lease_expires,
            event_seq=_SEQ_MARK,
            token=minted,
            caps=caps,
        )
        head = tail = ""
        body: dict[str, Any] | None = None
        if claim is not None:
            body = grant.model_dump(mode="json")
            parts = json.dumps(body).split(str(_SEQ_MARK))
            if len(parts) != 2:
                return None
            head, tail = parts
        audit = audit_row(
            ctx,
            "session.ensure" if req.mode.creates else "session.attach",
            outcome="attached",
            scope_key=key,
            session_id=binding.id,
            sandbox_id=sandbox.id,
            details={"mode": req.mode.value, "caps": [c.value for c in caps]},
            now=now,
        )
        params = {
            "scope": key,
            "binding": binding.id,
            "sandbox": sandbox.id,
            "generation": sandbox.generation,
            "provider": sandbox.provider,
            "template": sandbox.template,
            "host": sandbox.host,
            "dataplane_http": sandbox.dataplane_http,
            "dataplane_ws": sandbox.dataplane_ws,
            "now": now,
            "claim": json.dumps(claim.params()) if claim is not None else None,
            "lease": json.dumps(lease),
            "token": json.dumps(
                {
                    "jti": minted.jti,
                    "binding_id": binding.id,
                    "sandbox_id": sandbox.id,
                    "principal_id": principal.lease_holder,
                    "key_id": principal.key_id,
                    "user_id": principal.effective_user,
                    "issued_at": minted.issued_at,
                    "expires_at": minted.expires_at,
                }
            ),
            "event": json.dumps(
                {
                    "event_type": "binding.attached",
                    "timestamp": rfc3339(now),
                    "actor": actor.model_dump(mode="json"),
                    "details": {
                        "binding": {"op": "attached", "principal": principal.id, "caps": caps}
                    },
                }
            ),
            "audit": json.dumps(audit),
            "head": head,
            "tail": tail,
            "take": json.dumps(charge.limiter.take_params(charge.who))
            if charge is not None and charge.limiter.rate > 0
            else None,
            "retained": RETAINED_EVENTS,
        }
        try:
            with s.store.autocommit() as conn:
                seq = int(conn.execute(CALL, params).scalar_one())
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != DECLINED:
                raise
            self.forget(key)
            return None
        grant.binding.last_event_sequence = seq
        if claim is not None and body is not None:
            body["binding"]["last_event_sequence"] = seq
            claim.settled(200, body)
        return Attached(grant)

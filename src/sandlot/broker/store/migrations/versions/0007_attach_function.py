"""PostgreSQL: an attach to a scope's live binding in one call (sandlot_attach)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 14:10:00

The statements of ``ensure``/``attach`` on an existing binding
(:mod:`sandlot.broker.quickattach`), run by the server in one transaction: the
idempotency claim, the binding and its sandbox checked against what the replica
knows, the activity stamp, the lease, the token (only if the caller's key is not
revoked), the ``binding.attached`` event with its ``NOTIFY``, the audit row, the
key's answer and the rate-limit token, in that order (the order of the locks of the
statements it replaces). Anything else (a claimed key, a binding or sandbox that
changed, a revoked key, an empty rate bucket) raises ``SL001`` before anything is
committed, and the replica negotiates as on SQLite. A later migration that changes
one of these tables' columns replaces the function with it. SQLite has none.
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION sandlot_attach(
    p_scope text,
    p_binding text,
    p_sandbox text,
    p_generation integer,
    p_provider text,
    p_template text,
    p_host text,
    p_dataplane_http text,
    p_dataplane_ws text,
    p_now double precision,
    p_claim json,
    p_lease json,
    p_token json,
    p_event json,
    p_audit json,
    p_answer_head text,
    p_answer_tail text,
    p_take json,
    p_retained bigint
) RETURNS bigint
LANGUAGE plpgsql
AS $fn$
DECLARE
    seq bigint;
    sb sandboxes%ROWTYPE;
BEGIN
    -- The idempotency claim: a key already claimed is the general path's to answer.
    IF p_claim IS NOT NULL THEN
        INSERT INTO idempotency (principal_id, key, fingerprint, state, owner, created_at,
                                 expires_at)
        VALUES (p_claim->>'p', p_claim->>'k', p_claim->>'fp', 'in_flight',
                p_claim->>'owner', (p_claim->>'now')::float8, (p_claim->>'until')::float8)
        ON CONFLICT (principal_id, key) DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idempotency key taken' USING ERRCODE = 'SL001';
        END IF;
    END IF;
    -- The scope's live binding and its sandbox, as the replica knows them.
    SELECT s.* INTO sb FROM bindings b JOIN sandboxes s ON s.id = b.sandbox_id
    WHERE b.live_scope = p_scope AND b.id = p_binding;
    IF NOT FOUND OR sb.id <> p_sandbox OR sb.state <> 'active'
       OR sb.generation <> p_generation OR sb.provider <> p_provider
       OR sb.template <> p_template OR sb.host IS DISTINCT FROM p_host
       OR sb.dataplane_http IS DISTINCT FROM p_dataplane_http
       OR sb.dataplane_ws IS DISTINCT FROM p_dataplane_ws THEN
        RAISE EXCEPTION 'binding changed' USING ERRCODE = 'SL001';
    END IF;
    -- An attach counts as activity; the stamp needs no rewrite more than once a second.
    IF p_now - sb.last_active_at > 1.0 THEN
        UPDATE sandboxes SET last_active_at = p_now WHERE id = p_sandbox;
    END IF;
    -- The lease, taken or renewed; then the token, only if its key is not revoked.
    INSERT INTO leases SELECT * FROM json_populate_record(NULL::leases, p_lease)
    ON CONFLICT (binding_id, principal_id) DO UPDATE SET
        user_id = excluded.user_id, actor_type = excluded.actor_type,
        actor_id = excluded.actor_id, caps = excluded.caps,
        expires_at = excluded.expires_at, released_at = excluded.released_at;
    INSERT INTO tokens (jti, binding_id, sandbox_id, principal_id, key_id, user_id,
                        issued_at, expires_at)
    SELECT t.jti, t.binding_id, t.sandbox_id, t.principal_id, t.key_id, t.user_id,
           t.issued_at, t.expires_at
    FROM json_populate_record(NULL::tokens, p_token) t, api_keys k
    WHERE k.id = t.key_id AND k.revoked_at IS NULL
    FOR SHARE OF k;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'key revoked' USING ERRCODE = 'SL001';
    END IF;
    -- The binding's next event, its NOTIFY (sent at commit); the binding still live.
    UPDATE bindings SET event_seq = event_seq + 1
    WHERE id = p_binding AND live_scope = p_scope RETURNING event_seq INTO seq;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'binding ended' USING ERRCODE = 'SL001';
    END IF;
    INSERT INTO events (stream_id, sequence, event, created_at)
    VALUES (p_binding, seq, json_build_object(
        'event_id', p_binding || '-' || seq,
        'sequence', seq,
        'event_type', p_event->>'event_type',
        'timestamp', p_event->>'timestamp',
        'actor', p_event->'actor',
        'details', p_event->'details',
        'binding_id', p_binding,
        'state', 'active'
    ), p_now);
    PERFORM pg_notify('sandlot_events', p_binding);
    IF seq > p_retained AND seq % 256 = 0 THEN
        DELETE FROM events WHERE stream_id = p_binding AND sequence <= seq - p_retained;
    END IF;
    -- The audit row, the key's answer, and last the rate-limit token.
    INSERT INTO audit (ts, request_id, action, outcome, principal_id, user_id, actor_type,
                       actor_id, scope_key, session_id, sandbox_id, details)
    SELECT a.ts, a.request_id, a.action, a.outcome, a.principal_id, a.user_id,
           a.actor_type, a.actor_id, a.scope_key, a.session_id, a.sandbox_id, a.details
    FROM json_populate_record(NULL::audit, p_audit) a;
    IF p_claim IS NOT NULL THEN
        UPDATE idempotency SET state = 'done', status = 200,
            response = (p_answer_head || seq || p_answer_tail)::json
        WHERE principal_id = p_claim->>'p' AND key = p_claim->>'k';
    END IF;
    IF p_take IS NOT NULL THEN
        INSERT INTO rate_buckets (who, tokens, stamp)
        VALUES (p_take->>'who', (p_take->>'burst')::float8 - 1, (p_take->>'now')::float8)
        ON CONFLICT (who) DO UPDATE SET
            tokens = LEAST((p_take->>'burst')::float8, rate_buckets.tokens
                     + GREATEST(0, (p_take->>'now')::float8 - rate_buckets.stamp)
                     * (p_take->>'rate')::float8) - 1,
            stamp = GREATEST((p_take->>'now')::float8, rate_buckets.stamp)
        WHERE LEAST((p_take->>'burst')::float8, rate_buckets.tokens
              + GREATEST(0, (p_take->>'now')::float8 - rate_buckets.stamp)
              * (p_take->>'rate')::float8) >= 1;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'rate limited' USING ERRCODE = 'SL001';
        END IF;
    END IF;
    RETURN seq;
END
$fn$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DROP FUNCTION IF EXISTS sandlot_attach(text, text, text, integer, text, text, "
            "text, text, text, double precision, json, json, json, json, json, text, text, "
            "json, bigint)"
        )

"""Tables of the broker's store (SQLAlchemy Core; migrations in ``migrations/``).

Atomic ``ensure`` rests on ``bindings.live_scope``: it holds the scope key
while the binding is live and NULL afterwards, under a UNIQUE constraint, so
two concurrent creators of one scope cannot both commit (NULLs never collide,
on SQLite and PostgreSQL alike).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("prefix", String(16), nullable=False, unique=True),
    Column("secret_hash", String(64), nullable=False),
    Column("user_id", String(200), nullable=False, index=True),
    Column("principal_type", String(16), nullable=False),
    Column("principal_id", String(200), nullable=False),
    Column("name", String(200)),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
)

scopes = Table(
    "scopes",
    metadata,
    Column("scope_key", String(260), primary_key=True),
    Column("owner_user_id", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
)

scope_members = Table(
    "scope_members",
    metadata,
    Column("scope_key", String(260), primary_key=True),
    Column("user_id", String(200), primary_key=True),
    Column("added_at", Float, nullable=False),
)

sandboxes = Table(
    "sandboxes",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(63)),
    Column("owner_user_id", String(200), index=True),
    Column("template", String(63), nullable=False),
    Column("provider", String(40), nullable=False),
    Column("state", String(16), nullable=False, index=True),
    Column("generation", Integer, nullable=False, default=1),
    Column("scope_key", String(260)),
    Column("pool", String(63), index=True),
    Column("reason", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("last_active_at", Float, nullable=False),
    Column("idle_since", Float),
    Column("hard_deadline", Float, nullable=False),
    Column("idle_timeout", Integer, nullable=False),
    Column("live_name", String(270), unique=True),
    Column("event_seq", BigInteger, nullable=False, default=0),
    #: The sandbox host that runs it (:mod:`sandlot.broker.hosts`); NULL: any host may.
    Column("host", String(80), index=True),
    #: Where its dataplane answers, as its host made it: every replica grants the same.
    Column("dataplane_http", String(400)),
    Column("dataplane_ws", String(400)),
)

bindings = Table(
    "bindings",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("scope_key", String(260), nullable=False, index=True),
    Column("live_scope", String(260), unique=True),
    Column("sandbox_id", String(40), nullable=False, index=True),
    Column("owner_user_id", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("ended_at", Float),
    Column("event_seq", BigInteger, nullable=False, default=0),
)

leases = Table(
    "leases",
    metadata,
    Column("binding_id", String(40), primary_key=True),
    Column("principal_id", String(200), primary_key=True),
    Column("user_id", String(200), nullable=False),
    Column("actor_type", String(16), nullable=False),
    Column("actor_id", String(200), nullable=False),
    Column("caps", JSON, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("released_at", Float),
)

tokens = Table(
    "tokens",
    metadata,
    Column("jti", String(40), primary_key=True),
    Column("binding_id", String(40), nullable=False),
    Column("sandbox_id", String(40), nullable=False),
    Column("principal_id", String(200), nullable=False),
    Column("issued_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False, index=True),
    # Indexed: every process that serves sandboxes polls for new revocations.
    Column("revoked_at", Float, index=True),
    #: The API key whose caller the token was minted for (revoking the key revokes it).
    Column("key_id", String(40), index=True),
    #: The user the token acts for (revoking all of a user's keys revokes it too).
    Column("user_id", String(200), index=True),
    Index("ix_tokens_binding_principal", "binding_id", "principal_id"),
)

#: A removed member's API keys cut off one sandbox of the scope for a while: pushed to its
#: dataplane like a revoked token, so the sockets the keys opened there close
#: (``sandlot.broker.revocations``); rows are deleted an hour after they end.
access_cuts = Table(
    "access_cuts",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("sandbox_id", String(40), nullable=False),
    Column("key_id", String(40), nullable=False),
    Column("cut_at", Float, nullable=False, index=True),
    Column("expires_at", Float, nullable=False),
)

#: Ordered event logs of bindings (2.6) and of sandboxes' lifecycle (2.8), by stream id.
events = Table(
    "events",
    metadata,
    Column("stream_id", String(40), primary_key=True),
    Column("sequence", BigInteger, primary_key=True),
    Column("event", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
)

audit = Table(
    "audit",
    metadata,
    # 64 bits on PostgreSQL (a 32-bit serial ends after 2**31 rows); on SQLite an INTEGER
    # PRIMARY KEY is 64 bits already, and only that spelling makes it the row id.
    Column(
        "id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("ts", Float, nullable=False, index=True),
    Column("request_id", String(80)),
    Column("action", String(40), nullable=False),
    Column("outcome", String(40), nullable=False),
    Column("principal_id", String(200)),
    Column("user_id", String(200), index=True),
    Column("actor_type", String(16)),
    Column("actor_id", String(200)),
    Column("scope_key", String(260), index=True),
    Column("session_id", String(40)),
    Column("sandbox_id", String(40)),
    Column("details", JSON),
)

idempotency = Table(
    "idempotency",
    metadata,
    Column("principal_id", String(200), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("owner", String(64), nullable=False),
    Column("status", Integer),
    Column("response", JSON),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False, index=True),
)

templates = Table(
    "templates",
    metadata,
    Column("name", String(63), primary_key=True),
    Column("spec", JSON, nullable=False),
    Column("source", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
)

volumes = Table(
    "volumes",
    metadata,
    Column("name", String(63), primary_key=True),
    Column("owner_user_id", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
)

pools = Table(
    "pools",
    metadata,
    Column("name", String(63), primary_key=True),
    Column("template", String(63), nullable=False),
    Column("min_ready", Integer, nullable=False),
    Column("max_ready", Integer, nullable=False),
    Column("source", String(16), nullable=False),
)

#: Negotiation rate buckets shared by replicas (PostgreSQL; SQLite keeps them in memory).
rate_buckets = Table(
    "rate_buckets",
    metadata,
    Column("who", String(200), primary_key=True),
    Column("tokens", Float, nullable=False),
    Column("stamp", Float, nullable=False),
)

#: Sandbox hosts (:mod:`sandlot.broker.fleet`): each process that runs sandboxes on a
#: server store registers here and stamps ``heartbeat_at``; brokers place new sandboxes on
#: the hosts with a ``provider_url`` and declare ``lost`` the ones whose heartbeat lapses.
hosts = Table(
    "hosts",
    metadata,
    Column("id", String(80), primary_key=True),
    Column("provider", String(40), nullable=False),
    #: Where brokers reach its provider API (NULL: only its own process does, embedded).
    Column("provider_url", String(400)),
    #: The secret its provider API asks for (read by brokers, never sent to clients).
    Column("credential", String(200)),
    Column("dataplane_url", String(400), nullable=False),
    #: How many sandboxes it runs at most (live and terminating count).
    Column("capacity", Integer, nullable=False),
    #: ``up`` or ``lost``.
    Column("state", String(16), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
    Column("lost_at", Float),
)

#: Credentials of sandbox hosts that register through the brokers' API instead of the
#: store (:mod:`sandlot.broker.hostkeys`): issued by an admin, one per host id, stored
#: hashed like API keys.
host_keys = Table(
    "host_keys",
    metadata,
    #: The host id the credential stands for (``h_…``): its holder registers as that host.
    Column("id", String(80), primary_key=True),
    Column("secret_hash", String(64), nullable=False),
    Column("name", String(200)),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
)

signing_keys = Table(
    "signing_keys",
    metadata,
    Column("kid", String(40), primary_key=True),
    Column("private_pem", Text, nullable=False),
    Column("public_jwk", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("retired_at", Float),
    UniqueConstraint("kid"),
)

#: Identities made once per store and shared by every process on it: the ``kubernetes``
#: provider's instance (the label its pods carry, :func:`sandlot.broker.identities.identity`).
identities = Table(
    "identities",
    metadata,
    Column("name", String(80), primary_key=True),
    Column("value", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
)

#: Browser sessions of the web workspace (:mod:`sandlot.broker.browsersessions`), shared by
#: replicas: looked up by the SHA-256 of the cookie's id; the user's API key is sealed
#: under a key derived from that id, so the store alone cannot read it.
web_sessions = Table(
    "web_sessions",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("user_id", String(200), nullable=False, index=True),
    Column("credential", Text),
    Column("created_at", Float, nullable=False),
    Column("last_seen", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("checked_at", Float, nullable=False),
)

#: One-time sign-in links: the secret kept as its SHA-256, the credential sealed under it.
web_links = Table(
    "web_links",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("secret_hash", String(64), nullable=False),
    Column("user_id", String(200), nullable=False),
    Column("credential", Text),
    Column("next_path", Text, nullable=False),
    Column("expires_at", Float, nullable=False),
)

__all__ = [
    "access_cuts",
    "api_keys",
    "audit",
    "bindings",
    "events",
    "hosts",
    "idempotency",
    "identities",
    "leases",
    "metadata",
    "pools",
    "rate_buckets",
    "sandboxes",
    "scope_members",
    "scopes",
    "signing_keys",
    "templates",
    "tokens",
    "volumes",
    "web_links",
    "web_sessions",
]

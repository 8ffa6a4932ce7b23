"""PostgreSQL: an ensure on a binding a replica knows is one call of ``sandlot_attach``
(:mod:`sandlot.broker.quickattach`), and answers exactly as the general path would
whenever what the replica knows is no longer so."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from tests.broker.test_e2e import FAST_REAPER, wait_active
from tests.pg import postgres_cluster
from tests.servers import SandlotServer, free_port

NEGOTIATE = "/v1/sandbox/sessions"
#: Statements are counted as they end (only those that succeed).
PG_OPTIONS = "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"


class Replicas:
    def __init__(self, url: str, a: SandlotServer, b: SandlotServer) -> None:
        self.a, self.b = a, b
        self.engine: Engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        with self.engine.begin() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))

    def calls(self) -> int:
        """Calls of ``sandlot_attach`` that committed (one per quick attach)."""
        with self.engine.begin() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                        "WHERE query LIKE 'SELECT sandlot_attach(%'"
                    )
                ).scalar_one()
            )

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.begin() as conn:
            return conn.execute(text(sql), params).scalar_one()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    base = tmp_path_factory.mktemp("quick")
    with postgres_cluster(PG_OPTIONS) as url, contextlib.ExitStack() as stack:
        config = FAST_REAPER + f'\n[server]\nstore_url = "{url}"\n'
        ports = [free_port(), free_port()]
        issuer = f"http://127.0.0.1:{ports[0]}"
        servers = []
        for name, port in zip(("a", "b"), ports, strict=True):
            own = f"http://127.0.0.1:{port}"
            env = {"SANDLOT_PUBLIC_URL": issuer, "SANDLOT_DATAPLANE_URL": own}
            srv = SandlotServer(base / name, config=config, env=env)
            srv.port = port
            stack.callback(srv.cleanup)
            stack.callback(srv.stop)
            srv.start(timeout=120)
            srv.url = own
            servers.append(srv)
        found = Replicas(url, *servers)
        try:
            yield found
        finally:
            found.engine.dispose()


def ensure(srv: SandlotServer, headers: dict[str, str], thread: str, **more: Any) -> Any:
    return httpx.post(
        f"{srv.url}{NEGOTIATE}",
        json={"thread_id": thread, "mode": "ensure"},
        headers=headers,
        timeout=30,
        **more,
    )


def _live(replicas: Replicas, thread: str) -> int:
    return int(
        replicas.scalar("SELECT count(*) FROM bindings WHERE live_scope = :k", k=f"thread:{thread}")
    )


@pytest.mark.timeout(180)
def test_an_attach_the_replica_knows_is_one_call(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    headers = a.headers("quick")
    first = ensure(a, headers, "thr_q")
    assert first.status_code == 200, first.text
    wait_active(a.url, headers, first.json())
    before = replicas.calls()
    grants = []
    for i in range(3):
        r = ensure(a, {**headers, "Idempotency-Key": f"q-{i}"}, "thr_q")
        assert r.status_code == 200, r.text
        grants.append(r.json())
    # The first after the creation learns the active sandbox; the next ones are one call.
    assert replicas.calls() - before >= 2
    g = grants[-1]
    assert g["session_id"] == first.json()["session_id"]
    assert g["binding"]["created"] is False and g["binding"]["state"] == "active"
    sid = g["session_id"]
    # What the call wrote is what the general path writes: the event the answer names,
    # the token, the lease, the audit row, the key's answer.
    seq = g["binding"]["last_event_sequence"]
    event = replicas.scalar(
        "SELECT event FROM events WHERE stream_id = :s AND sequence = :q", s=sid, q=seq
    )
    assert event["event_type"] == "binding.attached"
    assert event["binding_id"] == sid and event["state"] == "active"
    assert event["details"]["binding"]["op"] == "attached"
    assert replicas.scalar("SELECT max(sequence) FROM events WHERE stream_id = :s", s=sid) == seq
    snap = httpx.get(f"{b.url}{NEGOTIATE}/{sid}", headers=headers, timeout=30).json()
    assert snap["binding"]["last_event_sequence"] >= seq
    jti = replicas.scalar(
        "SELECT jti FROM tokens WHERE binding_id = :s ORDER BY issued_at DESC, jti LIMIT 1", s=sid
    )
    assert jti
    assert (
        replicas.scalar(
            "SELECT count(*) FROM audit WHERE session_id = :s AND outcome = 'attached'", s=sid
        )
        >= 3
    )
    # A retry of a key replays the answer recorded with the work, sequence included.
    again = ensure(a, {**headers, "Idempotency-Key": "q-2"}, "thr_q")
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json() == g
    # The same key with another body: 422, as on the general path.
    other = httpx.post(
        f"{a.url}{NEGOTIATE}",
        json={"thread_id": "thr_q", "mode": "attach_only"},
        headers={**headers, "Idempotency-Key": "q-2"},
        timeout=30,
    )
    assert other.status_code == 422, other.text
    # The token works at the sandbox's dataplane.
    r = httpx.post(
        f"{g['dataplane']['http_base_url']}/exec",
        json={"command": "echo quick"},
        headers={"Authorization": f"Bearer {g['token']}"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["stdout"] == "quick\n", r.text


@pytest.mark.timeout(180)
def test_a_binding_ended_elsewhere_is_not_attached(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    headers = a.headers("ended")
    g = ensure(a, headers, "thr_end").json()
    wait_active(a.url, headers, g)
    assert ensure(a, headers, "thr_end").json()["session_id"] == g["session_id"]
    # Released and terminated through the other replica: replica a still remembers it.
    r = httpx.delete(
        f"{b.url}{NEGOTIATE}/{g['session_id']}?terminate=true", headers=headers, timeout=60
    )
    assert r.status_code in (202, 204), r.text
    before = replicas.calls()
    fresh = ensure(a, headers, "thr_end")
    assert fresh.status_code == 200, fresh.text
    assert fresh.json()["session_id"] != g["session_id"]
    assert fresh.json()["binding"]["created"] is True
    assert replicas.calls() == before
    assert _live(replicas, "thr_end") == 1


@pytest.mark.timeout(180)
def test_a_revoked_key_is_refused_at_once(replicas: Replicas) -> None:
    a = replicas.a
    key = a.key("revoked")
    headers = {"Authorization": f"Bearer {key}"}
    g = ensure(a, headers, "thr_rev").json()
    wait_active(a.url, headers, g)
    ensure(a, headers, "thr_rev")
    before = replicas.calls()
    assert ensure(a, headers, "thr_rev").status_code == 200
    assert replicas.calls() == before + 1
    # Revoked in the store alone (as another replica or the CLI would): the replica still
    # trusts its look-up of the key for a second, the token's check does not.
    with replicas.engine.begin() as conn:
        revoked = conn.execute(
            text(
                "UPDATE api_keys SET revoked_at = :now WHERE id = "
                "(SELECT id FROM api_keys WHERE user_id = 'revoked' ORDER BY created_at DESC "
                "LIMIT 1)"
            ),
            {"now": time.time()},
        ).rowcount
    assert revoked == 1
    r = ensure(a, headers, "thr_rev")
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "UNAUTHENTICATED"


@pytest.mark.timeout(180)
def test_a_member_attaches_through_the_general_path(replicas: Replicas) -> None:
    a = replicas.a
    owner, member = a.headers("owner"), a.headers("member")
    g = ensure(a, owner, "thr_shared").json()
    wait_active(a.url, owner, g)
    ensure(a, owner, "thr_shared")
    assert ensure(a, member, "thr_shared").status_code == 403
    r = httpx.post(
        f"{a.url}/v1/sandbox/scopes/thread/thr_shared/members",
        json={"user_id": "member"},
        headers=owner,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    r = ensure(a, member, "thr_shared")
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] == g["session_id"]

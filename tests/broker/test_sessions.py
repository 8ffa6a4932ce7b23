"""Sessions through the broker's ASGI app, with a provider fake (tier 2)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import jwt
import pytest
import sqlalchemy

from sandlot.broker.events import append_event, bindings
from tests.broker.conftest import Clock, Harness, MakeHarness
from tests.broker.fakes import DownProvider, FakeProvider
from tests.figures import RecordProperty, report


def assert_error(resp, status: int, code: str) -> dict:  # type: ignore[no-untyped-def]
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert err["code"] == code
    assert err["domain"] == "sandlot"
    assert err["request_id"] == resp.headers["x-request-id"]
    assert isinstance(err["retryable"], bool)
    return err


async def ensure(h: Harness, headers: dict, **body):  # type: ignore[no-untyped-def]
    body.setdefault("thread_id", "thr_1")
    body.setdefault("mode", "ensure")
    return await h.client.post("/v1/sandbox/sessions", json=body, headers=headers)


async def test_mvp_ensure_creates_then_attaches(harness: Harness) -> None:
    alice = harness.key("alice")
    r1 = await ensure(harness, alice)
    assert r1.status_code == 200, r1.text
    g1 = r1.json()
    assert g1["protocol_version"] == "1.0"
    assert g1["session_id"] == g1["binding"]["id"]
    assert g1["thread_id"] == "thr_1"
    assert g1["binding"]["created"] is True
    assert g1["binding"]["scope"] == {"type": "thread", "id": "thr_1"}
    assert g1["binding"]["state"] in ("provisioning", "active")
    assert g1["token"] == g1["credentials"]["access_token"]
    assert g1["refresh_url"] == f"/v1/sandbox/sessions/{g1['session_id']}/refresh"
    assert g1["sandbox"]["http_base_url"].endswith(f"/dp/{g1['sandbox']['id']}/v1")
    assert set(g1["credentials"]["granted_capabilities"]) == {
        "fs_read",
        "fs_write",
        "exec",
        "shell",
        "shell_observe",
    }
    claims = jwt.decode(g1["token"], options={"verify_signature": False})
    assert claims["sandbox_id"] == g1["sandbox"]["id"]
    assert claims["sid"] == g1["session_id"]
    assert claims["scope"] == "thread:thr_1"
    assert claims["typ"] == "sandbox+jwt" and claims["aud"] == "sandlot-dataplane"
    assert claims["act"] == {"type": "human", "id": "human:alice"}
    assert jwt.get_unverified_header(g1["token"])["alg"] == "EdDSA"

    r2 = await ensure(harness, alice)
    g2 = r2.json()
    assert g2["session_id"] == g1["session_id"]
    assert g2["sandbox"]["id"] == g1["sandbox"]["id"]
    assert g2["binding"]["created"] is False
    assert g2["binding"]["last_event_sequence"] > g1["binding"]["last_event_sequence"]
    assert len(harness.provider.created) == 1


async def test_full_shape_modes(harness: Harness) -> None:
    bob = harness.key("bob", "agent")
    scope = {"type": "workspace", "id": "ws_9"}
    r = await harness.client.post(
        "/v1/sandbox/sessions", json={"scope": scope, "mode": "get"}, headers=bob
    )
    assert_error(r, 404, "SESSION_NOT_FOUND")
    r = await harness.client.post(
        "/v1/sandbox/sessions", json={"scope": scope, "mode": "attach_only"}, headers=bob
    )
    assert_error(r, 404, "SESSION_NOT_FOUND")
    r = await harness.client.post(
        "/v1/sandbox/sessions",
        json={
            "scope": scope,
            "mode": "create_only",
            "actor": {"type": "agent", "id": "a1"},
            "requested_capabilities": ["fs_read", "exec"],
            "template": "default",
        },
        headers=bob,
    )
    assert r.status_code == 200, r.text
    grant = r.json()
    assert grant["credentials"]["granted_capabilities"] == ["exec", "fs_read"]
    assert grant["thread_id"] is None
    r = await harness.client.post(
        "/v1/sandbox/sessions", json={"scope": scope, "mode": "create_only"}, headers=bob
    )
    assert_error(r, 409, "SESSION_CONFLICT")
    r = await harness.client.post(
        "/v1/sandbox/sessions", json={"scope": scope, "mode": "attach_only"}, headers=bob
    )
    assert r.status_code == 200 and r.json()["session_id"] == grant["session_id"]


async def test_capabilities_and_actor_checked(harness: Harness) -> None:
    agent = harness.key("carol", "agent")
    r = await ensure(harness, agent, requested_capabilities=["fs_read", "root"])
    assert_error(r, 400, "INVALID_REQUEST")
    r = await ensure(harness, agent, actor={"type": "human", "id": "x"})
    assert_error(r, 403, "FORBIDDEN")
    r = await ensure(harness, agent)
    assert set(r.json()["credentials"]["granted_capabilities"]) == {"fs_read", "fs_write", "exec"}


async def test_capability_policy_denies(make_harness: MakeHarness) -> None:
    from sandlot.broker.settings import CapabilityPolicy
    from sandlot.protocol.common import ActorType, Capability

    h = await make_harness(
        capabilities={
            ActorType.HUMAN: CapabilityPolicy(frozenset(Capability), frozenset(Capability)),
            ActorType.AGENT: CapabilityPolicy(
                frozenset({Capability.FS_READ}), frozenset({Capability.FS_READ, Capability.EXEC})
            ),
        }
    )
    err = assert_error(
        await ensure(h, h.key("dan", "agent"), requested_capabilities=["exec", "shell"]),
        403,
        "CAPABILITY_DENIED",
    )
    assert err["metadata"]["capability"] == "shell"


async def test_scope_ownership_and_sharing(harness: Harness) -> None:
    alice, mallory = harness.key("alice"), harness.key("mallory")
    alice_agent = harness.key("alice", "agent")
    g = (await ensure(harness, alice)).json()
    assert_error(await ensure(harness, mallory), 403, "FORBIDDEN")
    assert_error(
        await harness.client.get(f"/v1/sandbox/sessions/{g['session_id']}", headers=mallory),
        403,
        "FORBIDDEN",
    )
    # The user's agent shares the user's scopes.
    ga = (await ensure(harness, alice_agent)).json()
    assert ga["session_id"] == g["session_id"]
    # Only the owner shares.
    r = await harness.client.post(
        "/v1/sandbox/scopes/thread/thr_1/members", json={"user_id": "mallory"}, headers=mallory
    )
    assert_error(r, 403, "FORBIDDEN")
    r = await harness.client.post(
        "/v1/sandbox/scopes/thread/thr_1/members", json={"user_id": "mallory"}, headers=alice
    )
    assert r.status_code == 200 and r.json()["members"] == ["mallory"]
    assert (await ensure(harness, mallory)).json()["session_id"] == g["session_id"]
    r = await harness.client.delete(
        "/v1/sandbox/scopes/thread/thr_1/members/mallory", headers=alice
    )
    assert r.status_code == 204
    assert_error(await ensure(harness, mallory), 403, "FORBIDDEN")


async def test_service_principal_on_behalf_of(harness: Harness) -> None:
    svc = harness.key("platform", "service", principal="svc:agent-server")
    human = harness.key("erin", "human")
    headers = {**svc, "X-Sandlot-On-Behalf-Of": "erin"}
    g = (await ensure(harness, headers, thread_id="thr_e")).json()
    assert g["binding"]["owner_user_id"] == "erin"
    claims = jwt.decode(g["token"], options={"verify_signature": False})
    assert claims["act"]["type"] == "agent"
    assert (await ensure(harness, human, thread_id="thr_e")).json()["session_id"] == g["session_id"]
    bad = {**human, "X-Sandlot-On-Behalf-Of": "erin"}
    assert_error(await ensure(harness, bad), 403, "FORBIDDEN")


async def test_get_refresh_heartbeat_release_terminate(harness: Harness) -> None:
    alice, agent = harness.key("alice"), harness.key("alice", "agent")
    g = (await ensure(harness, alice)).json()
    ga = (await ensure(harness, agent)).json()
    sid = g["session_id"]
    snap = (await harness.client.get(f"/v1/sandbox/sessions/{sid}", headers=alice)).json()
    assert snap["binding"]["id"] == sid and "token" not in snap
    assert snap["binding"]["last_event_sequence"] >= 3

    for path in ("refresh", "refresh-token"):
        r = await harness.client.post(f"/v1/sandbox/sessions/{sid}/{path}", json={}, headers=alice)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["token"] != g["token"] and body["credentials"]["access_token"] == body["token"]

    r = await harness.client.post(f"/v1/sandbox/sessions/{sid}/heartbeat", headers=alice)
    assert r.status_code == 200 and r.json()["state"] in ("active", "provisioning")

    r = await harness.client.delete(f"/v1/sandbox/sessions/{sid}", headers=alice)
    assert r.status_code == 204
    revoked = {t.jti for t in harness.provider.revoked}
    assert jwt.decode(g["token"], options={"verify_signature": False})["jti"] in revoked
    assert jwt.decode(ga["token"], options={"verify_signature": False})["jti"] not in revoked
    assert_error(
        await harness.client.post(f"/v1/sandbox/sessions/{sid}/refresh", json={}, headers=alice),
        410,
        "SESSION_EXPIRED",
    )
    # The agent still holds its lease: the sandbox lives on.
    r = await harness.client.post(f"/v1/sandbox/sessions/{sid}/refresh", json={}, headers=agent)
    assert r.status_code == 200
    # Only the owner (a human or agent of the owning user) or an admin terminates.
    r = await harness.client.delete(f"/v1/sandbox/sessions/{sid}?terminate=true", headers=agent)
    assert r.status_code == 204
    assert harness.provider.deleted == [g["sandbox"]["id"]]
    assert_error(
        await harness.client.post(f"/v1/sandbox/sessions/{sid}/heartbeat", headers=agent),
        410,
        "SESSION_EXPIRED",
    )
    snap = (await harness.client.get(f"/v1/sandbox/sessions/{sid}", headers=alice)).json()
    assert snap["binding"]["state"] == "terminated"
    g2 = (await ensure(harness, alice)).json()
    assert g2["session_id"] != sid and g2["binding"]["created"] is True


@pytest.mark.reliability
async def test_idempotency(harness: Harness, record_property: RecordProperty) -> None:
    alice = harness.key("alice")
    key = {**alice, "Idempotency-Key": "8e03978e-40d5-43e8-bc93-6894a57f9324"}
    body = {"thread_id": "thr_i", "mode": "ensure"}
    r1 = await harness.client.post("/v1/sandbox/sessions", json=body, headers=key)
    r2 = await harness.client.post("/v1/sandbox/sessions", json=body, headers=key)
    assert r1.status_code == r2.status_code == 200
    assert r1.json() == r2.json()
    assert r2.headers.get("idempotent-replayed") == "true"
    assert len(harness.provider.created) == 1
    r3 = await harness.client.post(
        "/v1/sandbox/sessions", json={**body, "thread_id": "thr_other"}, headers=key
    )
    assert_error(r3, 422, "IDEMPOTENCY_KEY_REUSED")
    # Errors are stored too.
    k2 = {**alice, "Idempotency-Key": "k2"}
    e1 = await harness.client.post(
        "/v1/sandbox/sessions", json={"thread_id": "nope", "mode": "get"}, headers=k2
    )
    e2 = await harness.client.post(
        "/v1/sandbox/sessions", json={"thread_id": "nope", "mode": "get"}, headers=k2
    )
    assert e1.status_code == e2.status_code == 404
    assert e1.json() == e2.json()
    # Another caller's identical key is a different key.
    other = {**harness.key("bob"), "Idempotency-Key": "8e03978e-40d5-43e8-bc93-6894a57f9324"}
    r4 = await harness.client.post(
        "/v1/sandbox/sessions", json={"thread_id": "thr_b", "mode": "ensure"}, headers=other
    )
    assert r4.status_code == 200 and r4.json()["session_id"] != r1.json()["session_id"]
    report(
        record_property,
        "idempotency: replay returns the stored response (1 sandbox), errors replayed too, "
        "same key with another body 422, same key of another caller independent",
    )


async def test_rate_limit_and_quota(make_harness: MakeHarness) -> None:
    h = await make_harness(negotiation_rate_per_second=1.0, negotiation_burst=2)
    k = h.key("rl")
    assert (await ensure(h, k, thread_id="a")).status_code == 200
    assert (await ensure(h, k, thread_id="a")).status_code == 200
    r = await ensure(h, k, thread_id="a")
    err = assert_error(r, 429, "RATE_LIMITED")
    assert err["retryable"] is True and int(r.headers["retry-after"]) >= 1

    h2 = await make_harness(max_live_sandboxes_per_user=2)
    k2 = h2.key("q")
    for t in ("t1", "t2"):
        assert (await ensure(h2, k2, thread_id=t)).status_code == 200
    err = assert_error(await ensure(h2, k2, thread_id="t3"), 429, "QUOTA_EXCEEDED")
    assert err["retryable"] is False
    # Attaching to an existing binding is not a new sandbox.
    assert (await ensure(h2, k2, thread_id="t1")).status_code == 200


async def test_scope_promotion(make_harness: MakeHarness) -> None:
    h = await make_harness(promote_thread_to_assistant=True)
    k = h.key("pat")
    g1 = (await ensure(h, k, thread_id="thr_a", assistant_id="asst_1")).json()
    g2 = (await ensure(h, k, thread_id="thr_b", assistant_id="asst_1")).json()
    assert g1["binding"]["scope"] == {"type": "assistant", "id": "asst_1"}
    assert g1["thread_id"] == "thr_a"
    assert g1["session_id"] == g2["session_id"]
    g3 = (await ensure(h, k, thread_id="thr_c")).json()
    assert g3["binding"]["scope"] == {"type": "thread", "id": "thr_c"}


async def test_bad_input_never_500(harness: Harness) -> None:
    alice = harness.key("alice")
    c = harness.client
    assert_error(
        await c.post("/v1/sandbox/sessions", json={"mode": "ensure"}), 401, "UNAUTHENTICATED"
    )
    assert_error(
        await c.post("/v1/sandbox/sessions", json={}, headers={"Authorization": "Bearer nope"}),
        401,
        "UNAUTHENTICATED",
    )
    for body in (
        b"{",
        b"[]",
        b"null",
        b'{"thread_id": 5}',
        b'{"thread_id": "a\\u0000b"}',
        b'{"thread_id": "t", "mode": "explode"}',
        b'{"scope": {"type": "galaxy", "id": "x"}}',
        b'{"thread_id": "' + b"x" * 500 + b'"}',
        b"",
    ):
        r = await c.post("/v1/sandbox/sessions", content=body, headers=alice)
        assert_error(r, 400, "INVALID_REQUEST")
    assert_error(await c.get("/v1/nothing", headers=alice), 404, "NOT_FOUND")
    assert_error(
        await c.get("/v1/sandbox/sessions/ssn_missing", headers=alice), 404, "SESSION_NOT_FOUND"
    )
    assert_error(await c.put("/v1/sandbox/sessions", headers=alice), 400, "INVALID_REQUEST")
    assert_error(
        await c.post("/v1/sandbox/sessions", content=b"x" * (2 << 20), headers=alice),
        413,
        "PAYLOAD_TOO_LARGE",
    )
    r = await c.get("/healthz", headers={"X-Request-Id": "my-req-1"})
    assert r.headers["x-request-id"] == "my-req-1"


async def test_provider_faults(make_harness: MakeHarness) -> None:
    crash = await make_harness(FakeProvider({"crash_on_create": True}))
    g = (await ensure(crash, crash.key("u"))).json()
    await crash.broker.sandboxes.drain()
    snap = (
        await crash.client.get(f"/v1/sandbox/sessions/{g['session_id']}", headers=crash.key("u"))
    ).json()
    assert snap["binding"]["state"] == "failed"

    down = await make_harness(DownProvider())
    g = (await ensure(down, down.key("u"))).json()
    await down.broker.sandboxes.drain()
    snap = (
        await down.client.get(f"/v1/sandbox/sessions/{g['session_id']}", headers=down.key("u"))
    ).json()
    assert snap["binding"]["state"] == "failed"
    # The scope is free again: a new ensure creates a new binding.
    assert (await ensure(down, down.key("u"))).json()["binding"]["created"] is True

    clock = Clock()
    never = await make_harness(FakeProvider({"never_ready": True}), clock=clock)
    k = never.key("u")
    g = (await ensure(never, k)).json()
    assert g["binding"]["state"] == "provisioning"
    clock.advance(never.broker.settings.provision_timeout_seconds + 1)
    report = await never.broker.reaper.run_once()
    assert g["sandbox"]["id"] in report.failed
    snap = (await never.client.get(f"/v1/sandbox/sessions/{g['session_id']}", headers=k)).json()
    assert snap["binding"]["state"] in ("failed", "terminated")


@pytest.mark.parametrize("n", [50])
async def test_concurrent_ensure_in_process(harness: Harness, n: int) -> None:
    k = harness.key("conc")
    results = await asyncio.gather(*(ensure(harness, k, thread_id="thr_c") for _ in range(n)))
    assert all(r.status_code == 200 for r in results)
    assert len({r.json()["session_id"] for r in results}) == 1
    assert len(harness.provider.created) == 1


async def test_sequence_expired_and_provider_unavailable(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeProvider({"never_ready": True}))
    k = h.key("alice")
    g = (await ensure(h, k)).json()
    from sqlalchemy import delete

    from sandlot.broker.store.schema import events

    with h.broker.store.write() as conn:
        conn.execute(
            delete(events).where(events.c.stream_id == g["session_id"], events.c.sequence <= 1)
        )
    r = await h.client.get(f"/v1/sandbox/sessions/{g['session_id']}/events?after=0", headers=k)
    assert_error(r, 410, "SEQUENCE_EXPIRED")
    api = {"X-Api-Key": k["Authorization"].split()[1]}
    r = await h.client.post(
        "/v2/sandboxes/boxes",
        json={"name": "slow", "wait_for_ready": True, "timeout": 0.3},
        headers=api,
    )
    err = assert_error(r, 503, "PROVIDER_UNAVAILABLE")
    assert err["retryable"] is True and "retry-after" in r.headers


async def test_event_cursors_out_of_range_are_client_errors(make_harness: MakeHarness) -> None:
    """Cursors beyond the store's 64-bit range, or not ASCII digits, are 400 (they were 500)."""
    h = await make_harness(admins=frozenset({"root"}))
    k = h.key("alice")
    g = (await ensure(h, k)).json()
    for stream in (
        f"/v1/sandbox/sessions/{g['session_id']}/events",
        f"/v1/sandboxes/{g['sandbox']['id']}/events",
    ):
        for query, extra in (
            (f"?after={1 << 64}", {}),
            ("", {"Last-Event-ID": b"\xb2"}),
            ("", {"Last-Event-ID": str(1 << 64)}),
        ):
            r = await h.client.get(stream + query, headers={**k, **extra})
            assert_error(r, 400, "INVALID_REQUEST")
    r = await h.client.get(f"/v1/audit?after={1 << 64}", headers=h.key("root"))
    assert_error(r, 400, "INVALID_REQUEST")


async def _follow(base: str, headers: dict[str, str], session_id: str, seen: list[str]) -> None:
    """Follow a session's events over a real socket, noting each event's type."""
    url = f"{base}/v1/sandbox/sessions/{session_id}/events?after=0"
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("GET", url, headers=headers) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                seen.append(line[len("event: ") :])


@contextlib.asynccontextmanager
async def _followers(h: Harness, headers: dict[str, str], session_id: str, n: int) -> Any:
    """``n`` streams of a session's events, each past its backlog: their events seen."""
    base = await h.serve()
    seen: list[list[str]] = [[] for _ in range(n)]
    tasks = [asyncio.create_task(_follow(base, headers, session_id, s)) for s in seen]
    try:
        while not all(seen):
            await asyncio.sleep(0.02)
        yield seen
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def _statements(h: Harness, containing: str = "") -> Any:
    """The SQL statements the broker sends while inside (those containing ``containing``)."""
    sent: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if containing in statement:
            sent.append(statement)

    engine = h.broker.store.engine
    sqlalchemy.event.listen(engine, "before_cursor_execute", count)
    try:
        yield sent
    finally:
        sqlalchemy.event.remove(engine, "before_cursor_execute", count)


async def test_an_event_no_one_notified_reaches_its_subscribers(harness: Harness) -> None:
    """An event appended to the store without a notification (as another worker
    process's, on SQLite) reaches the subscribers of its stream through the process's
    reconciling read."""
    alice = harness.key("alice")
    g = (await ensure(harness, alice)).json()
    async with _followers(harness, alice, g["session_id"], 1) as (seen,):

        def append() -> None:
            with harness.broker.store.write() as conn:
                append_event(conn, bindings, g["session_id"], "test.silent", {}, state="active")

        await asyncio.to_thread(append)
        async with asyncio.timeout(10):
            while "test.silent" not in seen:
                await asyncio.sleep(0.02)


async def test_idle_event_streams_cost_one_read_per_interval(harness: Harness) -> None:
    """Thirty subscribers of a quiet session cost the store one read per reconciling
    interval between them, not two per subscriber every half second (200 idle streams
    used to keep the server's cores busy, every other request waiting for them)."""
    alice = harness.key("alice")
    g = (await ensure(harness, alice)).json()

    async def idle_window() -> int:
        with _statements(harness) as sent:
            await asyncio.sleep(2.0)
        return len(sent)

    alone = await idle_window()
    async with _followers(harness, alice, g["session_id"], 30):
        await asyncio.sleep(0.6)  # the first reconciling read's wake, re-read
        followed = await idle_window()
    # 4 reconciling reads in 2 s (and what else the process does alone).
    assert followed - alone <= 8, (alone, followed)


async def test_subscribers_woken_by_one_event_read_it_once(harness: Harness) -> None:
    """Thirty streams of one principal on one session: each new event is read from the
    store once for all of them, and every stream gets it (each stream used to read it
    itself: thirty reads per event, and with 200 streams an ensure of that session
    waited about 370 ms)."""
    alice = harness.key("alice")
    g = (await ensure(harness, alice)).json()
    async with _followers(harness, alice, g["session_id"], 30) as seen:
        await asyncio.sleep(1.2)  # the first reconciling read's wake, and its re-read
        with _statements(harness, "FROM events") as reads:
            for n in range(5):

                def append(n: int = n) -> None:
                    with harness.broker.store.write() as conn:
                        append_event(
                            conn, bindings, g["session_id"], f"test.{n}", {}, state="active"
                        )

                await asyncio.to_thread(append)
                harness.broker.hub.notify(g["session_id"])
                async with asyncio.timeout(10):
                    while not all(f"test.{n}" in s for s in seen):
                        await asyncio.sleep(0.01)
    # One read per event, and at most one more each for the reconciling read's wake
    # (a read is two statements: the oldest retained sequence, then the events).
    assert len(reads) <= 2 * 10, len(reads)

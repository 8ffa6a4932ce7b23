"""Sessions on a sandbox named by id (``sandbox_id`` in 2.1, docs/BROKER.md)."""

from __future__ import annotations

import jwt

from tests.broker.conftest import Harness, MakeHarness
from tests.broker.test_sessions import assert_error, ensure


async def create_sandbox(h: Harness, headers: dict[str, str]) -> str:
    r = await h.client.post("/v1/sandboxes", json={}, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def attach(h: Harness, headers: dict[str, str], sandbox_id: str, **body):  # type: ignore[no-untyped-def]
    body = {"sandbox_id": sandbox_id, "mode": "attach_only", **body}
    return await h.client.post("/v1/sandbox/sessions", json=body, headers=headers)


async def test_owner_attaches_to_a_standalone_sandbox(harness: Harness) -> None:
    alice, agent = harness.key("alice"), harness.key("alice", "agent")
    sb = await create_sandbox(harness, alice)
    r = await attach(harness, alice, sb)
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["sandbox"]["id"] == sb
    assert g["thread_id"] is None
    assert g["binding"]["scope"] == {"type": "sandbox", "id": sb}
    assert g["binding"]["created"] is True
    assert g["binding"]["owner_user_id"] == "alice"
    claims = jwt.decode(g["token"], options={"verify_signature": False})
    assert claims["sandbox_id"] == sb and claims["sid"] == g["session_id"]
    assert claims["scope"] == f"sandbox:{sb}"
    # The MVP spelling, and the owner's agent, attach to the same binding.
    g2 = (await attach(harness, agent, sb, mode="get")).json()
    assert g2["session_id"] == g["session_id"] and g2["binding"]["created"] is False
    # The sandbox itself stays unbound.
    snap = (await harness.client.get(f"/v1/sandboxes/{sb}", headers=alice)).json()
    assert snap["scope"] is None
    # Refresh, heartbeat and release work as on any session.
    sid = g["session_id"]
    r = await harness.client.post(f"/v1/sandbox/sessions/{sid}/refresh", json={}, headers=alice)
    assert r.status_code == 200, r.text
    r = await harness.client.post(f"/v1/sandbox/sessions/{sid}/heartbeat", headers=alice)
    assert r.status_code == 200, r.text
    assert (
        await harness.client.delete(f"/v1/sandbox/sessions/{sid}", headers=alice)
    ).status_code == 204
    revoked = {t.jti for t in harness.provider.revoked}
    assert claims["jti"] in revoked
    # Attaching again renews the lease on the same binding.
    assert (await attach(harness, alice, sb)).json()["session_id"] == sid


async def test_refusals(harness: Harness) -> None:
    alice, mallory = harness.key("alice"), harness.key("mallory")
    sb = await create_sandbox(harness, alice)
    err = assert_error(await attach(harness, mallory, sb), 403, "FORBIDDEN")
    assert sb not in err["message"]
    # Once the owner attached, the binding's access check refuses the same way.
    assert (await attach(harness, alice, sb)).status_code == 200
    assert_error(await attach(harness, mallory, sb), 403, "FORBIDDEN")
    for mode in ("ensure", "create_only"):
        assert_error(await attach(harness, alice, sb, mode=mode), 400, "INVALID_REQUEST")
    assert_error(await attach(harness, alice, sb, thread_id="thr_1"), 400, "INVALID_REQUEST")
    r = await harness.client.post(
        "/v1/sandbox/sessions",
        json={"scope": {"type": "sandbox", "id": sb}, "mode": "attach_only"},
        headers=alice,
    )
    assert_error(r, 400, "INVALID_REQUEST")
    assert_error(await attach(harness, alice, "sb_nope"), 404, "SANDBOX_NOT_FOUND")
    assert (await harness.client.delete(f"/v1/sandboxes/{sb}", headers=alice)).status_code == 204
    assert_error(await attach(harness, alice, sb), 404, "SANDBOX_NOT_FOUND")


async def test_admin_attaches_to_anyones(make_harness: MakeHarness) -> None:
    h = await make_harness(admins=frozenset({"root"}))
    alice, root = h.key("alice"), h.key("root")
    sb = await create_sandbox(h, alice)
    r = await attach(h, root, sb)
    assert r.status_code == 200, r.text
    assert r.json()["binding"]["owner_user_id"] == "alice"


async def test_a_scopes_sandbox_is_attached_through_its_scope(harness: Harness) -> None:
    alice, mallory = harness.key("alice"), harness.key("mallory")
    g = (await ensure(harness, alice)).json()
    sb = g["sandbox"]["id"]
    r = await attach(harness, alice, sb)
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] == g["session_id"]
    assert r.json()["binding"]["scope"] == {"type": "thread", "id": "thr_1"}
    assert r.json()["thread_id"] == "thr_1"
    assert_error(await attach(harness, mallory, sb), 403, "FORBIDDEN")
    # Shared with mallory: she may attach to the scope, so to its sandbox too.
    r = await harness.client.post(
        "/v1/sandbox/scopes/thread/thr_1/members", json={"user_id": "mallory"}, headers=alice
    )
    assert r.status_code == 200
    assert (await attach(harness, mallory, sb)).json()["session_id"] == g["session_id"]

"""Lifecycle with an injected clock: idleness, suspension, hard TTL, orphans, pools, events."""

from __future__ import annotations

import asyncio
import json

import httpx

from sandlot.protocol.sessions import Pool
from tests.broker.conftest import Clock, MakeHarness
from tests.broker.fakes import FakeProvider, SlowListingProvider


async def _ensure(h, headers, thread="thr_1"):  # type: ignore[no-untyped-def]
    r = await h.client.post(
        "/v1/sandbox/sessions", json={"thread_id": thread, "mode": "ensure"}, headers=headers
    )
    assert r.status_code == 200, r.text
    await h.broker.sandboxes.drain()
    # The provider reports the sandbox ready from a task of its own: on a busy machine
    # that can come later than a moment after the creation (the tests then advance the
    # clock past the provisioning timeout).
    sid = r.json()["session_id"]
    for _ in range(500):
        if await _state(h, headers, sid) != "provisioning":
            break
        await asyncio.sleep(0.01)
    return r.json()


async def _state(h, headers, sid):  # type: ignore[no-untyped-def]
    r = await h.client.get(f"/v1/sandbox/sessions/{sid}", headers=headers)
    return r.json()["binding"]["state"]


async def test_idle_then_suspended_then_resumed_on_ensure(make_harness: MakeHarness) -> None:
    clock = Clock()
    h = await make_harness(clock=clock)
    k = h.key("alice")
    g = await _ensure(h, k)
    sid, sb = g["session_id"], g["sandbox"]["id"]
    assert await _state(h, k, sid) == "active"
    # Lease still live: nothing happens.
    clock.advance(h.broker.settings.lease_ttl_seconds - 1)
    assert (await h.broker.reaper.run_once()).idled == []
    # Lease expired and no activity: idle.
    clock.advance(2)
    assert (await h.broker.reaper.run_once()).idled == [sb]
    assert await _state(h, k, sid) == "idle"
    # Heartbeat brings it back to active.
    r = await h.client.post(f"/v1/sandbox/sessions/{sid}/heartbeat", headers=k)
    assert r.json()["state"] == "active"
    clock.advance(h.broker.settings.lease_ttl_seconds + 1)
    await h.broker.reaper.run_once()
    clock.advance(h.broker.settings.idle_timeout_seconds + 1)
    report = await h.broker.reaper.run_once()
    assert report.suspended == [sb]
    assert await _state(h, k, sid) == "suspended"
    assert h.provider.states[sb].value == "suspended"
    g2 = await _ensure(h, k)
    assert g2["session_id"] == sid
    assert g2["binding"]["state"] == "active"
    assert h.provider.states[sb].value == "active"


async def test_work_in_progress_is_never_reaped(make_harness: MakeHarness) -> None:
    clock = Clock()
    h = await make_harness(clock=clock)
    k = h.key("alice")
    g = await _ensure(h, k)
    sb = g["sandbox"]["id"]
    h.provider.busy.add(sb)
    for _ in range(5):
        clock.advance(h.broker.settings.idle_timeout_seconds)
        report = await h.broker.reaper.run_once()
        assert sb not in report.idled + report.suspended + report.terminated
    assert await _state(h, k, g["session_id"]) == "active"
    h.provider.busy.discard(sb)
    assert (await h.broker.reaper.run_once()).idled == [sb]


async def test_hard_ttl_terminates_regardless(make_harness: MakeHarness) -> None:
    clock = Clock()
    h = await make_harness(clock=clock)
    k = h.key("alice")
    g = await _ensure(h, k)
    h.provider.busy.add(g["sandbox"]["id"])
    clock.advance(h.broker.settings.hard_ttl_seconds + 1)
    report = await h.broker.reaper.run_once()
    assert report.terminated == [g["sandbox"]["id"]]
    assert await _state(h, k, g["session_id"]) == "terminated"
    assert g["sandbox"]["id"] in h.provider.deleted


async def test_orphans_on_both_sides(make_harness: MakeHarness) -> None:
    h = await make_harness()
    k = h.key("alice")
    g = await _ensure(h, k)
    # A sandbox the store does not know about.
    from sandlot.protocol.states import SandboxState

    h.provider.states["sb_stray"] = SandboxState.ACTIVE
    h.provider.seq["sb_stray"] = 1
    # A binding whose sandbox vanished.
    del h.provider.states[g["sandbox"]["id"]]
    report = await h.broker.reaper.run_once()
    assert "sb_stray" in report.orphans_removed and "sb_stray" not in h.provider.states
    assert g["sandbox"]["id"] in report.orphans_removed
    assert await _state(h, k, g["session_id"]) in ("failed", "terminated")


async def test_sandbox_ready_during_a_listing_is_no_orphan(make_harness: MakeHarness) -> None:
    """A sandbox created and made ready while the reaper waits for the provider's listing
    is missing from that listing but live in the store re-read after it: it is no orphan
    (taken for one, its binding ended and the next ensure of the scope made a second)."""
    provider = SlowListingProvider()
    h = await make_harness(provider)
    k = h.key("alice")
    made: list[dict] = []

    async def ensure_meanwhile() -> None:
        provider.meanwhile = None
        made.append(await _ensure(h, k))

    provider.meanwhile = ensure_meanwhile
    report = await h.broker.reaper.run_once()
    [g] = made
    assert g["sandbox"]["id"] not in report.orphans_removed
    assert await _state(h, k, g["session_id"]) == "active"
    again = await _ensure(h, k)
    assert (again["session_id"], again["sandbox"]["id"]) == (g["session_id"], g["sandbox"]["id"])
    # One that was ready before the listing and is missing from it did vanish.
    del provider.states[g["sandbox"]["id"]]
    assert g["sandbox"]["id"] in (await h.broker.reaper.run_once()).orphans_removed
    assert await _state(h, k, g["session_id"]) in ("failed", "terminated")


async def test_warm_pool_claimed_and_refilled(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.broker.pools.create(Pool(name="warm", template="default", min_ready=2, max_ready=3))
    report = await h.broker.reaper.run_once()
    assert len(report.pool_created) == 2
    await h.broker.sandboxes.drain()
    await asyncio.sleep(0.05)
    assert h.broker.pools.get("warm").ready == 2
    k = h.key("alice")
    g = await _ensure(h, k)
    assert g["sandbox"]["id"] in report.pool_created
    assert g["binding"]["state"] == "active"
    assert h.broker.pools.get("warm").ready == 1
    refill = await h.broker.reaper.run_once()
    assert len(refill.pool_created) == 1
    # Pooled sandboxes are not listed as the user's, nor idled.
    r = await h.client.get("/v1/sandboxes", headers=k)
    assert [s["id"] for s in r.json()["items"]] == [g["sandbox"]["id"]]


async def test_binding_events_sse_with_resume(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeProvider({"ready_after": 0.2}))
    k = h.key("alice")
    r = await h.client.post(
        "/v1/sandbox/sessions", json={"thread_id": "t", "mode": "ensure"}, headers=k
    )
    g = r.json()
    assert g["binding"]["state"] == "provisioning"
    sid, after = g["session_id"], g["binding"]["last_event_sequence"]
    seen = []
    live = httpx.AsyncClient(base_url=await h.serve(), timeout=10)
    async with live.stream(
        "GET", f"/v1/sandbox/sessions/{sid}/events?after={after}", headers=k
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                seen.append(ev)
                if ev["details"].get("phase", {}).get("to") == "active":
                    break
    assert seen[0]["sequence"] == after + 1
    assert seen[-1]["state"] == "active" and seen[-1]["binding_id"] == sid
    # Last-Event-ID resumes after the given sequence.
    async with live.stream(
        "GET",
        f"/v1/sandbox/sessions/{sid}/events",
        headers={**k, "Last-Event-ID": "0"},
    ) as resp:
        first = None
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                first = int(line[4:])
                break
    assert first == 1
    await live.aclose()
    err = await h.client.get(f"/v1/sandbox/sessions/{sid}/events?after=-3", headers=k)
    assert err.status_code == 400


async def test_volumes_per_user_are_bounded(make_harness: MakeHarness) -> None:
    # A user's volumes grew the store, and every listing of them, without end.
    h = await make_harness(max_volumes_per_user=2)
    carol, dave = h.key("carol"), h.key("dave")
    for name in ("v1", "v2"):
        r = await h.client.post("/v1/volumes", json={"name": name}, headers=carol)
        assert r.status_code == 201, r.text
    r = await h.client.post("/v1/volumes", json={"name": "v3"}, headers=carol)
    assert r.status_code == 429 and r.json()["error"]["code"] == "QUOTA_EXCEEDED", r.text
    assert r.json()["error"]["metadata"] == {"resource": "volumes", "limit": 2}
    # Another user's are his own count; one deleted makes room.
    assert (
        await h.client.post("/v1/volumes", json={"name": "d1"}, headers=dave)
    ).status_code == 201
    assert (await h.client.delete("/v1/volumes/v1", headers=carol)).status_code == 204
    r = await h.client.post("/v1/volumes", json={"name": "v3"}, headers=carol)
    assert r.status_code == 201, r.text


async def test_resources_crud(make_harness: MakeHarness) -> None:
    h = await make_harness(admins=frozenset({"root"}))
    admin, user = h.key("root"), h.key("alice")
    c = h.client
    tpl = {"name": "py", "image": "host", "resources": {"cpu": 0.5, "memory_mb": 512, "pids": 64}}
    assert (await c.post("/v1/templates", json=tpl, headers=user)).status_code == 403
    assert (await c.post("/v1/templates", json=tpl, headers=admin)).status_code == 201
    assert (await c.post("/v1/templates", json=tpl, headers=admin)).status_code == 409
    names = [t["name"] for t in (await c.get("/v1/templates", headers=user)).json()["items"]]
    assert names == ["default", "py"]
    assert (await c.get("/v1/templates/py", headers=user)).json()["resources"]["pids"] == 64
    assert (await c.delete("/v1/templates/default", headers=admin)).status_code == 409
    bad = {"name": "x", "image": "host", "volume_mounts": [{"volume": "nope", "path": "/data"}]}
    assert (await c.post("/v1/templates", json=bad, headers=admin)).status_code == 400
    # Refused when made, not when each sandbox of it fails to start: a volume over the
    # root or through "..", a disk past ext4's largest file.
    for path in ("/", "/workspace/../../etc", "/data/", "//data"):
        mount = {"volume": "data", "path": path}
        bad = {"name": "x", "image": "host", "volume_mounts": [mount]}
        r = await c.post("/v1/templates", json=bad, headers=admin)
        assert r.status_code == 400 and "normalized" in r.text, (path, r.text)
    for disk_mb in (10**12, 10**30):
        bad = {"name": "x", "image": "host", "resources": {"disk_mb": disk_mb}}
        r = await c.post("/v1/templates", json=bad, headers=admin)
        assert r.status_code == 400, r.text

    assert (await c.post("/v1/volumes", json={"name": "data"}, headers=user)).status_code == 201
    assert [v["name"] for v in (await c.get("/v1/volumes", headers=user)).json()["items"]] == [
        "data"
    ]
    assert (await c.delete("/v1/volumes/data", headers=user)).status_code == 204
    assert (await c.get("/v1/volumes/data", headers=user)).status_code == 404

    r = await c.post(
        "/v1/pools",
        json={"name": "p", "template": "py", "min_ready": 1, "max_ready": 0},
        headers=admin,
    )
    assert r.status_code == 400
    r = await c.post(
        "/v1/pools", json={"name": "p", "template": "py", "min_ready": 1}, headers=admin
    )
    assert r.status_code == 201, r.text
    assert (await c.get("/v1/pools/p", headers=user)).json()["template"] == "py"
    assert (await c.delete("/v1/pools/p", headers=admin)).status_code == 204
    assert (await c.delete("/v1/templates/py", headers=admin)).status_code == 204

    r = await c.post("/v1/sandboxes", json={"template": "default", "name": "mine"}, headers=user)
    assert r.status_code == 201
    sb = r.json()
    assert sb["name"] == "mine" and sb["state"] == "provisioning"
    assert (await c.post("/v1/sandboxes", json={"name": "mine"}, headers=user)).status_code == 409
    await h.broker.sandboxes.drain()
    await asyncio.sleep(0.01)
    assert (await c.get(f"/v1/sandboxes/{sb['id']}", headers=user)).json()["state"] == "active"
    assert (await c.get(f"/v1/sandboxes/{sb['id']}", headers=h.key("bob"))).status_code == 404
    r = await c.post(f"/v1/sandboxes/{sb['id']}/suspend", headers=user)
    assert r.json()["state"] == "suspended"
    r = await c.post(f"/v1/sandboxes/{sb['id']}/resume", headers=user)
    assert r.json()["state"] == "active"
    assert (await c.delete(f"/v1/sandboxes/{sb['id']}", headers=user)).status_code == 204
    assert (await c.get(f"/v1/sandboxes/{sb['id']}", headers=user)).json()["state"] == "terminated"


async def test_ops_endpoints(make_harness: MakeHarness) -> None:
    h = await make_harness(admins=frozenset({"root"}))
    c = h.client
    jwks = (await c.get("/.well-known/jwks.json")).json()
    assert jwks["keys"] and all(k["kty"] == "OKP" and k["crv"] == "Ed25519" for k in jwks["keys"])
    assert all("d" not in k for k in jwks["keys"])
    assert (await c.get("/healthz")).json()["status"] == "ok"
    ready = await c.get("/readyz")
    assert ready.status_code == 200 and ready.json()["store"]["ok"] is True
    k = h.key("alice")
    await _ensure(h, k)
    metrics = (await c.get("/metrics")).text
    assert "sandlot_negotiation_seconds_count" in metrics
    assert (await c.get("/v1/audit", headers=k)).status_code == 403
    audit = (await c.get("/v1/audit?scope=thread:thr_1", headers=h.key("root"))).json()["items"]
    assert audit[0]["action"] == "session.ensure" and audit[0]["session_id"]
    assert audit[0]["actor"] == {"type": "human", "id": "human:alice"}


async def test_key_rotation_keeps_old_tokens_verifiable(make_harness: MakeHarness) -> None:
    h = await make_harness()
    k = h.key("alice")
    g = await _ensure(h, k)
    h.broker.keyring.rotate()
    assert len((await h.client.get("/.well-known/jwks.json")).json()["keys"]) == 2
    assert h.broker.keyring.verify(g["token"])["sid"] == g["session_id"]


async def test_aliases_and_boxes(make_harness: MakeHarness) -> None:
    h = await make_harness()
    k = h.key("alice")
    c: httpx.AsyncClient = h.client
    r = await c.post("/sandbox/acquire", json={"thread_id": "thr_x"}, headers=k)
    assert r.status_code == 200, r.text
    acq = r.json()
    assert {
        "sandbox_id",
        "token",
        "ws_url",
        "http_url",
        "expires_at",
        "scopes",
        "refresh_url",
    } <= set(acq)
    r = await c.post("/sandbox/refresh", json={"token": acq["token"]}, headers=k)
    assert r.status_code == 200 and r.json()["token"] != acq["token"]
    assert (
        await c.post("/sandbox/refresh", json={"token": "garbage"}, headers=k)
    ).status_code == 401
    r = await c.post("/sandbox/release", json={"session_id": acq["session_id"]}, headers=k)
    assert r.status_code == 204
    assert (
        await c.post("/sandbox/refresh", json={"token": acq["token"]}, headers=k)
    ).status_code == 410

    api = {"X-Api-Key": k["Authorization"].split()[1]}
    r = await c.post(
        "/v2/sandboxes/boxes", json={"name": "b1", "wait_for_ready": True}, headers=api
    )
    assert r.status_code == 200, r.text
    box = r.json()
    assert box["name"] == "b1" and box["status"] == "ready" and box["dataplane_url"]
    assert (await c.get("/v2/sandboxes/boxes/b1/status", headers=api)).json() == {"status": "ready"}
    assert [
        b["name"] for b in (await c.get("/v2/sandboxes/boxes", headers=api)).json()["sandboxes"]
    ] == ["b1"]
    assert (await c.post("/v2/sandboxes/boxes/b1/stop", headers=api)).json()["status"] == "stopped"
    assert (await c.post("/v2/sandboxes/boxes/b1/start", headers=api)).json()["status"] == "ready"
    assert (await c.delete("/v2/sandboxes/boxes/b1", headers=api)).status_code == 204
    assert (await c.get("/v2/sandboxes/boxes/b1", headers=api)).status_code == 404
    r = await c.post("/v2/sandboxes/boxes", json={"snapshot": "nope"}, headers=api)
    assert r.status_code == 404

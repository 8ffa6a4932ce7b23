"""Teardowns are accepted, then completed (PROTOCOL.md 2.5, 2.8): ``DELETE ?wait=false``
answers 202 with the snapshot in state ``terminating`` as soon as the teardown is
committed, the events after its ``last_event_sequence`` report ``terminated`` once the
provider has deleted the sandbox, and the SDK's ``wait`` waits on those events.

The provider here is one whose deletions last until the test lets them finish (a slow
cloud API): the broker, its HTTP server and the SDK are the real ones.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from sandlot.protocol.errors import ProviderUnavailable
from sandlot.sdk import AsyncSandlot
from sandlot.sdk.types import Event
from tests.broker.conftest import Clock, Harness, MakeHarness
from tests.broker.fakes import FakeProvider

#: Every await that should finish promptly is bounded, so a regression fails instead of hanging.
PROMPT = 10.0

pytestmark = pytest.mark.parametrize("make_harness", ["loopback"], indirect=True)


class SlowDeleteProvider(FakeProvider):
    """Deletions start at once and end when the test sets ``finish`` (or fail once)."""

    def __init__(self) -> None:
        super().__init__()
        self.deleting = asyncio.Event()
        self.finish = asyncio.Event()
        self.fail_once = False
        self.calls = 0

    async def delete(self, sandbox_id: str) -> None:
        self.calls += 1
        self.deleting.set()
        await self.finish.wait()
        if self.fail_once:
            self.fail_once = False
            raise ProviderUnavailable("the provider's API is down")
        await super().delete(sandbox_id)


async def _setup(
    make_harness: MakeHarness, **kw: Any
) -> tuple[Harness, SlowDeleteProvider, dict[str, str], str]:
    provider = SlowDeleteProvider()
    h: Harness = await make_harness(provider, **kw)
    base = await h.serve()
    return h, provider, h.key("alice"), base


async def _sandbox(client: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, Any]:
    r = await client.post("/v1/sandboxes", json={}, headers=headers)
    assert r.status_code == 201, r.text
    snap: dict[str, Any] = r.json()
    async with asyncio.timeout(PROMPT):
        while snap["state"] != "active":
            await asyncio.sleep(0.01)
            snap = (await client.get(f"/v1/sandboxes/{snap['id']}", headers=headers)).json()
    return snap


async def _events(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], after: int
) -> list[dict[str, Any]]:
    """The events of an SSE stream after ``after``, until the server ends it."""
    import json

    out = []
    async with client.stream("GET", path, params={"after": after}, headers=headers) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
    return out


async def test_delete_sandbox_is_accepted_then_completed(make_harness: MakeHarness) -> None:
    h, provider, user, _ = await _setup(make_harness)
    snap = await _sandbox(h.client, user)
    path = f"/v1/sandboxes/{snap['id']}"

    # The provider has not deleted anything yet: the answer comes anyway.
    r = await asyncio.wait_for(
        h.client.delete(path, params={"wait": "false"}, headers=user), PROMPT
    )
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["state"] == "terminating"
    assert accepted["id"] == snap["id"]
    assert accepted["last_event_sequence"] > snap["last_event_sequence"]
    assert (await h.client.get(path, headers=user)).json()["state"] == "terminating"

    # Subscribed after the accepted snapshot: the completion comes once the provider is done.
    reader = asyncio.create_task(
        _events(h.client, f"{path}/events", user, accepted["last_event_sequence"])
    )
    await asyncio.wait_for(provider.deleting.wait(), PROMPT)
    provider.finish.set()
    events = await asyncio.wait_for(reader, PROMPT)
    assert [e["details"]["phase"] for e in events] == [
        {"from": "terminating", "to": "terminated", "reason": "deleted by request"}
    ]
    assert (await h.client.get(path, headers=user)).json()["state"] == "terminated"
    assert provider.deleted == [snap["id"]]

    # The whole log: accepted, then completed.
    log = await _events(h.client, f"{path}/events", user, 0)
    assert [e["event_type"] for e in log][-2:] == ["sandbox.terminating", "sandbox.terminated"]


async def test_delete_without_wait_false_still_answers_when_done(
    make_harness: MakeHarness,
) -> None:
    h, provider, user, _ = await _setup(make_harness)
    snap = await _sandbox(h.client, user)
    path = f"/v1/sandboxes/{snap['id']}"
    request = asyncio.create_task(h.client.delete(path, headers=user))
    await asyncio.wait_for(provider.deleting.wait(), PROMPT)
    # The deletion is under way and cannot have finished: neither can the request.
    assert not request.done()
    assert (await h.client.get(path, headers=user)).json()["state"] == "terminating"
    provider.finish.set()
    r = await asyncio.wait_for(request, PROMPT)
    assert r.status_code == 204
    assert (await h.client.get(path, headers=user)).json()["state"] == "terminated"


async def test_terminate_session_is_accepted_then_completed(make_harness: MakeHarness) -> None:
    h, provider, user, _ = await _setup(make_harness)
    body = {"scope": {"type": "thread", "id": "thr_del"}, "mode": "ensure"}
    grant = (await h.client.post("/v1/sandbox/sessions", json=body, headers=user)).json()
    sid = grant["session_id"]
    path = f"/v1/sandbox/sessions/{sid}"

    r = await asyncio.wait_for(
        h.client.delete(path, params={"terminate": "true", "wait": "false"}, headers=user), PROMPT
    )
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["session_id"] == sid
    assert accepted["binding"]["state"] == "terminating"
    # Accepted means out of use: every token revoked, and the scope is free for a new sandbox.
    assert {t.jti for t in provider.revoked}
    again = (await h.client.post("/v1/sandbox/sessions", json=body, headers=user)).json()
    assert again["session_id"] != sid
    assert again["sandbox"]["id"] != grant["sandbox"]["id"]

    reader = asyncio.create_task(
        _events(h.client, f"{path}/events", user, accepted["binding"]["last_event_sequence"])
    )
    await asyncio.wait_for(provider.deleting.wait(), PROMPT)
    provider.finish.set()
    events = await asyncio.wait_for(reader, PROMPT)
    assert [(e["event_type"], e["details"]["phase"]["to"]) for e in events] == [
        ("binding.terminated", "terminated")
    ]
    snap = (await h.client.get(path, headers=user)).json()
    assert snap["binding"]["state"] == "terminated"


async def test_sdk_waits_for_completion_on_the_events(make_harness: MakeHarness) -> None:
    _, provider, user, base = await _setup(make_harness)
    key = user["Authorization"].removeprefix("Bearer ")
    async with AsyncSandlot(base, key, timeout=PROMPT) as sdk:
        # wait=True (the default): returns once the sandbox is terminated, not before.
        snap = await sdk.create_sandbox()
        deleting = asyncio.create_task(sdk.delete_sandbox(snap.id))
        await asyncio.wait_for(provider.deleting.wait(), PROMPT)
        assert (await sdk.get_sandbox(snap.id)).state == "terminating"
        assert not deleting.done()
        provider.finish.set()
        done = await deleting
        assert done.state == "terminated"
        assert done.last_event_sequence > snap.last_event_sequence

        # wait=False: the accepted snapshot, and the events after it say when it is done.
        provider.finish.clear()
        provider.deleting.clear()
        snap = await sdk.create_sandbox()
        accepted = await sdk.delete_sandbox(snap.id, wait=False)
        assert accepted.state == "terminating"
        provider.finish.set()
        async with sdk.sandbox_events(snap.id, after=accepted.last_event_sequence) as events:
            first: Event = await anext(events)
        assert first.details["phase"]["to"] == "terminated"

        # A session: release(terminate=True) waits the same way, on the binding's events.
        provider.finish.clear()
        provider.deleting.clear()
        sandbox = await sdk.ensure("thr_sdk")
        sid = sandbox.grant.session_id
        assert sid is not None
        releasing = asyncio.create_task(sdk.release(sid, terminate=True))
        await asyncio.wait_for(provider.deleting.wait(), PROMPT)
        assert not releasing.done()
        provider.finish.set()
        final = await releasing
        assert final is not None and final.binding.state == "terminated"

        # A plain detach is not a teardown: nothing to wait for.
        other = await sdk.ensure("thr_sdk_detach")
        assert other.grant.session_id is not None
        assert await sdk.release(other.grant.session_id) is None


async def test_a_failed_deletion_is_finished_by_the_reaper(make_harness: MakeHarness) -> None:
    clock = Clock()
    h, provider, user, _ = await _setup(make_harness, clock=clock)
    snap = await _sandbox(h.client, user)
    path = f"/v1/sandboxes/{snap['id']}"
    provider.fail_once = True
    provider.finish.set()
    # The provider failed: the answer says accepted, not done (it was 204 before).
    r = await asyncio.wait_for(h.client.delete(path, headers=user), PROMPT)
    assert r.status_code == 202
    assert r.json()["state"] == "terminating"
    assert provider.deleted == []

    # Within the grace period the reaper leaves it to the process that accepted it...
    await h.broker.reaper.run_once()
    assert provider.calls == 1
    # ...after it, the reaper finishes the teardown.
    clock.advance(60)
    report = await h.broker.reaper.run_once()
    assert report.terminated == [snap["id"]]
    assert provider.deleted == [snap["id"]]
    assert (await h.client.get(path, headers=user)).json()["state"] == "terminated"


async def test_the_accepted_form_is_documented_and_checked(make_harness: MakeHarness) -> None:
    h, _, user, _ = await _setup(make_harness)
    doc = (await h.client.get("/openapi.json")).json()
    for path in ("/v1/sandboxes/{sandbox_id}", "/v1/sandbox/sessions/{session_id}"):
        op = doc["paths"][path]["delete"]
        assert {"202", "204"} <= set(op["responses"])
        assert "wait" in {p["name"] for p in op["parameters"]}
    snap = await _sandbox(h.client, user)
    r = await h.client.delete(f"/v1/sandboxes/{snap['id']}?wait=maybe", headers=user)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "INVALID_REQUEST"

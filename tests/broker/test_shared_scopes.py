"""A shared scope stays its owner's (PROTOCOL.md 2.5, docs/BROKER.md).

Against a real ``sandlot serve``: alice owns ``thread:…`` and shares it with bob.

- A sandbox made for the scope at bob's request is alice's (her quota, her
  ``GET /v1/sandboxes/{id}``); bob may not delete it, as a member or after, and once
  removed his API key no longer reaches its dataplane.
- bob cannot make his own sandbox serve alice's scope with ``sandbox_hint``.
- Removing bob revokes the tokens he holds on the scope: the dataplane refuses them
  within a second or two, not at their expiry; the sockets and event streams he opened
  there with his API key close as soon, those on his own sandboxes stay.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.servers import SandlotServer, running


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(Path(tmp_path_factory.mktemp("shared")) / "data") as server:
        yield server


#: One key per user and server (making one runs the CLI).
_KEYS: dict[tuple[str, str], str] = {}


def key(srv: SandlotServer, user: str) -> str:
    if (srv.url, user) not in _KEYS:
        _KEYS[srv.url, user] = srv.key(user)
    return _KEYS[srv.url, user]


def call(srv: SandlotServer, user: str, method: str, path: str, body: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key(srv, user)}"}
    return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=60)


def ensure(srv: SandlotServer, user: str, thread: str, **extra: Any) -> httpx.Response:
    body = {"scope": {"type": "thread", "id": thread}, "mode": "ensure", **extra}
    return call(srv, user, "POST", "/v1/sandbox/sessions", body)


def dataplane_exec(grant: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{grant['dataplane']['http_base_url']}/exec",
        json={"command": "true"},
        headers=headers,
        timeout=30,
    )


def bearer(grant: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {grant['token']}"}


def wait_active(grant: dict[str, Any]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = dataplane_exec(grant, bearer(grant))
        if r.status_code == 200:
            return
        assert r.status_code == 423, r.text
        time.sleep(0.1)
    raise AssertionError("the sandbox never became active")


def refused_within(seconds: float, attempt: Any) -> httpx.Response:
    """Poll ``attempt`` until the dataplane refuses it (or ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while True:
        r: httpx.Response = attempt()
        if r.status_code != 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def shared_scope(srv: SandlotServer) -> tuple[str, dict[str, Any]]:
    """A new scope of alice's, its sandbox active, shared with bob: (thread, her grant)."""
    thread = f"thr_{uuid.uuid4().hex[:8]}"
    r = ensure(srv, "alice", thread)
    assert r.status_code == 200, r.text
    grant: dict[str, Any] = r.json()
    wait_active(grant)
    r = call(
        srv, "alice", "POST", f"/v1/sandbox/scopes/thread/{thread}/members", {"user_id": "bob"}
    )
    assert r.status_code == 200, r.text
    return thread, grant


def shared_scope_without_sandbox(srv: SandlotServer) -> str:
    """alice's scope, shared with bob, whose sandbox alice has terminated."""
    thread, grant = shared_scope(srv)
    r = call(srv, "alice", "DELETE", f"/v1/sandbox/sessions/{grant['session_id']}?terminate=true")
    assert r.status_code in (200, 202, 204), r.text
    return thread


def test_a_members_ensure_makes_the_owners_sandbox(srv: SandlotServer) -> None:
    thread = shared_scope_without_sandbox(srv)
    r = ensure(srv, "bob", thread)
    assert r.status_code == 200, r.text
    grant = r.json()
    sandbox_id = grant["sandbox"]["id"]
    assert grant["binding"]["owner_user_id"] == "alice"
    wait_active(grant)

    r = call(srv, "alice", "GET", f"/v1/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    assert r.json()["owner_user_id"] == "alice"
    r = call(srv, "bob", "DELETE", f"/v1/sandboxes/{sandbox_id}")
    assert r.status_code in (403, 404), r.text
    bob_key = {"X-Api-Key": key(srv, "bob")}
    # A member reaches the dataplane with his API key...
    assert dataplane_exec(grant, bob_key).status_code == 200

    r = call(srv, "alice", "DELETE", f"/v1/sandbox/scopes/thread/{thread}/members/bob")
    assert r.status_code == 204, r.text
    r = call(srv, "bob", "DELETE", f"/v1/sandboxes/{sandbox_id}")
    assert r.status_code in (403, 404), r.text
    # ...and no longer once removed (the dataplane remembers a key for seconds).
    r = refused_within(10.0, lambda: dataplane_exec(grant, bob_key))
    assert r.status_code in (401, 403), r.text
    # alice's sandbox is still hers and still serves her scope.
    r = call(srv, "alice", "GET", f"/v1/sandboxes/{sandbox_id}")
    assert r.status_code == 200 and r.json()["state"] in ("active", "idle"), r.text
    r = ensure(srv, "alice", thread)
    assert r.status_code == 200 and r.json()["sandbox"]["id"] == sandbox_id, r.text


def test_b_a_member_cannot_hint_his_own_sandbox_into_the_scope(srv: SandlotServer) -> None:
    thread = shared_scope_without_sandbox(srv)
    r = call(srv, "bob", "POST", "/v1/sandboxes", {})
    assert r.status_code == 201, r.text
    bobs = r.json()["id"]
    r = ensure(srv, "bob", thread, sandbox_hint=bobs)
    assert r.status_code in (400, 403), r.text
    assert "owner" in r.json()["error"]["message"], r.text
    # The scope is still free: alice's own ensure gets a sandbox of hers.
    r = ensure(srv, "alice", thread)
    assert r.status_code == 200, r.text
    assert r.json()["sandbox"]["id"] != bobs
    r = call(srv, "alice", "GET", f"/v1/sandboxes/{r.json()['sandbox']['id']}")
    assert r.status_code == 200 and r.json()["owner_user_id"] == "alice", r.text


def test_c_removing_a_member_revokes_his_tokens(srv: SandlotServer) -> None:
    thread, alices = shared_scope(srv)
    r = ensure(srv, "bob", thread)
    assert r.status_code == 200, r.text
    bobs = r.json()
    assert bobs["session_id"] == alices["session_id"]
    assert dataplane_exec(bobs, bearer(bobs)).status_code == 200

    r = call(srv, "alice", "DELETE", f"/v1/sandbox/scopes/thread/{thread}/members/bob")
    assert r.status_code == 204, r.text
    r = refused_within(3.0, lambda: dataplane_exec(bobs, bearer(bobs)))
    assert r.status_code == 401, r.text
    # alice's own token is untouched, and bob cannot refresh his.
    assert dataplane_exec(alices, bearer(alices)).status_code == 200
    r = call(srv, "bob", "POST", f"/v1/sandbox/sessions/{bobs['session_id']}/refresh", {})
    assert r.status_code == 403, r.text


async def _echoes(ws: Any, marker: str) -> bool:
    """Whether the shell ``ws`` still runs what it is sent."""
    await ws.send(json.dumps({"type": "stdin", "data": f"echo {marker}$((40+2))\n"}))
    out = ""
    async with asyncio.timeout(20):
        while f"{marker}42" not in out:
            frame = json.loads(await ws.recv())
            out += frame.get("data", "") if frame["type"] == "stdout" else ""
    return True


def test_d_removing_a_member_closes_what_his_api_key_opened_on_the_scope(
    srv: SandlotServer,
) -> None:
    thread, alices = shared_scope(srv)
    r = ensure(srv, "bob", f"thr_{uuid.uuid4().hex[:8]}")
    assert r.status_code == 200, r.text
    own = r.json()
    wait_active(own)
    bob_key = {"X-Api-Key": key(srv, "bob")}

    async def run() -> None:
        scope_ws = alices["dataplane"]["ws_base_url"]
        own_ws = own["dataplane"]["ws_base_url"]
        async with (
            websockets.connect(
                f"{scope_ws}/shell/ws?session=bob", additional_headers=bob_key
            ) as shared,
            websockets.connect(
                f"{own_ws}/shell/ws?session=bob", additional_headers=bob_key
            ) as mine,
            httpx.AsyncClient(timeout=30) as http,
            http.stream(
                "GET", f"{alices['dataplane']['http_base_url']}/events", headers=bob_key
            ) as events,
        ):
            assert events.status_code == 200
            assert await _echoes(shared, "BEFORE") and await _echoes(mine, "MINE")
            r = await http.delete(
                f"{srv.url}/v1/sandbox/scopes/thread/{thread}/members/bob",
                headers={"Authorization": f"Bearer {key(srv, 'alice')}"},
            )
            assert r.status_code == 204, r.text
            # Closed within seconds (API keys do not expire: nothing else would close it).
            with pytest.raises(websockets.ConnectionClosed) as closed:
                async with asyncio.timeout(5):
                    while True:
                        await shared.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
            async with asyncio.timeout(5):
                async for _ in events.aiter_lines():
                    pass  # the stream ends
            # His key still reaches his own sandbox, its socket open all along.
            assert await _echoes(mine, "STILL")
            r = await http.post(
                f"{own['dataplane']['http_base_url']}/exec",
                json={"command": "true"},
                headers=bob_key,
            )
            assert r.status_code == 200, r.text

    asyncio.run(run())

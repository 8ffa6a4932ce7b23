"""The async broker client against a real server: sessions, leases, errors, resources."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from sandlot.protocol.errors import (
    CapabilityDenied,
    Forbidden,
    InvalidRequest,
    SessionExpired,
    SessionNotFound,
    Unauthenticated,
)
from sandlot.sdk import (
    AsyncSandlot,
    HeartbeatResult,
    Pool,
    RefreshResult,
    SandboxSnapshot,
    SessionSnapshot,
    Template,
    Volume,
)
from sandlot.sdk.types import Binding, Scope
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(60)


def thread() -> str:
    return f"thr_{uuid.uuid4().hex[:10]}"


async def test_ensure_waits_active_and_caches_the_grant(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        tid = thread()
        sandbox = await client.ensure(tid)
        assert sandbox.grant.state in ("active", "idle")
        assert sandbox.grant.session_id and sandbox.grant.token
        again = await client.ensure(tid)
        assert again.grant is sandbox.grant  # from the cache, no second negotiation
        snap = await client.session(sandbox.grant.session_id)
        assert isinstance(snap, SessionSnapshot) and isinstance(snap.binding, Binding)
        assert snap.session_id == snap.binding.id == sandbox.grant.session_id
        assert snap.binding.scope == Scope(type="thread", id=tid)
        assert snap.binding.state == snap.state == "active"
        assert snap.binding.last_event_sequence >= 1
        assert snap.binding.sandbox_id == snap.sandbox.id == sandbox.id
        assert snap.dataplane.http_base_url == sandbox.grant.http_base_url
        assert snap.policy.token_ttl_seconds == 6 and snap.policy.lease_ttl_seconds == 6
        assert snap.to_dict()["binding"]["state"] == "active"  # the body as sent
        got = await client.get(tid)
        assert got.id == sandbox.id


async def test_binding_events_are_ordered_and_resume(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key, auto_refresh=False) as client:
        sandbox = await client.ensure(thread())
        sid = sandbox.grant.session_id
        assert sid
        beat = await client.heartbeat(sid)
        assert isinstance(beat, HeartbeatResult) and beat.state == "active"
        assert beat.lease_expires_at.endswith("Z")
        fresh = await client.refresh(sid)
        assert isinstance(fresh, RefreshResult)
        assert fresh.token == fresh.credentials.access_token and fresh.token
        assert fresh.expires_at == fresh.credentials.expires_at
        assert set(fresh.credentials.granted_capabilities) >= {"fs_read", "exec"}
        events = client.binding_events(sid, after=0, timeout=5)
        seen = []
        async with events:
            async for event in events:
                seen.append(event)
                if event.event_type == "binding.refreshed":
                    break
        seqs = [e.sequence for e in seen]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert seen[0].event_type == "binding.created"
        # Resuming after a cursor yields only later events.
        later = client.binding_events(sid, after=seqs[-2], timeout=5)
        async with later:
            first = await later.__anext__()
        assert first.sequence == seqs[-1]


async def test_typed_errors(server: SandlotServer, human_key: str, agent_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        with pytest.raises(SessionNotFound):
            await client.get(thread())
        with pytest.raises(InvalidRequest):
            await client.ensure(thread(), capabilities=["not_a_capability"])
    async with AsyncSandlot(server.url, "sk_wrong") as bad:
        with pytest.raises(Unauthenticated) as info:
            await bad.ensure(thread())
        assert info.value.status == 401
    # An agent may not be granted what its policy withholds.
    async with AsyncSandlot(server.url, agent_key) as agent:
        with pytest.raises(CapabilityDenied) as denied:
            await agent.ensure(thread(), capabilities=["fs_read", "shell"])
        assert denied.value.metadata["capability"] == "shell"


async def test_other_users_cannot_attach(
    server: SandlotServer, human_key: str, other_key: str
) -> None:
    tid = thread()
    async with AsyncSandlot(server.url, human_key) as alice:
        await alice.ensure(tid)
    async with AsyncSandlot(server.url, other_key) as mallory:
        with pytest.raises(Forbidden):
            await mallory.ensure(tid)


async def test_release_and_terminate(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        sandbox = await client.ensure(thread())
        sid = sandbox.grant.session_id
        assert sid
        await client.release(sid)
        with pytest.raises(SessionExpired):
            await client.refresh(sid)
        sandbox = await client.ensure(thread())
        await client.release(sandbox.grant.session_id or "", terminate=True)
        snap = await client.get_sandbox(sandbox.id)
        assert snap.state in ("terminated", "terminating")


async def test_background_refresh_and_heartbeat(server: SandlotServer, human_key: str):
    # The server under test grants 6 s tokens and 6 s leases.
    async with AsyncSandlot(server.url, human_key) as client:
        sandbox = await client.ensure(thread())
        first = sandbox.grant.token
        sid = sandbox.grant.session_id
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            stats = client.lease_stats()[str(sid)]
            if stats["refreshes"] >= 1 and stats["heartbeats"] >= 2:
                break
            await asyncio.sleep(0.25)
        assert stats["refreshes"] >= 1 and stats["heartbeats"] >= 2, stats
        assert sandbox.grant.token != first
        # Past the first token's lifetime, the sandbox still answers.
        assert (await sandbox.run("echo ok")).stdout == "ok\n"


async def test_dataplane_401_reacquires(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key, auto_refresh=False) as client:
        sandbox = await client.ensure(thread())
        old = sandbox.grant.token
        # Someone holding the same key releases the binding: the token is revoked.
        async with httpx.AsyncClient() as raw:
            resp = await raw.delete(
                f"{server.url}/v1/sandbox/sessions/{sandbox.grant.session_id}",
                headers={"Authorization": f"Bearer {human_key}"},
            )
            assert resp.status_code == 204
        await asyncio.sleep(0.3)
        result = await sandbox.run("echo back")
        assert result.stdout == "back\n"
        assert sandbox.grant.token != old


async def test_sandboxes_templates_pools_volumes(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        name = f"box-{uuid.uuid4().hex[:6]}"
        snap = await client.create_sandbox(name=name)
        assert isinstance(snap, SandboxSnapshot)
        assert (snap.state, snap.name, snap.template, snap.scope) == (
            "active",
            name,
            "default",
            None,
        )
        assert snap.dataplane.http_base_url and snap.last_event_sequence >= 1
        assert snap.to_dict()["id"] == snap.id
        listed = await client.list_sandboxes()
        assert all(isinstance(s, SandboxSnapshot) for s in listed)
        assert snap.id in {s.id for s in listed}
        suspended = await client.suspend_sandbox(snap.id)
        assert suspended.state == "suspended"
        resumed = await client.resume_sandbox(snap.id)
        assert resumed.state in ("active", "idle")
        assert (await client.delete_sandbox(snap.id)).state == "terminated"
        templates = await client.list_templates()
        assert all(isinstance(t, Template) for t in templates)
        assert "default" in {t.name for t in templates}
        default = await client.get_template("default")
        assert default.name == "default" and default.image
        assert default.resources.memory_mb > 0 and "default" in default.shells
        assert all(isinstance(p, Pool) for p in await client.list_pools())
        assert all(isinstance(v, Volume) for v in await client.list_volumes())


async def test_deadline_on_every_call(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        sandbox = await client.ensure(thread())
        with pytest.raises(TimeoutError):
            await sandbox.exec("sleep 5", timeout=0.5)
        events = sandbox.events(after=10**6 - 1, timeout=0.3)
        with pytest.raises((TimeoutError, Exception)):
            async with events:
                async for _ in events:
                    pass


def test_url_and_key_from_env(monkeypatch: pytest.MonkeyPatch, server: SandlotServer) -> None:
    monkeypatch.setenv("SANDLOT_URL", server.url)
    monkeypatch.setenv("SANDLOT_API_KEY", "sk_x")
    client = AsyncSandlot()
    assert client.url == server.url
    monkeypatch.delenv("SANDLOT_URL")
    with pytest.raises(ValueError):
        AsyncSandlot()


async def test_lost_lease_is_negotiated_again(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        sandbox = await client.ensure(thread())
        sid = sandbox.grant.session_id
        assert sid
        old = sandbox.grant.token
        async with httpx.AsyncClient() as raw:  # released behind the client's back
            resp = await raw.delete(
                f"{server.url}/v1/sandbox/sessions/{sid}",
                headers={"Authorization": f"Bearer {human_key}"},
            )
            assert resp.status_code == 204
        # The next heartbeat (every lease_ttl/3 = 2 s) gets 410 and negotiates again.
        deadline = time.monotonic() + 10
        while sandbox.grant.token == old and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert sandbox.grant.token != old
        assert (await client.heartbeat(sandbox.grant.session_id or "")).lease_expires_at


async def test_wait_active_follows_the_binding_events(server: SandlotServer, human_key: str):
    async with AsyncSandlot(server.url, human_key) as client:
        sandbox = await client.ensure(thread())
        await client.suspend_sandbox(sandbox.id)
        snap = await client.session(sandbox.grant.session_id or "")
        assert snap.binding.state == "suspended"

        async def resume_later() -> None:
            await asyncio.sleep(0.5)
            await client.resume_sandbox(sandbox.id)

        resumer = asyncio.create_task(resume_later())
        started = time.monotonic()
        snap = await client.wait_active(sandbox.grant, timeout=20)
        await resumer
        assert isinstance(snap, SessionSnapshot) and snap.binding.state in ("active", "idle")
        assert time.monotonic() - started >= 0.4

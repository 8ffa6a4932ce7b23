"""``attach_sandbox``: a sandbox that serves no scope, by id, through the SDK, against a real
``sandlot serve``: the grant is kept fresh and released like any session's."""

from __future__ import annotations

import pytest

from sandlot.protocol.errors import SandboxNotFound
from sandlot.sdk import AsyncSandlot, Forbidden, Sandlot
from tests.servers import SandlotServer

PROMPT = 30.0


async def test_attach_to_a_created_sandbox(
    server: SandlotServer, human_key: str, agent_key: str, other_key: str
) -> None:
    async with AsyncSandlot(server.url, human_key, timeout=PROMPT) as client:
        snap = await client.create_sandbox()
        sandbox = await client.attach_sandbox(snap.id)
        assert sandbox.id == snap.id
        result = await sandbox.run("echo by-id")
        assert result.stdout == "by-id\n"
        # Cached: the same lease (and session) until released.
        again = await client.attach_sandbox(snap.id)
        grant = sandbox.grant
        assert again.grant.session_id == grant.session_id
        assert grant.scope == {"type": "sandbox", "id": snap.id}
        await grant_refreshes(client, grant.session_id)
        await client.release(str(grant.session_id))
        assert client.lease_stats() == {}
        # The owner's agent gets in; another user does not.
        async with AsyncSandlot(server.url, agent_key, timeout=PROMPT) as agent:
            await (await agent.attach_sandbox(snap.id)).write("/workspace/a.txt", "x")
        async with AsyncSandlot(server.url, other_key, timeout=PROMPT) as other:
            with pytest.raises(Forbidden):
                await other.attach_sandbox(snap.id)
        await client.delete_sandbox(snap.id)
        with pytest.raises(SandboxNotFound):
            await client.attach_sandbox(snap.id)


async def grant_refreshes(client: AsyncSandlot, session_id: str | None) -> None:
    assert session_id is not None
    body = await client.refresh(session_id)
    assert body.token


def test_sync_client(server: SandlotServer, human_key: str) -> None:
    with Sandlot(server.url, human_key, timeout=PROMPT) as client:
        snap = client.create_sandbox()
        sandbox = client.attach_sandbox(snap.id)
        assert sandbox.run("echo sync").stdout == "sync\n"
        client.delete_sandbox(snap.id)

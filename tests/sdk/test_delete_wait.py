"""Deleting a sandbox and terminating a session through the SDK and the CLI, against a
real ``sandlot serve``: accepted at once (``terminating``), completed on the event stream
(``terminated``), and with ``wait`` (the default) the sandbox's files are gone on return."""

from __future__ import annotations

import os
import subprocess
import sys

from sandlot.sdk import AsyncSandlot, Sandlot
from tests.servers import SandlotServer

PROMPT = 30.0


async def test_delete_sandbox_waits_until_it_is_gone(server: SandlotServer, human_key: str):
    workspaces = server.data_dir / "workspaces"
    async with AsyncSandlot(server.url, human_key, timeout=PROMPT) as client:
        snap = await client.create_sandbox()
        assert (workspaces / snap.id).exists()
        done = await client.delete_sandbox(snap.id)
        assert done.state == "terminated"
        assert not (workspaces / snap.id).exists()

        snap = await client.create_sandbox()
        accepted = await client.delete_sandbox(snap.id, wait=False)
        assert accepted.state == "terminating"
        async with client.sandbox_events(
            snap.id, after=accepted.last_event_sequence, timeout=PROMPT
        ) as events:
            phases = [ev.details["phase"]["to"] async for ev in events if ev.kind == "phase"]
        assert phases == ["terminated"]
        assert (await client.get_sandbox(snap.id)).state == "terminated"
        assert not (workspaces / snap.id).exists()


async def test_terminate_waits_on_the_binding_events(server: SandlotServer, human_key: str):
    workspaces = server.data_dir / "workspaces"
    async with AsyncSandlot(server.url, human_key, timeout=PROMPT) as client:
        sandbox = await client.ensure("thr_terminate_wait")
        await sandbox.run("sleep 600 > /dev/null 2>&1 &")
        assert sandbox.grant.session_id is not None
        final = await client.release(sandbox.grant.session_id, terminate=True)
        assert final is not None and final.binding.state == "terminated"
        assert not (workspaces / sandbox.id).exists()

        sandbox = await client.ensure("thr_terminate_nowait")
        sid = sandbox.grant.session_id
        assert sid is not None
        accepted = await client.release(sid, terminate=True, wait=False)
        assert accepted is not None and accepted.binding.state == "terminating"
        async with client.binding_events(
            sid, after=accepted.binding.last_event_sequence, timeout=PROMPT
        ) as events:
            states = [ev.state async for ev in events]
        assert states[-1] == "terminated"


async def test_every_wait_sees_the_end(server: SandlotServer, human_key: str) -> None:
    """The event stream that ends with the sandbox sends its last event first, also when
    that event is committed while the stream is looking (1 in 6 waits failed that way)."""
    async with AsyncSandlot(server.url, human_key, timeout=PROMPT) as client:
        for i in range(30):
            sandbox = await client.ensure(f"thr_end_{i}", wait=i % 2 == 0)
            assert sandbox.grant.session_id is not None
            final = await client.release(sandbox.grant.session_id, terminate=True)
            assert final is not None and final.binding.state == "terminated"


def test_sync_client_and_cli(server: SandlotServer, human_key: str) -> None:
    with Sandlot(server.url, human_key, timeout=PROMPT) as client:
        snap = client.create_sandbox()
        assert client.delete_sandbox(snap.id).state == "terminated"
        snap = client.create_sandbox()
    env = {**os.environ, "SANDLOT_URL": server.url, "SANDLOT_API_KEY": human_key}
    cli = [sys.executable, "-m", "sandlot.cli.main"]
    out = subprocess.run(
        [*cli, "sandbox", "delete", snap.id, "--no-wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"terminating {snap.id}\n"
    subprocess.run(
        [*cli, "session", "ensure", "thr_cli_terminate"], env=env, check=True, timeout=60
    )
    out = subprocess.run(
        [*cli, "session", "release", "thr_cli_terminate", "--terminate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("terminated ssn_")

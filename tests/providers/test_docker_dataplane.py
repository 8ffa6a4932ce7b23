"""The dataplane's surface on a sandbox in a container, through the relay and the real SDK:
streamed commands over WebSockets, a shared shell, the event log (SSE and WebSocket),
files, archives, search, and path confinement."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.dockerengine import Engine
from tests.providers.dockerharness import Harness, serving

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
async def box(docker_engine: Engine, docker_image: str, tmp_path: Path) -> AsyncIterator[Harness]:
    async with serving(docker_engine, docker_image, tmp_path) as h:
        await h.create("sb_dp")
        try:
            yield h
        finally:
            await h.provider.delete("sb_dp")


async def test_streamed_commands_and_a_shared_shell(box: Harness) -> None:
    async with box.sandbox("sb_dp") as sb:
        cmd = await sb.stream("for i in 1 2 3; do echo line $i; sleep 0.05; done; echo err >&2")
        result = await cmd.wait()
        assert result.stdout == "line 1\nline 2\nline 3\n" and result.stderr == "err\n"
        assert result.exit_code == 0
        pty = await sb.stream("tty; stty size", pty=True, cols=100, rows=30)
        out = (await pty.wait()).stdout
        assert "/dev/pts/" in out and "30 100" in out

        async with (
            await sb.shell("main", profile="default") as driver,
            await sb.shell("main", role="observer") as observer,
        ):
            await driver.send("echo shared-$((6*7))\n")
            assert "shared-42" in await driver.read_until("shared-42")
            assert "shared-42" in await observer.read_until("shared-42")


async def test_the_event_log_over_sse_and_websocket(box: Harness) -> None:
    async with box.sandbox("sb_dp") as sb:
        snapshot = await box.provider.status("sb_dp")
        await sb.write("/workspace/seen.txt", "x")

        async def first_fs(transport: str) -> str:
            async with sb.events(after=snapshot.last_event_sequence, transport=transport) as ev:
                async for event in ev:
                    if event.kind == "fs":
                        return str(event.details["fs"]["path"])
            raise AssertionError("no fs event")

        assert await asyncio.wait_for(first_fs("sse"), 20) == "/workspace/seen.txt"
        assert await asyncio.wait_for(first_fs("ws"), 20) == "/workspace/seen.txt"
        # The event log's sequence is what the provider reports, read together with the state.
        assert (await box.provider.status("sb_dp")).last_event_sequence > 0


async def test_files_archives_and_search(box: Harness) -> None:
    async with box.sandbox("sb_dp") as sb:
        await sb.write("/workspace/src/a.py", "def alpha():\n    return 1\n")
        await sb.write("/workspace/src/b.py", "ALPHA = 2\n")
        await sb.edit("/workspace/src/b.py", "ALPHA = 2", "ALPHA = 3")
        assert await sb.read_text("/workspace/src/b.py") == "ALPHA = 3\n"
        names = sorted(e.path.rsplit("/", 1)[-1] for e in await sb.ls("/workspace/src"))
        assert names == ["a.py", "b.py"]
        globbed = await sb.glob("**/*.py", path="/workspace")
        assert sorted(g.path for g in globbed) == ["/workspace/src/a.py", "/workspace/src/b.py"]
        matches = await sb.grep("(?i)alpha", path="/workspace", regex=True)
        assert {m.path for m in matches} == {"/workspace/src/a.py", "/workspace/src/b.py"}

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = b"from the archive\n" * 1000
            info = tarfile.TarInfo("up/big.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        result = await sb.upload_archive("/workspace", buf.getvalue())
        assert result.files == 1
        assert (await sb.run("wc -l < /workspace/up/big.txt")).stdout.strip() == "1000"
        back = await sb.download_archive("/workspace/up")
        with tarfile.open(fileobj=io.BytesIO(back)) as tar:
            member = tar.extractfile("big.txt") or tar.extractfile("./big.txt")
            assert member is not None and member.read() == data


async def test_the_socket_path_leads_nowhere_else(box: Harness) -> None:
    """The relay holds the socket the dataplane bound: a symlink the sandbox puts in its
    place (to the engine's own socket, say) is never followed on the host."""
    async with box.sandbox("sb_dp") as sb:
        await sb.run(
            "rm -f /run/sandlot/dp.sock; ln -s /var/run/docker.sock /run/sandlot/dp.sock",
            check=False,
        )
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(box.url("sb_dp", "/fs/list"), headers=box.headers("sb_dp"))
            assert r.status_code == 200 and "entries" in r.json()

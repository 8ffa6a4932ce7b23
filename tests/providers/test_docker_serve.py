"""``sandlot serve`` with the docker provider, end to end on a private Docker Engine: a
thread's sandbox is a container the SDK and the CLI reach through the server, a restarted
server re-adopts it with its workspace, and a teardown removes it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pexpect
import pytest

from sandlot.runtime.disk import detach_loop, loops_backed_by
from sandlot.sdk import AsyncSandlot
from tests.dockerengine import Engine
from tests.servers import SandlotServer

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(600)]

SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]


def docker_config(engine: Engine, image: str) -> str:
    """The configuration a user writes to serve sandboxes as containers."""
    return f"""
[policy]
reaper_interval_seconds = 0.3

[provider]
name = "docker"
url = "{engine.url}"
image = "{image}"
"""


def containers(engine: Engine, data_dir: Path) -> list[Any]:
    instance = hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest()[:16]
    found: list[Any] = engine.client.containers.list(
        all=True, filters={"label": f"sandlot.instance={instance}"}
    )
    return found


def remove_sandboxes(engine: Engine, data_dir: Path) -> None:
    """What a stopped server leaves for the next one to re-adopt, removed: its containers,
    their workspace volumes, and their disks' loop devices."""
    for c in containers(engine, data_dir):
        c.remove(force=True, v=True)
    instance = hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest()[:16]
    for volume in engine.client.volumes.list():
        if volume.name.startswith(f"sandlot-{instance[:8]}-"):
            volume.remove(force=True)
    for device in loops_backed_by(data_dir / "docker-disks"):
        detach_loop(device)


@pytest.fixture
def server(docker_engine: Engine, docker_image: str, tmp_path: Path) -> Iterator[SandlotServer]:
    data_dir = tmp_path / "d"
    srv = SandlotServer(data_dir, config=docker_config(docker_engine, docker_image)).start()
    try:
        yield srv
    finally:
        srv.stop()
        remove_sandboxes(docker_engine, data_dir)


def cli_env(server: SandlotServer, tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        **os.environ,
        "SANDLOT_URL": server.url,
        "SANDLOT_API_KEY": server.key("alice"),
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "COLUMNS": "200",
    }


async def test_a_thread_is_a_container_reached_through_the_server(
    server: SandlotServer, docker_engine: Engine, tmp_path: Path
) -> None:
    key = server.key("alice", "agent")
    client = AsyncSandlot(server.url, key, auto_refresh=False)
    try:
        sb = await client.ensure("thr_docker")
        (container,) = containers(docker_engine, server.data_dir)
        assert container.status == "running"
        assert container.labels["sandlot.sandbox"] == sb.id
        result = await sb.run("echo hello from $(hostname); id -u")
        assert result.stdout == "hello from sandbox\n1000\n"
        await sb.write("/workspace/notes.txt", "kept across restarts\n")
        assert await sb.read_text("/workspace/notes.txt") == "kept across restarts\n"
        await sb.stream("sleep 60")
        (started,) = [e for e in await sb.list_execs() if "sleep 60" in str(e.command)]
    finally:
        await client.aclose()

    env = cli_env(server, tmp_path)
    r = subprocess.run(
        [*SANDLOT, "exec", "thr_docker", "--", "cat notes.txt; exit 3"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 3 and r.stdout == "kept across restarts\n", r.stderr
    shell = pexpect.spawn(
        SANDLOT[0], [*SANDLOT[1:], "shell", "thr_docker"], env=env, encoding="utf-8",
        timeout=30, dimensions=(30, 100),
    )  # fmt: skip
    try:
        shell.expect(r"\$ ")
        shell.sendline("echo shell-$((6*7)); tty; stty size")
        shell.expect("shell-42")
        shell.expect(r"/dev/pts/\d+")
        shell.expect("30 100")
        shell.sendline("exit 4")
        shell.expect(pexpect.EOF)
        shell.wait()
        assert shell.exitstatus == 4
    finally:
        shell.terminate(force=True)

    # A restarted server re-adopts the running container: same container, same workspace,
    # the command started before the restart still the dataplane's.
    server.restart()
    (after,) = containers(docker_engine, server.data_dir)
    assert after.id == container.id and after.status == "running"
    client = AsyncSandlot(server.url, key, auto_refresh=False)
    try:
        sb = await client.ensure("thr_docker")
        assert await sb.read_text("/workspace/notes.txt") == "kept across restarts\n"
        assert (await sb.get_exec(started.exec_id)).command == started.command
        assert (await sb.run("echo after restart")).stdout == "after restart\n"
        # Terminating the thread's session removes the container.
        assert sb.grant.session_id is not None
        await client.release(sb.grant.session_id, terminate=True, timeout=60)
    finally:
        await client.aclose()
    async with asyncio.timeout(30):
        while containers(docker_engine, server.data_dir):
            await asyncio.sleep(0.1)
    volumes = {v.name for v in docker_engine.client.volumes.list()}
    assert not any(sb.id in v for v in volumes)


async def test_a_warm_pool_serves_new_threads_with_ready_containers(
    docker_engine: Engine, docker_image: str, tmp_path: Path
) -> None:
    config = docker_config(docker_engine, docker_image) + (
        '\n[pools.warm]\ntemplate = "default"\nmin_ready = 2\nmax_ready = 2\n'
    )
    data_dir = tmp_path / "d"
    server = SandlotServer(data_dir, config=config).start()
    key = server.key("alice", "agent")
    headers = {"Authorization": f"Bearer {key}"}

    taken: set[str] = set()

    async def pool_ready() -> dict[str, str]:
        """Wait for the pool's two ready sandboxes: their containers' ids, by sandbox."""
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
            async with asyncio.timeout(120):
                while (await http.get("/v1/pools/warm")).json()["ready"] != 2:
                    await asyncio.sleep(0.1)
        return {
            c.labels["sandlot.sandbox"]: c.id
            for c in containers(docker_engine, data_dir)
            if c.labels["sandlot.sandbox"] not in taken
        }

    client = AsyncSandlot(server.url, key, auto_refresh=False, timeout=180)
    try:
        warm = await pool_ready()
        assert len(warm) == 2
        sb = await client.ensure("thr_warm")
        # The thread got a container that was running before it asked: no new one.
        assert sb.id in warm
        taken.add(sb.id)
        (mine,) = [c for c in containers(docker_engine, data_dir) if c.id == warm[sb.id]]
        assert mine.status == "running"
        assert (await sb.run("echo warm; id -u")).stdout == "warm\n1000\n"
        refilled = await pool_ready()
        assert sb.id not in refilled

        # Concurrent ensures over repeated threads: one sandbox per thread, none shared.
        threads = [f"thr_many{i % 4}" for i in range(40)]
        got = await asyncio.gather(*(client.ensure(t) for t in threads))
        by_thread: dict[str, set[str]] = {}
        for thread, box in zip(threads, got, strict=True):
            by_thread.setdefault(thread, set()).add(box.id)
        assert all(len(ids) == 1 for ids in by_thread.values())
        assert len({next(iter(ids)) for ids in by_thread.values()}) == 4
        assert {next(iter(ids)) for ids in by_thread.values()} & set(refilled)
    finally:
        await client.aclose()
        server.stop()
        remove_sandboxes(docker_engine, data_dir)

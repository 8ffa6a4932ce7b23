"""``sandlot serve`` with the kubernetes provider, end to end on the cluster of
scripts/k8s-cluster: a thread's sandbox is a pod the SDK, ``sandlot exec`` and ``sandlot
shell`` reach through the server, a restarted server re-adopts it with its workspace and
running command, and terminating the session deletes it."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from sandlot.sdk import AsyncSandlot
from tests.k8scluster import Cluster
from tests.providers.k8sharness import NAMESPACE, core_api
from tests.providers.test_docker_serve import SANDLOT, cli_env
from tests.servers import SandlotServer

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(3000)]


def k8s_config(cluster: Cluster, image: str) -> str:
    """The configuration a user writes to serve sandboxes as pods."""
    return f"""
[policy]
reaper_interval_seconds = 0.3

[provider]
name = "kubernetes"
kubeconfig = "{cluster.kubeconfig}"
namespace = "{NAMESPACE}"
image = "{image}"
image_pull_policy = "Never"
requests_fraction = 0.01
"""


def live_pods(core: Any, data_dir: Path) -> list[Any]:
    instance = hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest()[:16]
    found = core.list_namespaced_pod(NAMESPACE, label_selector=f"sandlot.instance={instance}")
    return [p for p in found.items if p.metadata.deletion_timestamp is None]


@pytest.fixture
def core(k8s_cluster: Cluster) -> Iterator[Any]:
    api = core_api(k8s_cluster)
    try:
        yield api
    finally:
        api.api_client.close()


@pytest.fixture
def server(
    k8s_cluster: Cluster, k8s_image: str, core: Any, tmp_path: Path
) -> Iterator[SandlotServer]:
    data_dir = tmp_path / "d"
    srv = SandlotServer(data_dir, config=k8s_config(k8s_cluster, k8s_image)).start()
    try:
        yield srv
    finally:
        srv.stop()
        for pod in live_pods(core, data_dir):
            core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)


async def test_a_thread_is_a_pod_reached_through_the_server(
    server: SandlotServer, core: Any, tmp_path: Path
) -> None:
    key = server.key("alice", "agent")
    client = AsyncSandlot(server.url, key, auto_refresh=False)
    try:
        sb = await client.ensure("thr_pod")
        (pod,) = live_pods(core, server.data_dir)
        assert pod.metadata.labels["sandlot.sandbox"] == sb.id
        result = await sb.run("echo hello from $(hostname); id -u")
        assert result.stdout == "hello from sandbox\n1000\n"
        await sb.write("/workspace/notes.txt", "kept across restarts\n")
        await sb.stream("sleep 60")
        (started,) = [e for e in await sb.list_execs() if "sleep 60" in str(e.command)]
    finally:
        await client.aclose()

    env = cli_env(server, tmp_path)
    r = subprocess.run(
        [*SANDLOT, "exec", "thr_pod", "--", "cat notes.txt; exit 3"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 3 and r.stdout == "kept across restarts\n", r.stderr
    shell = pexpect.spawn(
        SANDLOT[0], [*SANDLOT[1:], "shell", "thr_pod"], env=env, encoding="utf-8",
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

    # A restarted server re-adopts the running pod: same pod, same workspace, the command
    # started before the restart still the dataplane's.
    server.restart()
    (after,) = live_pods(core, server.data_dir)
    assert after.metadata.uid == pod.metadata.uid
    client = AsyncSandlot(server.url, key, auto_refresh=False)
    try:
        sb = await client.ensure("thr_pod")
        assert await sb.read_text("/workspace/notes.txt") == "kept across restarts\n"
        assert (await sb.get_exec(started.exec_id)).command == started.command
        assert sb.grant.session_id is not None
        await client.release(sb.grant.session_id, terminate=True, timeout=60)
    finally:
        await client.aclose()
    async with asyncio.timeout(60):
        while live_pods(core, server.data_dir):
            await asyncio.sleep(0.1)

"""``sandlot serve`` with the kubernetes provider, end to end on the cluster of
scripts/k8s-cluster: a thread's sandbox is a pod the SDK, ``sandlot exec`` and ``sandlot
shell`` reach through the server, a restarted server re-adopts it with its workspace and
running command, and terminating the session deletes it; a deepagents agent and a human's
``sandlot shell`` share one pod, each seeing what the other wrote and ran."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest
from deepagents import create_deep_agent
from langchain_core.messages import AIMessage, ToolMessage

from sandlot.integrations.deepagents import SandlotBackend
from sandlot.sdk import AsyncSandlot
from tests.integrations.test_deepagents_agent import ScriptedModel, call
from tests.k8scluster import Cluster
from tests.providers.k8sharness import NAMESPACE, core_api
from tests.providers.test_docker_serve import SANDLOT, cli_env
from tests.servers import SandlotServer

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(3000)]

GREETER = "print('hello from the agent')\n"


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


def test_an_agent_and_a_shell_share_a_pod(server: SandlotServer, core: Any, tmp_path: Path) -> None:
    """The deepagents backend (an agent with a scripted model) and ``sandlot shell`` on
    the same thread: one pod; what the agent writes and runs the shell sees, and what the
    shell writes and runs the agent reads."""
    agent_key = server.key("alice", "agent")
    backend = SandlotBackend.for_thread("thr_pair", url=server.url, api_key=agent_key)
    shell = None
    try:
        writes = [
            call("write_file", 1, file_path="/workspace/greet.py", content=GREETER),
            call("execute", 2, command="cd /workspace && python3 greet.py > agent-ran.txt"),
            AIMessage(content="written"),
        ]
        agent = create_deep_agent(model=ScriptedModel(messages=iter(writes)), backend=backend)
        result = agent.invoke({"messages": [{"role": "user", "content": "write a greeter"}]})
        assert result["messages"][-1].content == "written"
        (pod,) = live_pods(core, server.data_dir)
        assert pod.metadata.labels["sandlot.sandbox"] == backend.id

        shell = pexpect.spawn(
            SANDLOT[0], [*SANDLOT[1:], "shell", "thr_pair"], env=cli_env(server, tmp_path),
            encoding="utf-8", timeout=60, dimensions=(30, 100),
        )  # fmt: skip
        shell.expect(r"\$ ")
        # The agent's file and the output of its command, seen from the human's shell.
        shell.sendline("cat agent-ran.txt; python3 -c 'import greet' | tr a-z A-Z")
        shell.expect("hello from the agent")
        shell.expect("HELLO FROM THE AGENT")
        # The human writes and runs something; the agent reads and runs it.
        shell.sendline("echo 'print(6 * 7)' > human.py && python3 human.py > human-ran.txt")
        shell.sendline("echo done-$((1+1))")
        shell.expect("done-2")
        reads = [
            call("read_file", 1, file_path="/workspace/human.py"),
            call("execute", 2, command="cd /workspace && cat human-ran.txt && python3 human.py"),
            AIMessage(content="read"),
        ]
        agent = create_deep_agent(model=ScriptedModel(messages=iter(reads)), backend=backend)
        result = agent.invoke({"messages": [{"role": "user", "content": "what did they do"}]})
        out = {m.name: str(m.content) for m in result["messages"] if isinstance(m, ToolMessage)}
        assert "print(6 * 7)" in out["read_file"]
        assert out["execute"].startswith("42\n42\n"), out["execute"]
        shell.sendline("exit 0")
        shell.expect(pexpect.EOF)
        # Still the one pod.
        (after,) = live_pods(core, server.data_dir)
        assert after.metadata.uid == pod.metadata.uid
    finally:
        if shell is not None:
            shell.terminate(force=True)
        backend.close()

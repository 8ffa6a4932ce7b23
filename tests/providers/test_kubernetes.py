"""The kubernetes provider's contract on a real single-node cluster (scripts/k8s-cluster):
a sandbox is a locked-down pod whose own dataplane verifies the broker's tokens; limits,
no egress, an unprivileged user, failures with the pod's reason, re-adoption after a
restart, cleanup of leftovers, and the dataplane's streams through the relay."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import jwt
import pytest

from sandlot.protocol.errors import SandboxNotFound
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import AdoptionRecord, SandboxSpec
from tests.dataplane.conftest import Keys
from tests.k8scluster import Cluster
from tests.providers.k8sharness import NAMESPACE, Harness, core_api, serving

# The first test of a run brings the cluster up (and builds it, once per machine).
pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(3000)]

# (The pattern does not match this command's own command line.)
KILL_DATAPLANE = (
    "for p in /proc/[0-9]*; do "
    "grep -q 'sandlot[.]dataplane' $p/cmdline 2>/dev/null && kill -9 ${p#/proc/}; done; sleep 5"
)


async def failed(h: Harness, sandbox_id: str, timeout: float = 120) -> str:
    """Wait for the listener to be told the sandbox failed: the reason."""
    async with asyncio.timeout(timeout):
        while True:
            for sid, status in h.changes:
                if sid == sandbox_id and status.state is SandboxState.FAILED:
                    return status.reason or ""
            await asyncio.sleep(0.05)


async def test_a_sandbox_is_a_locked_down_pod(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_box", cpu=0.5, memory_mb=256)
        assert any(s == "sb_box" and st.state is SandboxState.ACTIVE for s, st in h.changes)
        pod = h.pod("sb_box")
        spec = pod.spec
        assert spec.automount_service_account_token is False
        assert spec.security_context.run_as_non_root is True
        assert spec.security_context.seccomp_profile.type == "RuntimeDefault"
        (container,) = spec.containers
        assert container.security_context.capabilities.drop == ["ALL"]
        assert container.security_context.allow_privilege_escalation is False
        assert container.resources.limits == {"cpu": "500m", "memory": "256Mi"}
        assert container.command[:3] == ["python3", "-m", "sandlot.dataplane"]
        volumes = {v.name: v for v in spec.volumes}
        assert volumes["workspace"].empty_dir is not None
        assert not any(v.secret for v in spec.volumes)  # no service-account token

        async with h.sandbox("sb_box") as sb:
            probe = (
                "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; "
                "touch /etc/x 2>&1 || echo ro; echo $HOME; pwd; "
                "cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
            )
            out = (await sb.run(probe)).stdout.split()
            assert out[:7] == ["1000", "CapEff:", "0000000000000000", "NoNewPrivs:", "1",
                               "Seccomp:", "2"]  # fmt: skip
            assert "ro" in out and out[-3:-1] == ["/workspace", "/workspace"]
            assert int(out[-1]) == 256 << 20
            await sb.write("/workspace/notes.txt", "kept\n")
            assert (await sb.run("cat /workspace/notes.txt")).stdout == "kept\n"
        await h.provider.delete("sb_box")
        await h.provider.delete("sb_box")  # idempotent
        assert not [p for p in h.pods() if p.metadata.deletion_timestamp is None]
        maps = h.core.list_namespaced_config_map(
            NAMESPACE, label_selector=f"sandlot.instance={h.provider.instance}"
        )
        assert not maps.items


async def test_a_sandbox_has_no_egress(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    # A listener of the host's, on every address: the pod must not reach it.
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        async with serving(k8s_cluster, k8s_image, tmp_path) as h:
            await h.create("sb_net")
            gateway = h.pod("sb_net").status.pod_ip.rsplit(".", 1)[0] + ".1"
            connect = (
                'python3 -c "import socket, sys; s = socket.socket(); s.settimeout(3); '
                's.connect((sys.argv[1], int(sys.argv[2])))" {} {}'
            )
            async with h.sandbox("sb_net") as sb:
                outside = await sb.run(connect.format("1.1.1.1", 80), check=False)
                assert outside.exit_code != 0 and "unreachable" in outside.stderr.lower()
                host = await sb.run(connect.format(gateway, port), check=False)
                assert host.exit_code != 0 and "timed out" in host.stderr.lower()
                # The broker's side reaches the pod (that is how the relay works).
                assert (await sb.run("echo reached")).stdout == "reached\n"
            policies = h.policies()
            assert policies == {
                f"sandlot-{h.provider.instance[:8]}-ingress",
                f"sandlot-{h.provider.instance[:8]}-no-egress",
            }
            await h.provider.delete("sb_net")
    finally:
        listener.close()


async def test_memory_limit_is_enforced_and_a_killed_dataplane_fails_the_sandbox(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_lim", memory_mb=128)
        async with h.sandbox("sb_lim") as sb:
            hog = await sb.run("python3 -c 'b = bytearray(400 << 20); print(len(b))'", check=False)
            assert hog.exit_code == 137 and hog.stdout == ""  # SIGKILL by the OOM killer
            # The dataplane outlived it, in the same pod.
            assert (await sb.run("echo alive")).stdout == "alive\n"
            h.changes.clear()
            await sb.stream(KILL_DATAPLANE)
        # Told by the watch, with the pod's reason.
        reason = await failed(h, "sb_lim")
        assert "exit code 137" in reason
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(h.url("sb_lim", "/exec"), json={"command": "true"},
                             headers=h.headers("sb_lim"))  # fmt: skip
            assert r.status_code == 503 and "exit code 137" in r.text
        await h.provider.delete("sb_lim")


async def test_a_missing_image_fails_with_the_pods_reason(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        template = Template(name="t", image="sandlot-no-such-image:1")
        await h.provider.create(SandboxSpec("sb_noimg", 1, template))
        reason = await failed(h, "sb_noimg")
        assert reason.startswith("ErrImageNeverPull")
        assert (await h.provider.status("sb_noimg")).state is SandboxState.FAILED
        await h.provider.delete("sb_noimg")


async def test_a_pod_deleted_behind_the_providers_back_fails_its_sandbox(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_del")
        h.changes.clear()
        name = h.pod("sb_del").metadata.name
        await asyncio.to_thread(h.core.delete_namespaced_pod, name, NAMESPACE)
        reason = await failed(h, "sb_del")
        assert reason  # the pod's end (terminated) or its deletion
        await h.provider.delete("sb_del")


async def test_readoption_after_a_restart_and_cleanup_of_leftovers(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    keys = Keys()
    async with serving(k8s_cluster, k8s_image, tmp_path, keys) as h:
        await h.create("sb_keep")
        await h.create("sb_orphan")
        async with h.sandbox("sb_keep") as sb:
            await sb.write("/workspace/state.txt", "before\n")
            await sb.stream("sleep 3; echo finished")
            (before,) = await sb.list_execs()
    # The server stopped: its pods run on. A new one re-adopts the bound ones.
    template = Template(name="t", image="host")
    records = [
        AdoptionRecord("sb_keep", 1, template, SandboxState.ACTIVE),
        AdoptionRecord("sb_gone", 1, template, SandboxState.ACTIVE),
    ]
    async with serving(k8s_cluster, k8s_image, tmp_path, keys) as h:
        lost = await h.provider.load_state(records)
        assert lost == ["sb_gone"]
        assert (await h.provider.status("sb_keep")).state is SandboxState.ACTIVE
        with pytest.raises(SandboxNotFound):
            await h.provider.status("sb_orphan")
        alive = {
            p.metadata.labels["sandlot.sandbox"]
            for p in h.pods()
            if p.metadata.deletion_timestamp is None
        }
        assert alive == {"sb_keep"}
        assert await h.provider.list_sandboxes() >= {"sb_keep"}
        async with h.sandbox("sb_keep") as sb:
            assert await sb.read_text("/workspace/state.txt") == "before\n"
            # The command started before the restart is still the dataplane's.
            snap = await sb.get_exec(before.exec_id)
            assert snap.command == before.command
        await h.provider.delete("sb_keep")
        assert not [p for p in h.pods() if p.metadata.deletion_timestamp is None]


async def test_streams_shells_and_files_through_the_relay(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_dp")
        async with h.sandbox("sb_dp") as sb:
            cmd = await sb.stream("for i in 1 2 3; do echo line $i; sleep 0.05; done; echo e >&2")
            result = await cmd.wait()
            assert result.stdout == "line 1\nline 2\nline 3\n" and result.stderr == "e\n"
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
            snapshot = await h.provider.status("sb_dp")
            await sb.write("/workspace/seen.txt", "x")
            async with sb.events(after=snapshot.last_event_sequence, transport="ws") as ev:
                async for event in ev:
                    if event.kind == "fs":
                        assert event.details["fs"]["path"] == "/workspace/seen.txt"
                        break
        await h.provider.delete("sb_dp")


async def test_revocation_and_a_rotated_key_reach_the_pod(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_tok")
        async with httpx.AsyncClient(timeout=20) as c:
            url, body = h.url("sb_tok", "/exec"), {"command": "true"}
            other = await c.post(url, json=body, headers=h.headers("sb_other"))
            assert other.status_code == 403
            token = h.keys.token("sb_tok")
            auth = {"Authorization": f"Bearer {token}"}
            assert (await c.post(url, json=body, headers=auth)).status_code == 200
            # Nobody but the provider pushes revocations to the pod's dataplane.
            pod_ip = h.pod("sb_tok").status.pod_ip
            push = f"http://{pod_ip}:{h.provider.settings.port}/__control/revoke"
            jti = jwt.decode(token, options={"verify_signature": False})["jti"]
            doc = {"revoked": [{"jti": jti, "expires_at": time.time() + 900}]}
            for forged in ({}, {"X-Sandlot-Control": "guessed"}):
                assert (await c.post(push, json=doc, headers=forged)).status_code == 403
            assert (await c.post(url, json=body, headers=auth)).status_code == 200
            relayed = h.url("sb_tok").rsplit("/v1", 1)[0] + "/__control/revoke"
            assert (await c.post(relayed, json=doc)).status_code == 404
            # The protocol's bound: a revoked token is refused within 1 s (not on the
            # kubelet's next sync of the ConfigMap, tens of seconds later).
            t0 = time.monotonic()
            await h.provider.revoke("sb_tok", [RevokedToken(jti, time.time() + 900)])
            while (await c.post(url, json=body, headers=auth)).status_code != 401:
                assert time.monotonic() - t0 < 1.0, "revocation took more than 1 s"
                await asyncio.sleep(0.02)
            # The ConfigMap keeps the list for a dataplane that starts again.
            (volume,) = [v for v in h.pod("sb_tok").spec.volumes if v.name == "trust"]
            trust = core_api(k8s_cluster).read_namespaced_config_map(
                volume.config_map.name, NAMESPACE
            )
            assert jti in trust.data["revoked.json"]
            # A rotated key reaches the pod without a restart, the same way.
            h.keys.private = Keys().private
            h.keys.kid = "k_rotated"
            async with asyncio.timeout(90):
                while (
                    await c.post(url, json=body, headers=h.headers("sb_tok"))
                ).status_code != 200:
                    await asyncio.sleep(0.5)
        await h.provider.delete("sb_tok")

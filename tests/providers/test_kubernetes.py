"""The kubernetes provider's contract on a real single-node cluster (scripts/k8s-cluster):
a sandbox is a locked-down pod whose own dataplane verifies the broker's tokens; limits,
no egress, an unprivileged user, failures with the pod's reason, re-adoption after a
restart, cleanup of leftovers, and the dataplane's streams through the relay."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from kubernetes import client as k8s_client

from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable, SandboxNotFound
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import AdoptionRecord, SandboxSpec
from sandlot.providers.podspec import (
    CONTAINER,
    LABEL_INSTANCE,
    LABEL_SANDBOX,
    object_name,
    volume_claim,
)
from tests.dataplane.conftest import Keys
from tests.k8scluster import Cluster
from tests.providers.k8sharness import NAMESPACE, Harness, core_api, serving
from tests.providers.outlive import no_command_stops_the_dataplane, orphans_are_collected

# The first test of a run brings the cluster up (and builds it, once per machine).
pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(3000)]


# (The pattern does not match this command's own command line.)
def kill_dataplane(cluster: Cluster, sandbox_id: str) -> None:
    """SIGKILL the sandbox's dataplane through its node's engine (no command can)."""
    engine = cluster.docker()
    try:
        label = f"io.kubernetes.container.name={CONTAINER}"
        (found,) = [
            c
            for c in engine.containers.list(filters={"label": label})
            if sandbox_id in c.attrs["Args"]
        ]
        found.kill()
    finally:
        engine.close()


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
        assert container.command[:5] == ["python3", "-s", "-P", "-m", "sandlot.dataplane"]
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


async def test_memory_limit_is_enforced_and_out_of_memory_is_reported_as_oom(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_lim", memory_mb=128)
        async with h.sandbox("sb_lim") as sb:
            hog = await sb.run("python3 -c 'b = bytearray(400 << 20); print(len(b))'", check=False)
            # SIGKILL by the OOM killer, and said so (the container's cgroup counted it).
            assert hog.exit_code == 137 and hog.stdout == "" and hog.oom_killed
            assert (await sb.get_exec(hog.exec_id)).oom_killed
            quick = await sb.run("kill -9 $$", check=False)
            assert quick.exit_code == 137 and not quick.oom_killed
            # The dataplane outlived it, in the same pod.
            assert (await sb.run("echo alive")).stdout == "alive\n"
            h.changes.clear()
            # Memory no process holds: /tmp is memory-backed and counts toward the pod's
            # limit. Filled past it, the biggest process left to kill is the dataplane.
            await sb.stream("head -c 300M /dev/zero > /tmp/fill; sleep 30")
        # Told by the watch, with the pod's reason and its code.
        reason = await failed(h, "sb_lim")
        assert reason.startswith("OOM: ") and "OOMKilled" in reason, reason
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(h.url("sb_lim", "/exec"), json={"command": "true"},
                             headers=h.headers("sb_lim"))  # fmt: skip
            assert r.status_code == 503
            error = r.json()["error"]
            assert error["code"] == "PROVIDER_UNAVAILABLE" and error["metadata"]["reason"] == "OOM"
            assert error["message"] == reason
        await h.provider.delete("sb_lim")


async def test_no_command_stops_the_dataplane_but_its_death_fails_the_sandbox(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        await h.create("sb_kill")

        async def state() -> SandboxState:
            return (await h.provider.status("sb_kill")).state

        async with h.sandbox("sb_kill") as sb:
            await no_command_stops_the_dataplane(sb, state)
            await orphans_are_collected(sb, batches=2)
        # Killed from outside the sandbox (its node's engine).
        h.changes.clear()
        kill_dataplane(k8s_cluster, "sb_kill")
        reason = await failed(h, "sb_kill")
        assert reason.startswith("EXITED: ") and "exit code 137" in reason, reason
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(h.url("sb_kill", "/exec"), json={"command": "true"},
                             headers=h.headers("sb_kill"))  # fmt: skip
            assert r.status_code == 503 and r.json()["error"]["metadata"]["reason"] == "EXITED"
        await h.provider.delete("sb_kill")


async def test_a_named_volume_is_its_claim_and_one_without_a_claim_fails_at_once(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    # A volume's name may hold capitals and _, a claim's may not: the claim's name is
    # made from it. Before, the pod waited for a claim nobody could name until the start's
    # deadline (120 s), and failed for a reason that named no volume.
    mounts = [{"volume": "Shared_Data", "path": "/data"}]
    claim = volume_claim("x" * 16, "Shared_Data")
    assert claim.startswith("sl-xxxxxxxx-vol-shared-data-") and claim == claim.lower()
    async with serving(k8s_cluster, k8s_image, tmp_path, Keys()) as h:
        claim = volume_claim(h.provider.instance, "Shared_Data")
        spec = SandboxSpec("sb_novol", 1, Template(name="t", image="host", volume_mounts=mounts))
        await h.provider.create(spec)
        async with asyncio.timeout(30):
            while (st := await h.provider.status("sb_novol")).state is SandboxState.PROVISIONING:
                await asyncio.sleep(0.05)
        assert st.state is SandboxState.FAILED and (st.reason or "").startswith("VOLUME: ")
        assert claim in (st.reason or "")
        await h.provider.delete("sb_novol")
        h.core.create_namespaced_persistent_volume_claim(
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "16Mi"}},
                },
            },
        )
        try:
            for sid in ("sb_vol1", "sb_vol2"):
                await h.create(sid, volume_mounts=mounts)
            async with h.sandbox("sb_vol1") as sb:
                await sb.run("echo shared > /data/note.txt")
            async with h.sandbox("sb_vol2") as sb:
                assert (await sb.run("cat /data/note.txt")).stdout == "shared\n"
        finally:
            for sid in ("sb_vol1", "sb_vol2"):
                await h.provider.delete(sid)
            h.core.delete_namespaced_persistent_volume_claim(claim, NAMESPACE)


async def test_a_claim_workspace_survives_suspend_and_resume(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    keys = Keys()
    config = {"workspace": "pvc", "workspace_size_mb": 64}
    async with serving(k8s_cluster, k8s_image, tmp_path, keys, **config) as h:
        assert h.provider.can_suspend("sb_pvc")
        await h.create("sb_pvc")
        first = h.pod("sb_pvc")
        (volume,) = [v for v in first.spec.volumes if v.name == "workspace"]
        claim_name = volume.persistent_volume_claim.claim_name
        claim = h.core.read_namespaced_persistent_volume_claim(claim_name, NAMESPACE)
        # Bound by scripts/k8s-cluster's provisioner (its default StorageClass).
        assert claim.status.phase == "Bound" and claim.spec.storage_class_name == "sandlot-local"
        async with h.sandbox("sb_pvc") as sb:
            await sb.write("/workspace/kept.txt", "before the suspend\n")
            await sb.run("mkdir -p sub && echo made by a command > sub/cmd.txt")
            await sb.stream("sleep 600")
        before = (await h.provider.status("sb_pvc")).last_event_sequence

        status = await h.provider.suspend("sb_pvc")
        assert status.state is SandboxState.SUSPENDED
        suspended_at = status.last_event_sequence
        assert suspended_at >= before
        assert not h.pods()  # the pod is gone, not only going
        claim = h.core.read_namespaced_persistent_volume_claim(claim_name, NAMESPACE)
        assert claim.status.phase == "Bound"
        assert (await h.provider.suspend("sb_pvc")).state is SandboxState.SUSPENDED
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(h.url("sb_pvc", "/exec"), json={"command": "true"},
                             headers=h.headers("sb_pvc"))  # fmt: skip
            assert r.status_code == 423

        status = await h.provider.resume("sb_pvc")
        assert status.state is SandboxState.ACTIVE
        assert h.pod("sb_pvc").metadata.uid != first.metadata.uid
        async with h.sandbox("sb_pvc") as sb:
            assert await sb.read_text("/workspace/kept.txt") == "before the suspend\n"
            assert (await sb.run("cat sub/cmd.txt")).stdout == "made by a command\n"
            # Processes ended with the pod; the event log carries on its sequence.
            assert not [e for e in await sb.list_execs() if "sleep 600" in str(e.command)]
            await sb.write("/workspace/after.txt", "x")
            async with sb.events(after=suspended_at, transport="ws") as events:
                async for event in events:
                    assert event.sequence > suspended_at
                    if event.kind == "fs" and event.details["fs"]["path"] == "/workspace/after.txt":
                        break
        await h.provider.suspend("sb_pvc")

    # A restarted server re-adopts the suspended sandbox from its record alone.
    template = Template(name="t", image="host", resources={"memory_mb": 256})
    records = [AdoptionRecord("sb_pvc", 1, template, SandboxState.SUSPENDED)]
    async with serving(k8s_cluster, k8s_image, tmp_path, keys, **config) as h:
        assert await h.provider.load_state(records) == []
        assert (await h.provider.status("sb_pvc")).state is SandboxState.SUSPENDED
        assert (await h.provider.resume("sb_pvc")).state is SandboxState.ACTIVE
        async with h.sandbox("sb_pvc") as sb:
            assert await sb.read_text("/workspace/kept.txt") == "before the suspend\n"
        volume_name = h.core.read_namespaced_persistent_volume_claim(
            claim_name, NAMESPACE
        ).spec.volume_name
        await h.provider.delete("sb_pvc")
        # The claim goes with the sandbox, and the provisioner deletes its volume.
        async with asyncio.timeout(60):
            while True:
                names = {pv.metadata.name for pv in h.core.list_persistent_volume().items}
                claims = h.core.list_namespaced_persistent_volume_claim(
                    NAMESPACE, label_selector=f"sandlot.instance={h.provider.instance}"
                )
                if volume_name not in names and not claims.items:
                    break
                await asyncio.sleep(0.2)


async def test_an_emptydir_workspace_is_not_suspended(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        assert not h.provider.can_suspend("sb_any")
        with pytest.raises(InvalidRequest):
            await h.provider.suspend("sb_any")


async def test_a_missing_image_fails_with_the_pods_reason(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    async with serving(k8s_cluster, k8s_image, tmp_path) as h:
        template = Template(name="t", image="sandlot-no-such-image:1")
        await h.provider.create(SandboxSpec("sb_noimg", 1, template))
        reason = await failed(h, "sb_noimg")
        assert reason.startswith("IMAGE: ErrImageNeverPull"), reason
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
            # Nor does anyone else on the cluster's network learn what the sandbox does:
            # only its readiness answers without the key (the kubelet's probe).
            pod = f"http://{pod_ip}:{h.provider.settings.port}"
            for method, path in (("GET", "/__control/status"), ("POST", "/__control/reload"),
                                 ("GET", "/metrics")):  # fmt: skip
                assert (await c.request(method, pod + path)).status_code == 403, path
            assert (await c.get(pod + "/__control/ready")).status_code == 200
            assert h.pod("sb_tok").spec.containers[0].readiness_probe.http_get.path == (
                "/__control/ready"
            )
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


# The agent-sandbox CRD as this test installs it: the group, kind and version its
# project serves, with a schema that keeps every field (the project's own is stricter).
SANDBOX_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "sandboxes.agents.x-k8s.io"},
    "spec": {
        "group": "agents.x-k8s.io",
        "scope": "Namespaced",
        "names": {"plural": "sandboxes", "singular": "sandbox", "kind": "Sandbox"},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def crd_served(api: Any) -> bool:
    groups = k8s_client.ApisApi(api).get_api_versions().groups or []
    return any(g.name == "agents.x-k8s.io" for g in groups)


async def install_sandbox_crd(core: Any) -> None:
    ext = k8s_client.ApiextensionsV1Api(core.api_client)
    with contextlib.suppress(k8s_client.ApiException):
        ext.create_custom_resource_definition(SANDBOX_CRD)
    async with asyncio.timeout(60):
        while not crd_served(core.api_client):
            await asyncio.sleep(0.2)


async def remove_sandbox_crd(core: Any) -> None:
    ext = k8s_client.ApiextensionsV1Api(core.api_client)
    with contextlib.suppress(k8s_client.ApiException):
        ext.delete_custom_resource_definition(SANDBOX_CRD["metadata"]["name"])
    async with asyncio.timeout(60):
        while crd_served(core.api_client):
            await asyncio.sleep(0.2)


async def agent_sandbox_controller(core: Any, namespace: str) -> None:
    """What agent-sandbox's controller does with a ``Sandbox`` (its documented contract),
    run by the test because that controller cannot be installed here (not packaged in
    Debian): for each ``Sandbox`` of ``replicas: 1`` without its pod, the pod named after
    it, from its ``podTemplate``, owned by it (so the cluster's garbage collector deletes
    the pod with it); for ``replicas: 0``, its pod deleted."""
    custom = k8s_client.CustomObjectsApi(core.api_client)
    while True:
        found = await asyncio.to_thread(
            custom.list_namespaced_custom_object,
            "agents.x-k8s.io",
            "v1alpha1",
            namespace,
            "sandboxes",
        )
        pods = await asyncio.to_thread(core.list_namespaced_pod, namespace)
        have = {p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None}
        for item in found.get("items", []):
            meta, spec = item["metadata"], item["spec"]
            name = meta["name"]
            if spec.get("replicas", 1) == 0:
                if name in have:
                    with contextlib.suppress(k8s_client.ApiException):
                        await asyncio.to_thread(core.delete_namespaced_pod, name, namespace)
                continue
            if name in have or meta.get("deletionTimestamp"):
                continue
            template = spec["podTemplate"]
            owner = {
                "apiVersion": item["apiVersion"],
                "kind": item["kind"],
                "name": name,
                "uid": meta["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {**template.get("metadata", {}), "name": name},
                "spec": template["spec"],
            }
            pod["metadata"]["ownerReferences"] = [owner]
            with contextlib.suppress(k8s_client.ApiException):  # 409: made meanwhile
                await asyncio.to_thread(core.create_namespaced_pod, namespace, pod)
        await asyncio.sleep(0.2)


async def test_where_agent_sandbox_is_installed_a_sandbox_is_a_sandbox_resource(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    """``agent_sandbox = "on"`` with the CRD: each sandbox a ``Sandbox`` object on the API
    server, its pod made from it (by the controller's stand-in above) and served by the
    provider as its own pods are; suspend scales it to ``replicas: 0`` (the pod goes, the
    claim stays) and resume back to 1 (its files there); delete and the clean-up of
    leftovers remove the object and its pod; a pool's pod is claimed once."""
    core = core_api(k8s_cluster)
    custom = k8s_client.CustomObjectsApi(core.api_client)
    await install_sandbox_crd(core)
    controller: asyncio.Task[None] | None = None
    try:
        config = {"agent_sandbox": "on", "workspace": "pvc"}
        async with serving(k8s_cluster, k8s_image, tmp_path, **config) as h:
            ns, instance = h.provider.namespace, h.provider.instance
            controller = asyncio.create_task(agent_sandbox_controller(core, ns))

            def sandbox_object(sid: str) -> dict[str, Any]:
                name = object_name(instance, sid)
                found: dict[str, Any] = custom.get_namespaced_custom_object(
                    "agents.x-k8s.io", "v1alpha1", ns, "sandboxes", name
                )
                return found

            await h.create("sb_as")
            made = await asyncio.to_thread(sandbox_object, "sb_as")
            assert made["spec"]["replicas"] == 1
            labels = made["spec"]["podTemplate"]["metadata"]["labels"]
            assert labels[LABEL_SANDBOX] == "sb_as" and labels[LABEL_INSTANCE] == instance
            pod = await asyncio.to_thread(core.read_namespaced_pod, made["metadata"]["name"], ns)
            (owner,) = pod.metadata.owner_references
            assert (owner.kind, owner.uid) == ("Sandbox", made["metadata"]["uid"])
            async with h.sandbox("sb_as") as sb:
                result = await sb.run("echo kept > f && cat f && id -u")
            assert result.stdout.split() == ["kept", "1000"], result
            first_pod = pod.metadata.uid
            assert h.provider.can_suspend("sb_as")
            suspended = await h.provider.suspend("sb_as")
            assert suspended.state is SandboxState.SUSPENDED
            assert (await asyncio.to_thread(sandbox_object, "sb_as"))["spec"]["replicas"] == 0
            await asyncio.sleep(1)  # the controller does not make it again
            with pytest.raises(k8s_client.ApiException):
                await asyncio.to_thread(core.read_namespaced_pod, made["metadata"]["name"], ns)
            resumed = await h.provider.resume("sb_as")
            assert resumed.state is SandboxState.ACTIVE, resumed
            again = await asyncio.to_thread(sandbox_object, "sb_as")
            assert again["spec"]["replicas"] == 1
            assert again["metadata"]["uid"] == made["metadata"]["uid"]  # the same object
            pod = await asyncio.to_thread(core.read_namespaced_pod, made["metadata"]["name"], ns)
            assert pod.metadata.uid != first_pod
            async with h.sandbox("sb_as") as sb:
                result = await sb.run("cat f")
            assert result.stdout == "kept\n", result
            await h.provider.delete("sb_as")

            async def gone(read: Any, *args: Any) -> None:
                async with asyncio.timeout(90):
                    while True:
                        try:
                            await asyncio.to_thread(read, *args)
                        except k8s_client.ApiException as exc:
                            if exc.status == 404:
                                return
                            raise
                        await asyncio.sleep(0.2)

            name = object_name(instance, "sb_as")
            await gone(sandbox_object, "sb_as")
            await gone(core.read_namespaced_pod, name, ns)
            # A Sandbox no sandbox of the store keeps is a leftover.
            await h.create("sb_left")
            assert await h.provider.cleanup_leftovers(set()) == ["sb_left"]
            await gone(sandbox_object, "sb_left")
            await gone(core.read_namespaced_pod, object_name(instance, "sb_left"), ns)
            # A pool's pod: its pool label comes from the template; one claim of many wins.
            template = Template(name="t", image="host", resources={"memory_mb": 256})
            await h.provider.create(SandboxSpec("sb_pooled", 1, template, pool="warm"))
            await h.wait("sb_pooled", SandboxState.ACTIVE)
            assert h.pod("sb_pooled").metadata.labels["sandlot.pool"] == "warm"
            claims = [h.provider.claim_pooled("sb_pooled") for _ in range(20)]
            assert (await asyncio.gather(*claims)).count(True) == 1
            assert "sandlot.pool" not in h.pod("sb_pooled").metadata.labels
            await h.provider.delete("sb_pooled")
    finally:
        if controller is not None:
            controller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await controller
        await remove_sandbox_crd(core)
        core.api_client.close()


async def test_agent_sandbox_crds_are_detected(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    """The CRD installed and removed, and the provider's detection of it through
    discovery in each mode."""
    core = core_api(k8s_cluster)
    try:
        async with serving(k8s_cluster, k8s_image, tmp_path, agent_sandbox="auto") as h:
            # No CRD: bare pods.
            assert h.provider.sandbox_resources is None
            assert h.provider.readiness()["agent_sandbox"] is None
        with pytest.raises(ProviderUnavailable, match="agent-sandbox"):
            async with serving(k8s_cluster, k8s_image, tmp_path, agent_sandbox="on"):
                pass
        await install_sandbox_crd(core)
        async with serving(k8s_cluster, k8s_image, tmp_path) as h:
            assert h.provider.sandbox_resources is None  # the default never looks
            assert h.provider.can_suspend("sb_any") is False  # (emptyDir)
        config = {"agent_sandbox": "auto", "workspace": "pvc"}
        async with serving(k8s_cluster, k8s_image, tmp_path, **config) as h:
            resources = h.provider.sandbox_resources
            assert resources is not None and resources.version == "v1alpha1"
            assert h.provider.readiness()["agent_sandbox"] == "v1alpha1"
            # Suspend scales the Sandbox to zero replicas (a pvc workspace).
            assert h.provider.can_suspend("sb_any")
        config = {"agent_sandbox": "on", "workspace": "pvc"}
        async with serving(k8s_cluster, k8s_image, tmp_path, **config) as h:
            assert h.provider.sandbox_resources is not None
    finally:
        await remove_sandbox_crd(core)
        core.api_client.close()

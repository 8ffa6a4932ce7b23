"""The kubernetes provider's objects and its reading of pod statuses, as plain data (the
cluster itself is exercised by test_kubernetes.py)."""

from __future__ import annotations

import json
import re

import pytest
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Pod,
    V1PodStatus,
)

from sandlot.protocol.errors import InvalidRequest
from sandlot.protocol.sessions import Template
from sandlot.providers.agentsandbox import sandbox_manifest
from sandlot.providers.base import SandboxSpec
from sandlot.providers.k8spool import claim_patch, release_patch
from sandlot.providers.podspec import (
    STATE_MOUNT,
    PodSettings,
    failure_code,
    network_policy_manifests,
    object_name,
    pod_failure,
    pod_manifest,
    trust_manifest,
    volume_claim,
)

SETTINGS = PodSettings(instance="0123456789abcdef", issuer="https://broker.test")


def spec(sandbox_id: str = "sb_abc", **template: object) -> SandboxSpec:
    fields = {"name": "t", "image": "host", **template}
    return SandboxSpec(sandbox_id, 3, Template(**fields))  # type: ignore[arg-type]


def pod(phase: str, state: V1ContainerState | None = None, **status: object) -> V1Pod:
    statuses = None
    if state is not None:
        statuses = [
            V1ContainerStatus(
                name="dataplane", image="i", image_id="", ready=False, restart_count=0,
                state=state,
            )
        ]  # fmt: skip
    return V1Pod(status=V1PodStatus(phase=phase, container_statuses=statuses, **status))


def test_a_pod_is_locked_down_and_runs_the_dataplane() -> None:
    manifest = pod_manifest(SETTINGS, spec(resources={"cpu": 0.5, "memory_mb": 300}))
    assert manifest["metadata"]["labels"] == {
        "sandlot.sandbox": "sb_abc",
        "sandlot.generation": "3",
        "sandlot.instance": SETTINGS.instance,
        "sandlot.egress": "deny",
    }
    pod_spec = manifest["spec"]
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod_spec["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"] == {
        "limits": {"cpu": "500m", "memory": "300Mi"},
        "requests": {"cpu": "500m", "memory": "300Mi"},
    }
    command = container["command"]
    assert command[:5] == ["python3", "-s", "-P", "-m", "sandlot.dataplane"]
    assert command[command.index("--generation") + 1] == "3"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["workspace"] == {"name": "workspace", "emptyDir": {}}
    assert volumes["trust"]["configMap"]["name"] == object_name(
        SETTINGS.instance, "sb_abc", "trust"
    )


def test_requests_are_a_fraction_of_the_limits_and_network_templates_may_send() -> None:
    settings = PodSettings(instance="i" * 16, issuer="x", requests_fraction=0.1)
    manifest = pod_manifest(settings, spec(network="host", resources={"cpu": 2, "memory_mb": 1000}))
    (container,) = manifest["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "200m", "memory": "100Mi"}
    assert manifest["metadata"]["labels"]["sandlot.egress"] == "allow"
    egress = network_policy_manifests(settings)[1]["spec"]
    assert egress["podSelector"]["matchLabels"]["sandlot.egress"] == "deny"
    assert egress["egress"] == []


def test_names_are_valid_and_distinct_and_bad_ids_are_refused() -> None:
    a, b = object_name("0" * 16, "sb_A"), object_name("0" * 16, "sb_a")
    assert a != b and a.startswith("sl-00000000-sb-a-") and len(a) <= 63
    with pytest.raises(InvalidRequest):
        pod_manifest(SETTINGS, spec("x" * 64))
    trust = trust_manifest(SETTINGS, spec(), '{"keys": []}')
    assert json.loads(trust["data"]["revoked.json"]) == {"revoked": []}
    assert "control.key" not in trust["data"]
    keyed = trust_manifest(SETTINGS, spec(), '{"keys": []}', "k" * 43)
    assert keyed["data"]["control.key"] == "k" * 43


def test_a_pool_pod_is_labelled_and_its_claim_names_the_resource_version() -> None:
    pooled = SandboxSpec("sb_p", 1, Template(name="t", image="host"), pool="warm")
    labels = pod_manifest(SETTINGS, pooled)["metadata"]["labels"]
    assert labels["sandlot.pool"] == "warm"
    assert "sandlot.pool" not in pod_manifest(SETTINGS, spec())["metadata"]["labels"]
    # A pool name that is no label value (it ends with '-') gets a stable hash.
    odd = SandboxSpec("sb_p", 1, Template(name="t", image="host"), pool="warm-")
    value = pod_manifest(SETTINGS, odd)["metadata"]["labels"]["sandlot.pool"]
    assert value.startswith("h") and len(value) == 41
    assert claim_patch("42", "warm") == {
        "metadata": {
            "resourceVersion": "42",
            "labels": {"sandlot.pool": None, "sandlot.claimed-from": "warm"},
        }
    }
    assert "resourceVersion" not in claim_patch(None, "warm")["metadata"]
    assert release_patch("warm-") == {
        "metadata": {"labels": {"sandlot.pool": value, "sandlot.claimed-from": None}}
    }


def test_the_reason_a_pod_failed_starts_with_its_code() -> None:
    assert pod_failure(pod("Pending")) is None
    assert pod_failure(pod("Running", V1ContainerState())) is None
    oom = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=137, reason="OOMKilled"))
    reason = pod_failure(pod("Failed", oom))
    assert reason == "OOM: the sandbox ran out of memory (OOMKilled, exit code 137)"
    assert failure_code(reason) == "OOM"
    killed = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=137, reason="Error"))
    reason = pod_failure(pod("Failed", killed))
    assert reason == "EXITED: the sandbox's main process ended (Error, exit code 137)"
    assert failure_code(reason) == "EXITED"
    never = V1ContainerState(
        waiting=V1ContainerStateWaiting(reason="ErrImageNeverPull", message="no image x")
    )
    assert pod_failure(pod("Pending", never)) == "IMAGE: ErrImageNeverPull: no image x"
    config = V1ContainerState(waiting=V1ContainerStateWaiting(reason="CreateContainerConfigError"))
    assert pod_failure(pod("Pending", config)) == "START: CreateContainerConfigError"
    creating = V1ContainerState(waiting=V1ContainerStateWaiting(reason="ContainerCreating"))
    assert pod_failure(pod("Pending", creating)) is None
    evicted = pod("Failed", oom, reason="Evicted", message="low on memory")
    assert pod_failure(evicted) == "EVICTED: Evicted: low on memory"
    assert failure_code("EVICTED: Evicted: low on memory") == "EVICTED"
    # Only the codes of the list: a reason that merely has a colon has none.
    assert failure_code("cluster: 403 Forbidden") is None
    assert failure_code(None) is None


def test_a_claim_workspace_keeps_the_dataplanes_log_beside_it() -> None:
    settings = PodSettings(instance=SETTINGS.instance, issuer=SETTINGS.issuer, workspace="pvc")
    manifest = pod_manifest(settings, spec())
    (container,) = manifest["spec"]["containers"]
    claim = object_name(settings.instance, "sb_abc", "workspace")
    (volume,) = [v for v in manifest["spec"]["volumes"] if v["name"] == "workspace"]
    assert volume == {"name": "workspace", "persistentVolumeClaim": {"claimName": claim}}
    mounts = [m for m in container["volumeMounts"] if m["name"] == "workspace"]
    assert mounts == [
        {"name": "workspace", "mountPath": "/workspace", "subPath": "workspace"},
        {"name": "workspace", "mountPath": STATE_MOUNT, "subPath": "dataplane"},
    ]
    command = container["command"]
    assert command[command.index("--state-dir") + 1] == STATE_MOUNT
    # An emptyDir workspace lives and dies with the pod: no state directory.
    plain = pod_manifest(SETTINGS, spec())["spec"]["containers"][0]
    assert "--state-dir" not in plain["command"]
    # A resumed sandbox's trust ConfigMap carries its revocations.
    doc = {"revoked": [{"jti": "j1", "expires_at": 5.0}]}
    trust = trust_manifest(settings, spec(), "{}", "k", doc)
    assert json.loads(trust["data"]["revoked.json"]) == doc


def test_an_agent_sandbox_resource_carries_the_pod() -> None:
    pod = pod_manifest(SETTINGS, spec())
    body = sandbox_manifest("v1alpha1", pod)
    assert body["apiVersion"] == "agents.x-k8s.io/v1alpha1" and body["kind"] == "Sandbox"
    # Named as the pod: agent-sandbox's controller names its pod after the Sandbox.
    assert body["metadata"]["name"] == pod["metadata"]["name"]
    assert body["metadata"]["labels"] == pod["metadata"]["labels"]
    template = body["spec"]["podTemplate"]
    assert template["metadata"]["labels"] == pod["metadata"]["labels"]
    assert template["metadata"]["annotations"] == pod["metadata"]["annotations"]
    assert template["spec"] == pod["spec"]
    assert body["spec"]["replicas"] == 1


def test_a_named_volumes_claim_is_a_dns_name_and_one_per_volume() -> None:
    # A name that already is one keeps the documented form; others are made one, and
    # the exact name's hash keeps two volumes that read alike apart.
    assert volume_claim(SETTINGS.instance, "data") == f"sl-{SETTINGS.instance[:8]}-vol-data"
    odd = [volume_claim(SETTINGS.instance, v) for v in ("Data_1", "data-1", "DATA_1", "_")]
    assert len(set(odd)) == 4
    for name in odd:
        assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) and len(name) <= 63

"""What the ``kubernetes`` provider asks the cluster for: the manifests of a sandbox's
pod, its trust ConfigMap, its workspace claim and the instance's NetworkPolicies, the
names of those objects, and the reason a pod failed (plain data: no client calls).

A failed sandbox's reason starts with a code (``OOM: …``), the same in its ``failed``
phase events and in the ``metadata.reason`` of the 503 its relay answers:

- ``OOM``: the sandbox's main process (its dataplane) was killed out of memory;
- ``EVICTED``: the node evicted the pod (its resources ran short);
- ``IMAGE``: the image cannot be had (``ErrImagePull``, ``ImagePullBackOff``,
  ``ErrImageNeverPull``, ``InvalidImageName``);
- ``START``: the container cannot start (``CreateContainerConfigError``, …);
- ``EXITED``: the main process ended otherwise (killed, crashed);
- ``DELETED``: the pod was deleted behind the provider's back;
- ``TIMEOUT``: the pod was not serving within the start timeout.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandlot.protocol.errors import InvalidRequest
from sandlot.protocol.sessions import NetworkMode, Template
from sandlot.providers.base import SandboxSpec

LABEL_SANDBOX = "sandlot.sandbox"
LABEL_GENERATION = "sandlot.generation"
LABEL_INSTANCE = "sandlot.instance"
#: The warm pool an unclaimed pod waits in (:mod:`sandlot.providers.k8spool`).
LABEL_POOL = "sandlot.pool"
#: The pool a claimed pod came from.
LABEL_CLAIMED = "sandlot.claimed-from"
#: ``deny`` on pods whose template has no network (the egress policy selects them).
LABEL_EGRESS = "sandlot.egress"
ANNOTATION_SANDBOX = "sandlot/sandbox-id"
#: What the pod was made from, for another broker replica (:mod:`sandlot.providers.k8speers`).
ANNOTATION_SPEC = "sandlot/spec"
TRUST_MOUNT = "/run/sandlot-trust"
WORKSPACE = "/workspace"
CONTAINER = "dataplane"

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
#: A DNS-1123 label short enough to end a claim's name.
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")

#: Where the dataplane keeps its event log on a ``pvc`` workspace's claim (a sub-directory
#: of the claim beside the workspace's), so a pod made again on it carries on the sequence.
STATE_MOUNT = "/var/lib/sandlot-dataplane"

#: Waiting reasons after which a pod will not start without someone's help, by code.
WAITING_FAILURES = {
    "ErrImagePull": "IMAGE",
    "ImagePullBackOff": "IMAGE",
    "ErrImageNeverPull": "IMAGE",
    "InvalidImageName": "IMAGE",
    "CreateContainerConfigError": "START",
    "CreateContainerError": "START",
    "RunContainerError": "START",
    "CrashLoopBackOff": "START",
}
FAILURE_CODES = frozenset(
    {"OOM", "EVICTED", "IMAGE", "START", "EXITED", "DELETED", "TIMEOUT", "VOLUME"}
)


def failure_code(reason: str | None) -> str | None:
    """The code a failed sandbox's reason starts with (``OOM``), if any."""
    code = (reason or "").partition(":")[0]
    return code if code in FAILURE_CODES else None


@dataclass(frozen=True)
class PodSettings:
    """The provider's configuration that shapes its objects."""

    instance: str
    issuer: str
    image: str = "sandlot-sandbox"
    images: Mapping[str, str] = field(default_factory=dict)
    image_pull_policy: str = "IfNotPresent"
    uid: int = 1000
    gid: int = 1000
    python: str = "python3"
    pythonpath: str = "/opt/sandlot/lib"
    port: int = 8080
    requests_fraction: float = 1.0
    workspace: str = "emptyDir"
    storage_class: str | None = None
    workspace_size_mb: int = 1024
    tmp_mb: int = 256
    read_only_root: bool = True
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: list[Any] = field(default_factory=list)
    runtime_class: str | None = None

    def image_for(self, template: Template) -> str:
        if template.name in self.images:
            return self.images[template.name]
        if template.image == "host" or template.image.startswith("/"):
            return self.image
        return template.image


def object_name(instance: str, sandbox_id: str, suffix: str = "") -> str:
    """A DNS-1123 name for one of the sandbox's objects: readable, and unique per id (a
    hash of the exact id keeps ``sb_A`` and ``sb_a`` apart)."""
    readable = re.sub(r"[^a-z0-9-]", "-", sandbox_id.lower()).strip("-")[:32].strip("-")
    digest = hashlib.sha256(sandbox_id.encode()).hexdigest()[:8]
    name = f"sl-{instance[:8]}-{readable}-{digest}" if readable else f"sl-{instance[:8]}-{digest}"
    return f"{name}-{suffix}" if suffix else name


def volume_claim(instance: str, volume: str) -> str:
    """The claim a named volume is mounted from: ``sl-{instance}-vol-{volume}`` when the
    volume's name is a DNS-1123 name already; else readable and a hash of the exact name
    (a claim's name holds no capital or ``_``, which a volume's may)."""
    if _DNS_LABEL.match(volume):
        return f"sl-{instance[:8]}-vol-{volume}"
    readable = re.sub(r"[^a-z0-9-]", "-", volume.lower()).strip("-")[:32].strip("-")
    digest = hashlib.sha256(volume.encode()).hexdigest()[:8]
    base = f"sl-{instance[:8]}-vol"
    return f"{base}-{readable}-{digest}" if readable else f"{base}-{digest}"


def pool_label(pool: str) -> str:
    """The label value of a pool's name (a hash for a name that is not a label value)."""
    if _LABEL_VALUE.match(pool):
        return pool
    return "h" + hashlib.sha256(pool.encode()).hexdigest()[:40]


def labels(settings: PodSettings, spec: SandboxSpec) -> dict[str, str]:
    if not _LABEL_VALUE.match(spec.sandbox_id):
        raise InvalidRequest("a kubernetes sandbox id is at most 63 letters, digits, '_.-'")
    return {
        LABEL_SANDBOX: spec.sandbox_id,
        LABEL_GENERATION: str(spec.generation),
        LABEL_INSTANCE: settings.instance,
    }


def _quantities(settings: PodSettings, template: Template) -> dict[str, dict[str, str]]:
    res = template.resources
    cpu_m = max(1, round(res.cpu * 1000))
    mem = res.memory_mb
    fraction = min(max(settings.requests_fraction, 0.0), 1.0)
    return {
        "limits": {"cpu": f"{cpu_m}m", "memory": f"{mem}Mi"},
        "requests": {
            "cpu": f"{max(1, round(cpu_m * fraction))}m",
            "memory": f"{max(1, round(mem * fraction))}Mi",
        },
    }


def pod_manifest(settings: PodSettings, spec: SandboxSpec) -> dict[str, Any]:
    sid, template = spec.sandbox_id, spec.template
    inst = settings.instance
    command = [
        settings.python,
        # Nothing of the workspace on the dataplane's import path (docker.py says why).
        "-s",
        "-P",
        "-m",
        "sandlot.dataplane",
        "--sandbox-id",
        sid,
        "--generation",
        str(spec.generation),
        "--issuer",
        settings.issuer,
        "--trust-dir",
        TRUST_MOUNT,
        "--host",
        "0.0.0.0",
        "--port",
        str(settings.port),
        "--workspace",
        WORKSPACE,
        "--shells",
        json.dumps(template.shells),
    ]
    workspace: dict[str, Any]
    pvc = settings.workspace == "pvc"
    if pvc:
        workspace = {"persistentVolumeClaim": {"claimName": object_name(inst, sid, "workspace")}}
        command += ["--state-dir", STATE_MOUNT]
    else:
        workspace = {"emptyDir": {}}
        if template.resources.disk_mb:
            workspace["emptyDir"]["sizeLimit"] = f"{template.resources.disk_mb}Mi"
    volumes: list[dict[str, Any]] = [
        {"name": "workspace", **workspace},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": f"{settings.tmp_mb}Mi"}},
        {
            "name": "trust",
            "configMap": {"name": object_name(inst, sid, "trust"), "defaultMode": 0o444},
        },
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "workspace", "mountPath": WORKSPACE},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "trust", "mountPath": TRUST_MOUNT, "readOnly": True},
    ]
    if pvc:
        # The claim holds the workspace and, beside it, the dataplane's event log.
        mounts[0]["subPath"] = "workspace"
        mounts.append({"name": "workspace", "mountPath": STATE_MOUNT, "subPath": "dataplane"})
    for i, vm in enumerate(template.volume_mounts):
        name = f"vol-{i}"
        claim = volume_claim(inst, vm.volume)
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": vm.read_only}}
        )
        mounts.append({"name": name, "mountPath": vm.path, "readOnly": vm.read_only})
    pod_labels = labels(settings, spec)
    pod_labels[LABEL_EGRESS] = "deny" if template.network is NetworkMode.NONE else "allow"
    if spec.pool is not None:
        pod_labels[LABEL_POOL] = pool_label(spec.pool)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The dataplane is its container's PID 1, the one process of the sandbox its
        # commands cannot stop, and collects their orphans (sandlot.dataplane.standalone).
        # It heeds no SIGTERM: the kubelet stops it with SIGKILL once the grace is over.
        "terminationGracePeriodSeconds": 5,
        "hostname": "sandbox",
        "securityContext": {
            "runAsUser": settings.uid,
            "runAsGroup": settings.gid,
            "fsGroup": settings.gid,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": CONTAINER,
                "image": settings.image_for(template),
                "imagePullPolicy": settings.image_pull_policy,
                "command": command,
                # The dataplane's own; commands get only the template's (DirectRuntime).
                "env": [
                    {"name": "PYTHONPATH", "value": settings.pythonpath},
                    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                ],
                "workingDir": WORKSPACE,
                "ports": [{"name": "dataplane", "containerPort": settings.port}],
                "resources": _quantities(settings, template),
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": settings.read_only_root,
                    "runAsNonRoot": True,
                },
                "readinessProbe": {
                    "httpGet": {"path": "/__control/ready", "port": settings.port},
                    "periodSeconds": 2,
                    "timeoutSeconds": 2,
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = list(settings.tolerations)
    if settings.runtime_class:
        pod_spec["runtimeClassName"] = settings.runtime_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": object_name(inst, sid),
            "labels": pod_labels,
            "annotations": {ANNOTATION_SANDBOX: sid, ANNOTATION_SPEC: spec_annotation(spec)},
        },
        "spec": pod_spec,
    }


def spec_annotation(spec: SandboxSpec) -> str:
    """What another replica needs to serve the sandbox as its own (no secret: the pod's
    own spec carries the template's environment already)."""
    return json.dumps(
        {
            "template": spec.template.model_dump(mode="json"),
            "volumes": dict(spec.volumes),
            "provider": spec.provider,
            "owner": spec.owner_user_id,
            "name": spec.name,
        },
        sort_keys=True,
    )


def trust_manifest(
    settings: PodSettings,
    spec: SandboxSpec,
    jwks_text: str,
    control_key: str = "",
    revoked: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ConfigMap mounted read-only at the dataplane's trust directory; ``control_key``
    is the secret the provider presents to push revocations to the dataplane; ``revoked``
    the ``revoked.json`` document (none revoked by default)."""
    data = {"jwks.json": jwks_text, "revoked.json": json.dumps(revoked or {"revoked": []})}
    if control_key:
        data["control.key"] = control_key
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": object_name(settings.instance, spec.sandbox_id, "trust"),
            "labels": labels(settings, spec),
        },
        "data": data,
    }


def claim_manifest(settings: PodSettings, spec: SandboxSpec) -> dict[str, Any]:
    """The workspace's PersistentVolumeClaim (``workspace = "pvc"``)."""
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": f"{settings.workspace_size_mb}Mi"}},
    }
    if settings.storage_class:
        claim["storageClassName"] = settings.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": object_name(settings.instance, spec.sandbox_id, "workspace"),
            "labels": labels(settings, spec),
        },
        "spec": claim,
    }


def network_policy_manifests(settings: PodSettings) -> list[dict[str, Any]]:
    """The instance's policies: its pods admit connections to the dataplane's port only,
    and those without network (``sandlot.egress=deny``) send nothing."""
    inst = settings.instance
    meta_labels = {LABEL_INSTANCE: inst}
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"sandlot-{inst[:8]}-ingress", "labels": meta_labels},
            "spec": {
                "podSelector": {"matchLabels": {LABEL_INSTANCE: inst}},
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"protocol": "TCP", "port": settings.port}]}],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"sandlot-{inst[:8]}-no-egress", "labels": meta_labels},
            "spec": {
                "podSelector": {"matchLabels": {LABEL_INSTANCE: inst, LABEL_EGRESS: "deny"}},
                "policyTypes": ["Egress"],
                "egress": [],
            },
        },
    ]


def _said(reason: str, message: str | None) -> str:
    return f"{reason}: {message}" if message else reason


def pod_failure(pod: Any) -> str | None:
    """Why the pod will not serve its sandbox, its code first (``OOM: the sandbox ran out
    of memory (OOMKilled, exit code 137)``, ``EVICTED: …``, ``IMAGE: ErrImageNeverPull:
    …``), or ``None`` while it may."""
    status = pod.status
    if status is None:
        return None
    if status.phase == "Failed" and status.reason:  # the pod's own: Evicted, …
        code = "EVICTED" if status.reason == "Evicted" else "EXITED"
        return f"{code}: {_said(str(status.reason), status.message)}"
    for cs in status.container_statuses or []:
        state = cs.state
        if state is None:
            continue
        if state.terminated is not None:
            t = state.terminated
            said = f"{t.reason or 'Terminated'}, exit code {t.exit_code}"
            if t.reason == "OOMKilled":
                return f"OOM: the sandbox ran out of memory ({said})"
            return f"EXITED: the sandbox's main process ended ({said})"
        if state.waiting is not None and state.waiting.reason in WAITING_FAILURES:
            w = state.waiting
            return f"{WAITING_FAILURES[w.reason]}: {_said(w.reason, w.message)}"
    if status.phase in ("Failed", "Succeeded"):
        return f"EXITED: {_said(str(status.reason or status.phase), status.message)}"
    return None


__all__ = [
    "LABEL_EGRESS",
    "LABEL_GENERATION",
    "LABEL_INSTANCE",
    "LABEL_SANDBOX",
    "STATE_MOUNT",
    "PodSettings",
    "claim_manifest",
    "failure_code",
    "network_policy_manifests",
    "object_name",
    "pod_failure",
    "pod_manifest",
    "trust_manifest",
    "volume_claim",
]

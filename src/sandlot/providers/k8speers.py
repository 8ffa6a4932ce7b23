"""Pods of the instance that another broker replica made: known from the watch, adopted
when this replica is asked about them.

Replicas on one store share the ``kubernetes`` provider's instance (the label
``sandlot.instance``, a row of the store: :mod:`sandlot.broker.identities`), so each one's
watch sees every pod of the deployment. A pod this replica neither made nor re-adopted is
kept here as the watch last saw it; when a request names its sandbox (a claim from a warm
pool, the relay, a status or activity read, a revocation) and the pod runs, this
replica adopts it as the replicas re-adopt each other's pods at start: a record of the
sandbox, ``active`` (the store lists only sandboxes whose pod's dataplane answered), its
upstream the pod's address. The sandbox's spec comes from the pod itself: its
annotation ``sandlot/spec`` (the template, volumes and provider the pod was made from),
so that suspend and resume work wherever the sandbox is served.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import AdoptionRecord, SandboxSpec
from sandlot.providers.k8spool import pool_of
from sandlot.providers.podspec import ANNOTATION_SPEC, LABEL_GENERATION, LABEL_SANDBOX, pod_failure
from sandlot.providers.socketrelay import TcpUpstream


def spec_of(pod: Any, pool: str | None) -> SandboxSpec | None:
    """The spec a pod was made from (None: a pod of a version before the annotation)."""
    labels = pod.metadata.labels or {}
    raw = (pod.metadata.annotations or {}).get(ANNOTATION_SPEC)
    try:
        doc = json.loads(raw) if raw else None
        if not isinstance(doc, dict):
            return None
        return SandboxSpec(
            sandbox_id=str(labels[LABEL_SANDBOX]),
            generation=int(labels[LABEL_GENERATION]),
            template=Template.model_validate(doc["template"]),
            owner_user_id=doc.get("owner"),
            name=doc.get("name"),
            volumes=dict(doc.get("volumes") or {}),
            provider=doc.get("provider"),
            pool=pool,
        )
    except (ValueError, KeyError, TypeError):
        return None


class PodBox(Protocol):
    reason: str | None
    pod_ip: str | None
    pod_uid: str | None
    pod: Any
    upstream: Any
    settled: Any


BoxT = TypeVar("BoxT", bound=PodBox)


def peer_box(
    pod: Any, box_type: Callable[[SandboxSpec, SandboxState], BoxT], port: int
) -> BoxT | None:
    """The record of another replica's running pod, as this replica serves it."""
    spec = spec_of(pod, pool_of(pod))
    if spec is None:
        return None
    box = box_type(spec, SandboxState.ACTIVE)
    box.reason = "adopted from another replica"
    box.pod_ip, box.pod_uid, box.pod = pod.status.pod_ip, pod.metadata.uid, pod
    box.upstream = TcpUpstream(pod.status.pod_ip, port)
    box.settled.set()
    return box


def starting_box(
    rec: AdoptionRecord, pod: Any, box_type: Callable[[SandboxSpec, SandboxState], BoxT]
) -> BoxT | None:
    """The record of a provisioning sandbox whose pod exists (None: no such pod, or one
    of another generation, being deleted or failed)."""
    if (
        pod is None
        or pod.metadata.deletion_timestamp is not None
        or (pod.metadata.labels or {}).get(LABEL_GENERATION) != str(rec.generation)
        or pod_failure(pod) is not None
    ):
        return None
    spec = SandboxSpec(rec.sandbox_id, rec.generation, rec.template, pool=rec.pool)
    box = box_type(spec, SandboxState.PROVISIONING)
    box.pod_uid, box.pod = pod.metadata.uid, pod
    return box


class PeerPods:
    """The latest copy of each pod of the instance this replica has no record of."""

    def __init__(self) -> None:
        self._pods: dict[str, Any] = {}

    def saw(self, kind: str, sandbox_id: str, pod: Any) -> None:
        if kind == "DELETED":
            seen = self._pods.get(sandbox_id)
            if seen is not None and seen.metadata.uid == pod.metadata.uid:
                del self._pods[sandbox_id]
            return
        self._pods[sandbox_id] = pod

    def forget(self, sandbox_id: str) -> None:
        self._pods.pop(sandbox_id, None)

    def serving(self, sandbox_id: str) -> Any | None:
        """The sandbox's pod if it runs, has an address and is not being deleted."""
        pod = self._pods.get(sandbox_id)
        if (
            pod is None
            or pod.metadata.deletion_timestamp is not None
            or pod.status is None
            or pod.status.phase != "Running"
            or not pod.status.pod_ip
            or pod_failure(pod) is not None
        ):
            return None
        return pod


__all__ = ["PeerPods", "peer_box", "spec_of", "starting_box"]

"""Sandboxes as agent-sandbox ``Sandbox`` resources (kubernetes-sigs/agent-sandbox), where
that project's CRDs are installed.

The ``kubernetes`` provider makes each sandbox a bare pod by default. With
``agent_sandbox = "auto"`` it asks the API server's discovery whether the group
``agents.x-k8s.io`` serves ``sandboxes`` (:func:`detect`); if it does, each sandbox is a
``Sandbox`` whose ``spec.podTemplate`` is the pod the provider would have made (its
labels, annotations and spec: :func:`sandbox_manifest`), and agent-sandbox's controller
makes the pod, named after the ``Sandbox`` and owned by it. ``agent_sandbox = "on"``
requires the CRD (the provider does not start without it); ``"off"`` (the default) never
looks. Nothing else changes: the provider watches the pod by its labels as it watches
its own pods, reaches its dataplane on the pod's address, and deletes the ``Sandbox``
(the cluster's garbage collector then deletes the pod it owns).

The controller is what makes the pods: a cluster with the CRDs but without the
controller would leave every sandbox ``provisioning`` until its start timeout. Suspend
(``pvc`` workspaces) scales the ``Sandbox`` to ``replicas: 0`` and deletes its pod, keeping
the claim; resume sets ``replicas: 1`` with the pod template of the new start, and the
controller makes the pod again on the same claim.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

GROUP = "agents.x-k8s.io"
PLURAL = "sandboxes"
KIND = "Sandbox"
#: The versions this provider writes, most preferred first.
VERSIONS = ("v1alpha1", "v1beta1")
MODES = ("off", "auto", "on")

k8s: Any = kubernetes.client


def _served(api_client: Any) -> str | None:
    """The version of ``agents.x-k8s.io`` that serves ``sandboxes`` (blocking)."""
    try:
        groups = k8s.ApisApi(api_client).get_api_versions()
    except ApiException:
        return None
    found = [g for g in groups.groups or [] if g.name == GROUP]
    if not found:
        return None
    versions = [v.version for v in found[0].versions or []]
    custom = k8s.CustomObjectsApi(api_client)
    for version in [v for v in VERSIONS if v in versions]:
        try:
            resources = custom.get_api_resources(GROUP, version)
        except ApiException:
            continue
        if any(r.name == PLURAL for r in resources.resources or []):
            return str(version)
    return None


async def detect(api_client: Any) -> str | None:
    """Whether the ``Sandbox`` CRD is installed: the version to write, or ``None``."""
    return await asyncio.to_thread(_served, api_client)


def sandbox_manifest(version: str, pod: Mapping[str, Any]) -> dict[str, Any]:
    """A ``Sandbox`` whose controller makes ``pod`` (same name, labels and spec)."""
    meta = pod["metadata"]
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": KIND,
        "metadata": {
            "name": meta["name"],
            "labels": dict(meta.get("labels", {})),
            "annotations": dict(meta.get("annotations", {})),
        },
        "spec": {
            "podTemplate": {
                "metadata": {
                    "labels": dict(meta.get("labels", {})),
                    "annotations": dict(meta.get("annotations", {})),
                },
                "spec": pod["spec"],
            },
            "replicas": 1,
        },
    }


class SandboxResources:
    """The calls the provider makes on ``Sandbox`` resources of one namespace (blocking;
    the provider runs them off its event loop)."""

    def __init__(self, api_client: Any, namespace: str, version: str) -> None:
        self.api = k8s.CustomObjectsApi(api_client)
        self.namespace = namespace
        self.version = version

    def create(self, body: Mapping[str, Any]) -> Any:
        return self.api.create_namespaced_custom_object(
            GROUP, self.version, self.namespace, PLURAL, dict(body)
        )

    def read(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.api.get_namespaced_custom_object(
            GROUP, self.version, self.namespace, PLURAL, name
        )
        return found

    def patch_spec(self, name: str, spec: Mapping[str, Any]) -> Any:
        """Merge ``spec`` into the resource's (``replicas``, ``podTemplate``)."""
        return self.api.patch_namespaced_custom_object(
            GROUP, self.version, self.namespace, PLURAL, name, {"spec": dict(spec)}
        )

    def delete(self, name: str) -> Any:
        return self.api.delete_namespaced_custom_object(
            GROUP, self.version, self.namespace, PLURAL, name, propagation_policy="Background"
        )

    def labelled(self, selector: str) -> list[dict[str, Any]]:
        found = self.api.list_namespaced_custom_object(
            GROUP, self.version, self.namespace, PLURAL, label_selector=selector
        )
        return list(found.get("items", []))


__all__ = ["GROUP", "KIND", "MODES", "PLURAL", "SandboxResources", "detect", "sandbox_manifest"]

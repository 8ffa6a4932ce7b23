"""Warm pools of the ``kubernetes`` provider: ready pods that carry a pool label, claimed
by a label update that names the pod's resourceVersion.

A sandbox the broker makes for a pool (``SandboxSpec.pool``) is a pod like any other,
labelled ``sandlot.pool=<pool>``: its dataplane started and answered before the sandbox
became ``active``, so a claim hands out a pod that is ready now. Claiming it replaces the
pool label with ``sandlot.claimed-from=<pool>`` in one patch that carries the
resourceVersion the claimer saw: the API server applies it only if the pod did not
change since (else ``409 Conflict``), so of two claimers — two concurrent ``ensure``
calls, or two brokers on one store — exactly one takes the pod, and the other tries the
next. A claim whose binding did not happen (another ``ensure`` of the same thread bound
first) is given back by restoring the pool label. After a restart the broker's store is
the authority: :func:`reconcile` makes a re-adopted pod's labels say what the store says.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from sandlot.protocol.errors import ProviderUnavailable
from sandlot.providers.podspec import LABEL_CLAIMED, LABEL_POOL, pool_label

log = logging.getLogger("sandlot.providers.kubernetes")

#: One blocking client call run off the event loop (the provider's ``_api``).
ApiCall = Callable[..., Awaitable[Any]]


def pool_of(pod: Any) -> str | None:
    """The pool label of a pod (None: claimed, or never in a pool)."""
    value = (pod.metadata.labels or {}).get(LABEL_POOL)
    return str(value) if value else None


def claim_patch(resource_version: str | None, pool: str) -> dict[str, Any]:
    """The pool label removed, the claim recorded; with ``resource_version`` the patch is
    refused (409) if the pod changed since that version."""
    meta: dict[str, Any] = {"labels": {LABEL_POOL: None, LABEL_CLAIMED: pool}}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"metadata": meta}


def release_patch(pool: str) -> dict[str, Any]:
    return {"metadata": {"labels": {LABEL_POOL: pool_label(pool), LABEL_CLAIMED: None}}}


class PodClaims:
    """Claims and releases of one provider's pool pods (see the module)."""

    def __init__(self, api: ApiCall, core: Callable[[], Any], namespace: str) -> None:
        self._api = api
        self._core = core
        self.namespace = namespace

    def _patch(self, pod_name: str, body: dict[str, Any]) -> None:
        """One patch (blocking); the pod it answers is not parsed into the client's
        models, which costs more than the call itself on a busy machine."""
        resp = self._core().patch_namespaced_pod(
            pod_name, self.namespace, body, _preload_content=False
        )
        try:
            resp.read()
        finally:
            resp.release_conn()

    async def _read(self, pod_name: str) -> Any | None:
        try:
            return await self._api(self._core().read_namespaced_pod, pod_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def claim(self, pod_name: str, seen: Any | None) -> bool:
        """Take the pool pod ``pod_name``; False if it is claimed, gone or changed under
        the claim. ``seen``: its latest copy from the watch, which spares a read; a copy
        that may be stale (refused with 409, or showing the pod claimed) costs one read."""
        pod, fresh = (seen, False) if seen is not None else (await self._read(pod_name), True)
        while pod is not None and pod.metadata.deletion_timestamp is None:
            pool = (pod.metadata.labels or {}).get(LABEL_POOL)
            if pool:
                body = claim_patch(pod.metadata.resource_version, str(pool))
                try:
                    await self._api(self._patch, pod_name, body)
                    return True
                except ApiException as exc:
                    if exc.status not in (404, 409):
                        raise
                    if exc.status == 404:
                        return False
            if fresh:
                return False
            pod, fresh = await self._read(pod_name), True
        return False

    async def release(self, pod_name: str, pool: str) -> None:
        """Put the pool label back (the pod was claimed for a binding that did not happen)."""
        try:
            await self._api(self._patch, pod_name, release_patch(pool))
        except (ApiException, ProviderUnavailable) as exc:
            log.warning("giving pod %s back to pool %s failed: %s", pod_name, pool, exc)

    async def reconcile(self, pod: Any, pool: str | None) -> None:
        """Make a re-adopted pod's labels say what the store says: in ``pool`` (a claim
        whose binding a crash cut short), or claimed (None)."""
        labelled = pool_of(pod)
        name = pod.metadata.name
        if pool is not None and labelled != pool_label(pool):
            await self.release(name, pool)
        elif pool is None and labelled is not None:
            try:
                await self._api(self._patch, name, claim_patch(None, labelled))
            except (ApiException, ProviderUnavailable) as exc:
                log.warning("marking pod %s claimed failed: %s", name, exc)


__all__ = ["PodClaims", "claim_patch", "pool_of", "release_patch"]

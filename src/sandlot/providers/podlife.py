"""Suspend and resume of the ``kubernetes`` provider's sandboxes (``workspace = "pvc"``).

Kubernetes cannot freeze a pod, so a suspended sandbox is one whose pod is gone while its
workspace claim and its trust ConfigMap stay: **suspend** reads the dataplane's last event
sequence, deletes the pod (its processes end, as on a machine's power-off: the dataplane
heeds no SIGTERM, so the kubelet kills it once the grace period is over) and waits until
it is gone, so nothing writes to the claim any more (a pod still there after a minute is
deleted at once, without grace).
**resume** makes the pod again on the same claim, with the revocations
the sandbox had (the ConfigMap written again with them and a new control key), and
returns once its dataplane answers (``active``) or the pod failed (``failed``): the files
are those of the suspend, and the event log carries on its sequence (the dataplane keeps
it on the claim, beside the workspace). A server restarted meanwhile re-adopts the
suspended sandbox from its record (:func:`adopt_suspended`); there is no pod to look for.

With an ``emptyDir`` workspace nothing would survive: the provider does not suspend, and
the broker deletes idle sandboxes instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from kubernetes.client.exceptions import ApiException

from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import AdoptionRecord, ProviderStatus, SandboxSpec
from sandlot.providers.podspec import PodSettings, object_name


class PodBox(Protocol):
    """What suspend and resume change of the provider's record of a sandbox."""

    spec: SandboxSpec
    state: SandboxState
    reason: str | None
    pod_uid: str | None
    stale_uids: set[str]
    probing: asyncio.Task[None] | None
    reloading: asyncio.Task[None] | None
    upstream: Any
    settled: asyncio.Event


class PodProvider(Protocol):
    """What suspend and resume use of the ``kubernetes`` provider."""

    namespace: str
    instance: str

    @property
    def settings(self) -> PodSettings: ...
    @property
    def _core(self) -> Any: ...
    @property
    def _sandboxes(self) -> Mapping[str, PodBox]: ...
    @property
    def _tasks(self) -> dict[str, asyncio.Task[None]]: ...
    def can_suspend(self, sandbox_id: str) -> bool: ...
    def _box(self, sandbox_id: str) -> PodBox: ...
    async def status(self, sandbox_id: str) -> ProviderStatus: ...
    async def _api(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
    async def _wait_gone(self, pod_name: str, timeout: float = 60.0) -> bool: ...
    async def _notify(self, sandbox_id: str) -> None: ...
    async def _create(self, spec: SandboxSpec) -> None: ...


BoxT = TypeVar("BoxT", bound=PodBox)

#: Seconds the kubelet waits after its SIGTERM before it kills a suspended pod's
#: processes: the least it takes (the dataplane heeds no SIGTERM, nothing is lost by a
#: kill: its event log is written as events happen), more than nought, which would remove
#: the pod from the API before the kubelet stopped it.
SUSPEND_GRACE_SECONDS = 1
#: How long suspend waits for the kubelet to stop the pod before deleting it at once.
SUSPEND_WAIT_SECONDS = 60.0


async def suspend(provider: PodProvider, sandbox_id: str) -> ProviderStatus:
    """Delete the pod of an active sandbox, keeping its claim (idempotent)."""
    if not provider.can_suspend(sandbox_id):
        raise InvalidRequest("only sandboxes with a pvc workspace can be suspended")
    box = provider._box(sandbox_id)
    if box.state is not SandboxState.ACTIVE:
        return await provider.status(sandbox_id)
    await provider.status(sandbox_id)  # the last event sequence, kept while suspended
    box.state, box.reason = SandboxState.SUSPENDED, "suspended"
    # Whatever the watch still says of this pod is old news.
    if box.pod_uid is not None:
        box.stale_uids.add(box.pod_uid)
    box.pod_uid = None
    for pending in (box.probing, box.reloading):
        if pending is not None:
            pending.cancel()
    box.probing = box.reloading = None
    if box.upstream is not None:
        await box.upstream.close()
        box.upstream = None
    pod_name = object_name(provider.instance, sandbox_id)
    for grace in (SUSPEND_GRACE_SECONDS, 0):
        with contextlib.suppress(ApiException):
            await provider._api(
                provider._core.delete_namespaced_pod,
                pod_name,
                provider.namespace,
                grace_period_seconds=grace,
            )
        # A kubelet too busy to stop it within a minute: the pod is deleted at once.
        if await provider._wait_gone(pod_name, SUSPEND_WAIT_SECONDS):
            break
    await provider._notify(sandbox_id)
    return await provider.status(sandbox_id)


async def resume(provider: PodProvider, sandbox_id: str) -> ProviderStatus:
    """Make a suspended sandbox's pod again on its claim; return once it serves or failed."""
    box = provider._box(sandbox_id)
    if box.state is not SandboxState.SUSPENDED:
        return await provider.status(sandbox_id)
    box.state, box.reason = SandboxState.PROVISIONING, "resuming"
    box.settled = asyncio.Event()
    task = asyncio.get_running_loop().create_task(provider._create(box.spec))
    provider._tasks[sandbox_id] = task
    task.add_done_callback(lambda _t: provider._tasks.pop(sandbox_id, None))
    # A delete meanwhile cancels the task: the wait ends either way.
    await asyncio.wait({task})
    if provider._sandboxes.get(sandbox_id) is not box:
        raise ProviderUnavailable("the sandbox was deleted while it resumed")
    return await provider.status(sandbox_id)


def adopt_suspended(
    provider: PodProvider,
    rec: AdoptionRecord,
    box_type: Callable[[SandboxSpec, SandboxState], BoxT],
) -> BoxT | None:
    """The record of a sandbox a previous server suspended (``None``: it cannot be, the
    workspace being no claim)."""
    if rec.state is not SandboxState.SUSPENDED or provider.settings.workspace != "pvc":
        return None
    box = box_type(SandboxSpec(rec.sandbox_id, rec.generation, rec.template), rec.state)
    box.reason = "suspended"
    box.settled.set()
    return box


def revoked_doc(revoked: dict[str, float]) -> dict[str, Any]:
    """The ``revoked.json`` document of a sandbox's revocations."""
    return {"revoked": [{"jti": j, "expires_at": e} for j, e in revoked.items()]}


__all__ = ["PodBox", "PodProvider", "adopt_suspended", "resume", "revoked_doc", "suspend"]

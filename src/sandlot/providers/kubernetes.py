"""The ``kubernetes`` provider: a sandbox is a pod, driven with the official ``kubernetes``
client.

Each sandbox is one pod of its template's image (:mod:`sandlot.providers.podspec` builds
it): the template's cpu and memory as limits, an unprivileged user (``runAsNonRoot``),
every capability dropped, no privilege escalation, ``seccompProfile: RuntimeDefault``, no
service-account token, a read-only root filesystem with a private ``/tmp``, and the
workspace on an ``emptyDir`` (or a PersistentVolumeClaim that outlives the pod). Its main
container runs the dataplane in its standalone mode (``python -m sandlot.dataplane``) on
the pod's address; the dataplane verifies the broker's tokens itself, from a per-sandbox
ConfigMap (``jwks.json``, ``revoked.json``, ``control.key``) mounted read-only. A
NetworkPolicy of the provider's instance denies egress to sandboxes whose template has no
network, and admits ingress only to the dataplane's port.

Clients reach a sandbox through the server's relay at ``/dp`` (as with ``docker``):
:attr:`KubernetesProvider.app` forwards ``/{sandbox_id}/v1/…`` to the pod's address.

State comes from a watch on the instance's pods (a thread: the client's stream blocks),
resumed from the last resourceVersion when it drops and re-listed when that version is
too old (410). A pod that is running and whose dataplane answers makes its sandbox
``active``; one that fails (its dataplane killed, ``OOMKilled``, ``Evicted``, an image it
cannot get: ``ErrImagePull``, ``ImagePullBackOff``, ``ErrImageNeverPull``) or is deleted
behind the provider's back fails it with the pod's reason. Pods carry the labels
``sandlot.sandbox``, ``sandlot.generation`` and ``sandlot.instance``: a restarted broker
re-adopts them by label (:meth:`KubernetesProvider.load_state`) and deletes the pods,
ConfigMaps and claims of its instance that no live sandbox owns.

Config keys (``[provider]``; ``data_dir``, ``public_url``, ``issuer`` and ``jwks`` are
wired in by the server):

- ``kubeconfig``: a kubeconfig file (default: ``$KUBECONFIG``, then ``~/.kube/config``);
  ``context``: one of its contexts; ``in_cluster``: true to use the pod's service
  account (the broker runs in the cluster).
- ``namespace``: where sandboxes go (default ``default``).
- ``image``, ``images``: as for ``docker`` (default ``sandlot-sandbox``).
- ``image_pull_policy``: ``IfNotPresent`` (default), ``Always`` or ``Never``.
- ``user``: ``uid:gid`` (default ``1000:1000``; never 0).
- ``python``, ``pythonpath``: where sandlot is in the image (as for ``docker``).
- ``port``: the dataplane's port in the pod (default 8080).
- ``requests_fraction``: requests as a fraction of the limits (default 1.0: the pod is
  ``Guaranteed``; lower packs more sandboxes on a node).
- ``workspace``: ``emptyDir`` (default) or ``pvc``; ``storage_class``,
  ``workspace_size_mb`` (default 1024) for claims; ``keep_volumes``: keep claims when
  sandboxes are deleted. With ``pvc`` sandboxes can be suspended: the pod is deleted,
  the claim kept, and resume makes the pod again on it (:mod:`~sandlot.providers.podlife`).
- ``tmp_mb``: size of ``/tmp`` (default 256); ``read_only_root`` (default true).
- ``network_policy``: create the instance's NetworkPolicy (default true).
- ``node_selector``, ``tolerations``, ``runtime_class``: passed to the pod.
- ``agent_sandbox``: ``off`` (default), ``auto`` (a ``Sandbox`` resource of
  kubernetes-sigs/agent-sandbox instead of a bare pod where its CRD is installed) or ``on``
  (required): :mod:`~sandlot.providers.agentsandbox`.
- ``start_timeout_seconds`` (default 120), ``jwks_refresh_seconds`` (default 2).
- ``revocation_sync_seconds``: how long after a revocation whose push failed the
  dataplane is asked, every second, to re-read its trust directory (default 90: the
  kubelet's ConfigMap sync).

Revocations are pushed to the pod's dataplane (``POST /__control/revoke`` on the same
address the relay uses, with the sandbox's ``control.key``): they hold there at once. The
ConfigMap keeps the list for a dataplane that starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import kubernetes.client
import kubernetes.config
import kubernetes.watch
from kubernetes.client.exceptions import ApiException

from sandlot.protocol.errors import (
    InvalidRequest,
    ProviderUnavailable,
    SandboxNotFound,
)
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers import agentsandbox, podlife
from sandlot.providers.base import (
    AdoptionRecord,
    ProviderStatus,
    SandboxSpec,
    StatusListener,
)
from sandlot.providers.inbox import InboxProvider, InboxSandbox, JwksSource
from sandlot.providers.k8speers import PeerPods, peer_box, starting_box
from sandlot.providers.k8spool import PodClaims
from sandlot.providers.podspec import (
    LABEL_GENERATION,
    LABEL_INSTANCE,
    LABEL_SANDBOX,
    PodSettings,
    claim_manifest,
    failure_code,
    network_policy_manifests,
    object_name,
    pod_failure,
    pod_manifest,
    trust_manifest,
    volume_claim,
)
from sandlot.providers.socketrelay import TcpUpstream

log = logging.getLogger("sandlot.providers.kubernetes")
#: The header that carries a sandbox's control key to its dataplane's control routes.
CONTROL_HEADER = "X-Sandlot-Control"

# The client is only partly annotated: its objects are handled as ``Any``.
k8s: Any = kubernetes.client
k8s_config: Any = kubernetes.config
k8s_watch: Any = kubernetes.watch


class _Sandbox(InboxSandbox):
    """What the provider knows of one pod."""

    def __init__(self, spec: SandboxSpec, state: SandboxState) -> None:
        super().__init__(spec, state)
        self.pod_ip: str | None = None
        #: The uid of its pod once created; pods of an earlier attempt it replaced.
        self.pod_uid: str | None = None
        self.stale_uids: set[str] = set()
        #: The secret its dataplane wants on pushed revocations (in its trust ConfigMap).
        self.control_key = ""
        #: The read of ``control_key`` from the ConfigMap, for a pod adopted from another
        #: replica (control calls wait for it).
        self.trust_read: asyncio.Task[None] | None = None
        self.probing: asyncio.Task[None] | None = None
        self.reloading: asyncio.Task[None] | None = None
        #: Its pod as the watch last saw it (a pool claim names its resourceVersion).
        self.pod: Any = None


class KubernetesProvider(InboxProvider[_Sandbox]):
    name = "kubernetes"
    host_bound = False
    claims_pooled = True
    status_timeout = 5.0
    # A pod that ended is reported by the watch.
    status_errors = (httpx.TransportError, ValueError, KeyError)

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        user = str(cfg.get("user", "1000:1000"))
        uid, _, gid = user.partition(":")
        if not uid.isdigit() or int(uid) == 0 or not (gid or uid).isdigit():
            raise InvalidRequest("the kubernetes provider's user is a numeric uid:gid, never 0")
        workspace = str(cfg.get("workspace", "emptyDir"))
        if workspace not in ("emptyDir", "pvc"):
            raise InvalidRequest("the kubernetes provider's workspace is 'emptyDir' or 'pvc'")
        pull = str(cfg.get("image_pull_policy", "IfNotPresent"))
        if pull not in ("IfNotPresent", "Always", "Never"):
            raise InvalidRequest("image_pull_policy is IfNotPresent, Always or Never")
        data_dir = Path(cfg.get("data_dir", ".sandlot")).absolute()
        self.instance = hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]
        self.namespace = str(cfg.get("namespace", "default"))
        self.settings = PodSettings(
            instance=self.instance,
            image=str(cfg.get("image", "sandlot-sandbox")),
            images=dict(cfg.get("images", {})),
            image_pull_policy=pull,
            uid=int(uid),
            gid=int(gid or uid),
            python=str(cfg.get("python", "python3")),
            pythonpath=str(cfg.get("pythonpath", "/opt/sandlot/lib")),
            port=int(cfg.get("port", 8080)),
            requests_fraction=float(cfg.get("requests_fraction", 1.0)),
            workspace=workspace,
            storage_class=cfg.get("storage_class"),
            workspace_size_mb=int(cfg.get("workspace_size_mb", 1024)),
            tmp_mb=int(cfg.get("tmp_mb", 256)),
            read_only_root=bool(cfg.get("read_only_root", True)),
            node_selector=dict(cfg.get("node_selector", {})),
            tolerations=list(cfg.get("tolerations", [])),
            runtime_class=cfg.get("runtime_class"),
            issuer=str(cfg.get("issuer", "")),
        )
        # Suspending deletes the pod: only a claim keeps the workspace.
        self.supports_suspend = workspace == "pvc"
        self.keep_volumes = bool(cfg.get("keep_volumes", False))
        self.agent_sandbox = str(cfg.get("agent_sandbox", "off"))
        if self.agent_sandbox not in agentsandbox.MODES:
            raise InvalidRequest("agent_sandbox is 'off', 'auto' or 'on'")
        #: The ``Sandbox`` resources sandboxes are made as (None: bare pods).
        self.sandbox_resources: agentsandbox.SandboxResources | None = None
        self.network_policy = bool(cfg.get("network_policy", True))
        self.start_timeout = float(cfg.get("start_timeout_seconds", 120.0))
        self.jwks_refresh = float(cfg.get("jwks_refresh_seconds", 2.0))
        self.revocation_sync = float(cfg.get("revocation_sync_seconds", 90.0))
        self.public_url = str(cfg.get("public_url", "http://127.0.0.1:8765")).rstrip("/")
        jwks = cfg.get("jwks")
        if jwks is None or not self.settings.issuer:
            raise InvalidRequest("the kubernetes provider needs the broker's issuer and JWKS")
        self._jwks: JwksSource = jwks
        self._api_client: Any = None
        self._core: Any = None
        self._watcher: threading.Thread | None = None
        #: The last resourceVersion the watch saw (it resumes from there).
        self.resource_version: str | None = None
        self._claims = PodClaims(self._api, lambda: self._core, self.namespace)
        #: The store's identity of the deployment, shared by replicas (None: the data
        #: directory's hash alone, a process without the store).
        self._identity: Callable[[str, str], Awaitable[str]] | None = cfg.get("identity_source")
        #: Pods of the instance that other replicas made (:mod:`~sandlot.providers.k8speers`).
        self._peers = PeerPods()
        self._adoptions: set[asyncio.Task[None]] = set()

    # --- lifecycle of the provider --------------------------------------------------

    def _client_config(self) -> Any:
        configuration = k8s.Configuration()
        if self.config.get("in_cluster"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            k8s_config.load_kube_config(
                config_file=self.config.get("kubeconfig"),
                context=self.config.get("context"),
                client_configuration=configuration,
            )
        return configuration

    async def start(self, listener: StatusListener | None = None) -> None:
        self._listener = listener
        if self._identity is not None:
            # Replicas on one store label their pods alike: the first one's proposal.
            instance = await self._identity("kubernetes.instance", self.instance)
            self.instance = instance
            self.settings = dataclasses.replace(self.settings, instance=instance)
        try:
            configuration = await asyncio.to_thread(self._client_config)
            self._api_client = k8s.ApiClient(configuration)
            self._core = k8s.CoreV1Api(self._api_client)
            await asyncio.to_thread(self._core.list_namespaced_pod, self.namespace, limit=1)
        except Exception as exc:
            raise ProviderUnavailable(f"the cluster is unreachable: {exc}") from exc
        if self.network_policy:
            await self._ensure_network_policy()
        if self.agent_sandbox != "off":
            version = await agentsandbox.detect(self._api_client)
            if version is None and self.agent_sandbox == "on":
                await asyncio.to_thread(self._api_client.close)
                raise ProviderUnavailable("the agent-sandbox CRDs are not installed")
            if version is not None:
                self.sandbox_resources = agentsandbox.SandboxResources(
                    self._api_client, self.namespace, version
                )
        await self._refresh_keys()
        self._loop = asyncio.get_running_loop()
        self._refresher = self._loop.create_task(self._refresh_loop())
        self._watcher = threading.Thread(
            target=self._watch_pods, args=(configuration,), name="sandlot-k8s-watch", daemon=True
        )
        self._watcher.start()

    async def close(self) -> None:
        self._closing.set()
        await self._close_sandboxes()
        if self._api_client is not None:
            await asyncio.to_thread(self._api_client.close)
        # The watch thread ends within its read timeout; it is a daemon thread.

    def readiness(self) -> dict[str, Any]:
        return {
            "ok": self._core is not None,
            "namespace": self.namespace,
            "agent_sandbox": self.sandbox_resources.version if self.sandbox_resources else None,
            "sandboxes": len(self._sandboxes),
        }

    async def _api(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One blocking client call, off the event loop; 404 passes as ``ApiException``."""
        if self._core is None:
            raise ProviderUnavailable("the kubernetes provider is not started")
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            if exc.status in (404, 409):
                raise
            said = _api_message(exc)
            raise ProviderUnavailable(
                f"cluster: {exc.status} {exc.reason}" + (f": {said}" if said else "")
            ) from exc
        except Exception as exc:
            raise ProviderUnavailable(f"cluster: {exc}") from exc

    async def _ensure_network_policy(self) -> None:
        net = k8s.NetworkingV1Api(self._api_client)
        for body in network_policy_manifests(self.settings):
            try:
                await self._api(net.create_namespaced_network_policy, self.namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                name = body["metadata"]["name"]
                await self._api(net.replace_namespaced_network_policy, name, self.namespace, body)

    # --- the watch ---------------------------------------------------------------------

    def _watch_pods(self, configuration: Any) -> None:
        """The instance's pods, watched from the last resourceVersion (a thread); every
        event handed to the event loop. A dropped watch resumes; a 410 re-lists."""
        api_client = k8s.ApiClient(configuration)
        core = k8s.CoreV1Api(api_client)
        selector = f"{LABEL_INSTANCE}={self.instance}"
        delay = 0.5
        try:
            while not self._closing.is_set():
                try:
                    if self.resource_version is None:
                        pods = core.list_namespaced_pod(self.namespace, label_selector=selector)
                        self.resource_version = pods.metadata.resource_version
                        for pod in pods.items:
                            self._hand_over("MODIFIED", pod)
                    watch = k8s_watch.Watch()
                    stream = watch.stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        label_selector=selector,
                        resource_version=self.resource_version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=30,
                        _request_timeout=(5, 40),
                    )
                    for event in stream:
                        if self._closing.is_set():
                            return
                        # Bookmarks move it too (their objects are not pods).
                        if watch.resource_version:
                            self.resource_version = watch.resource_version
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self._hand_over(event["type"], event["object"])
                    delay = 0.5
                except ApiException as exc:
                    if exc.status == 410:  # too old: list again
                        self.resource_version = None
                        continue
                    log.warning("watching pods failed (%s); resuming", exc.status)
                except Exception as exc:
                    if self._closing.is_set():
                        return
                    log.warning("watching pods stopped (%s); resuming", type(exc).__name__)
                else:
                    continue
                self._closing.wait(delay)
                delay = min(delay * 2, 10.0)
        finally:
            api_client.close()

    def _hand_over(self, kind: str, pod: Any) -> None:
        loop = self._loop
        if self._closing.is_set():  # the loop may stop before it would run the handler
            return
        if loop is not None and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._on_pod(kind, pod), loop)

    async def _on_pod(self, kind: str, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        sid = labels.get(LABEL_SANDBOX, "")
        box = self._sandboxes.get(sid)
        if box is None and sid:
            self._peers.saw(kind, sid, pod)  # another replica's, or not yet ours
        if box is None or labels.get(LABEL_GENERATION) != str(box.spec.generation):
            return
        uid = pod.metadata.uid
        if uid in box.stale_uids or (box.pod_uid is not None and uid != box.pod_uid):
            return
        box.pod = pod
        if box.state not in (SandboxState.PROVISIONING, SandboxState.ACTIVE):
            return
        if kind == "DELETED":
            await self._fail(sid, box, "DELETED: the pod was deleted")
            return
        failure = pod_failure(pod)
        if failure is not None:
            await self._fail(sid, box, failure)
            return
        ip = pod.status.pod_ip if pod.status is not None else None
        if (
            box.state is SandboxState.PROVISIONING
            and pod.status is not None
            and pod.status.phase == "Running"
            and ip
            and box.probing is None
        ):
            box.pod_ip = ip
            box.probing = asyncio.get_running_loop().create_task(self._probe(sid, box, ip))

    async def _fail(self, sid: str, box: _Sandbox, reason: str) -> None:
        box.state, box.reason = SandboxState.FAILED, reason[:500]
        box.failure = failure_code(reason)
        box.settled.set()
        if box.probing is not None and box.probing is not asyncio.current_task():
            box.probing.cancel()
        if box.upstream is not None:
            await box.upstream.close()
            box.upstream = None
        log.warning("sandbox %s failed: %s", sid, box.reason)
        await self._notify(sid)

    async def _probe(self, sid: str, box: _Sandbox, ip: str) -> None:
        """The running pod's dataplane answers: the sandbox is active."""
        upstream = TcpUpstream(ip, self.settings.port)
        delay = 0.01
        while box.state is SandboxState.PROVISIONING:
            try:
                resp = await upstream.client.get(
                    "/__control/status", headers=await self._control_headers(box), timeout=2.0
                )
                if resp.status_code == 200:
                    box.last_event_sequence = int(resp.json()["last_event_sequence"])
                    break
            except (httpx.TransportError, ValueError, KeyError):
                pass
            await asyncio.sleep(delay)
            # Refused connections cost nothing: ask often while it starts.
            delay = min(delay * 2, 0.025)
        if box.state is not SandboxState.PROVISIONING or self._sandboxes.get(sid) is not box:
            await upstream.close()
            return
        box.upstream = upstream
        box.state, box.reason = SandboxState.ACTIVE, "ready"
        box.settled.set()
        await self._notify(sid)

    # --- keys ---------------------------------------------------------------------------

    async def _write_keys(self, sandbox_id: str, doc: Mapping[str, Any]) -> None:
        with contextlib.suppress(ApiException, ProviderUnavailable):
            await self._patch_trust(sandbox_id, {"jwks.json": self._jwks_text})

    async def _patch_trust(self, sandbox_id: str, data: Mapping[str, str]) -> None:
        name = object_name(self.instance, sandbox_id, "trust")
        await self._api(
            self._core.patch_namespaced_config_map, name, self.namespace, {"data": dict(data)}
        )

    # --- the contract -----------------------------------------------------------------

    def _new_box(self, spec: SandboxSpec, state: SandboxState) -> _Sandbox:
        return _Sandbox(spec, state)

    async def _create(self, spec: SandboxSpec) -> None:
        sid = spec.sandbox_id
        try:
            await self._create_objects(spec)
            box = self._sandboxes.get(sid)
            if box is not None:
                await asyncio.wait_for(box.settled.wait(), self.start_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                reason = await self._pending_reason(sid)
            else:
                reason = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            log.error("creating sandbox %s failed: %s", sid, reason)
            box = self._sandboxes.get(sid)
            if box is not None and box.state is SandboxState.PROVISIONING:
                await self._fail(sid, box, reason)

    async def _pending_reason(self, sid: str) -> str:
        """Why a pod is not running yet (its conditions), for the timeout's message."""
        base = f"TIMEOUT: the pod was not ready in {self.start_timeout} s"
        try:
            pod = await self._api(
                self._core.read_namespaced_pod, object_name(self.instance, sid), self.namespace
            )
        except (ApiException, ProviderUnavailable):
            return base
        for cond in (pod.status.conditions if pod.status else None) or []:
            if cond.status != "True" and cond.reason:
                return f"{base}: {cond.reason}: {cond.message or ''}".strip()
        return base

    async def _create_objects(self, spec: SandboxSpec) -> None:
        sid, ns = spec.sandbox_id, self.namespace
        pod_name = object_name(self.instance, sid)
        box = self._sandboxes[sid]
        # A retry after a crash mid-create: start clean, keep the workspace claim. The
        # old pod's last events must not be taken for the new one's.
        with contextlib.suppress(ApiException):
            old = await self._api(self._core.read_namespaced_pod, pod_name, ns)
            box.stale_uids.add(old.metadata.uid)
            await self._api(self._core.delete_namespaced_pod, pod_name, ns, grace_period_seconds=0)
            await self._wait_gone(pod_name)
        box.control_key = secrets.token_urlsafe(32)
        # A resumed sandbox's revocations hold in its new pod from the start.
        revoked = podlife.revoked_doc(box.revoked)
        trust = trust_manifest(self.settings, spec, self._jwks_text, box.control_key, revoked)
        try:
            await self._api(self._core.create_namespaced_config_map, ns, trust)
        except ApiException as exc:
            if exc.status != 409:
                raise
            await self._api(
                self._core.replace_namespaced_config_map, trust["metadata"]["name"], ns, trust
            )
        if self.settings.workspace == "pvc":
            with contextlib.suppress(ApiException):  # 409: it exists (kept, or a retry)
                await self._api(
                    self._core.create_namespaced_persistent_volume_claim,
                    ns,
                    claim_manifest(self.settings, spec),
                )
        await self._check_volume_claims(spec)
        manifest = pod_manifest(self.settings, spec)
        if self.sandbox_resources is not None:
            # agent-sandbox's controller makes the pod; the watch knows it by its labels.
            await self._create_sandbox_resource(manifest)
            return
        pod = await self._api(self._core.create_namespaced_pod, ns, manifest)
        box.pod_uid = pod.metadata.uid

    async def _check_volume_claims(self, spec: SandboxSpec) -> None:
        """Each named volume's claim exists (the cluster's operator makes them, of the
        access mode its sandboxes need): a pod mounting a missing one waits for it until
        the start's deadline, then fails for a reason that names no volume."""
        for vm in spec.template.volume_mounts:
            claim = volume_claim(self.instance, vm.volume)
            try:
                await self._api(
                    self._core.read_namespaced_persistent_volume_claim, claim, self.namespace
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                raise ProviderUnavailable(
                    f"VOLUME: volume {vm.volume!r} has no claim {claim!r} in namespace "
                    f"{self.namespace!r}: make one (docs/KUBERNETES.md, Named volumes)"
                ) from None

    async def _create_sandbox_resource(self, pod: Mapping[str, Any]) -> None:
        resources = self.sandbox_resources
        assert resources is not None
        body = agentsandbox.sandbox_manifest(resources.version, pod)
        deadline = time.monotonic() + 60.0
        while True:
            try:
                await self._api(resources.create, body)
                return
            except ApiException as exc:
                if exc.status != 409 or time.monotonic() > deadline:
                    raise
            name = body["metadata"]["name"]
            with contextlib.suppress(ApiException):  # 404: gone meanwhile (created next)
                found = await self._api(resources.read, name)
                if found.get("spec", {}).get("replicas") == 0:
                    # Its own, suspended: resumed with the pod it is to make now.
                    await self._api(resources.patch_spec, name, body["spec"])
                    return
                # One of an earlier attempt: it goes first (its pod with it).
                await self._api(resources.delete, name)
            await asyncio.sleep(0.2)

    async def _wait_gone(self, pod_name: str, timeout: float = 60.0) -> bool:
        """Whether the pod is gone within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                await self._api(self._core.read_namespaced_pod, pod_name, self.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            await asyncio.sleep(0.1)
        return False

    def _box(self, sandbox_id: str) -> _Sandbox:
        box = self._known(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        return box

    def _known(self, sandbox_id: str) -> _Sandbox | None:
        """The sandbox's record: this replica's, or made now from the running pod of
        another replica that the watch saw (:mod:`~sandlot.providers.k8speers`)."""
        box = self._sandboxes.get(sandbox_id)
        if box is not None or self._loop is None:
            return box
        pod = self._peers.serving(sandbox_id)
        box = peer_box(pod, _Sandbox, self.settings.port) if pod is not None else None
        if box is None:
            return None
        self._sandboxes[sandbox_id] = box
        self._peers.forget(sandbox_id)
        # Its control key and revocations, for pushes (until then a push falls back).
        task = self._loop.create_task(self._read_trust(sandbox_id, box))
        box.trust_read = task
        self._adoptions.add(task)
        task.add_done_callback(self._adoptions.discard)
        log.info("adopted sandbox %s, a pod of another replica", sandbox_id)
        return box

    async def _control_headers(self, box: _Sandbox) -> Mapping[str, str]:
        if box.trust_read is not None and not box.trust_read.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(box.trust_read)
        return {CONTROL_HEADER: box.control_key} if box.control_key else {}

    def _check_serving(self, box: _Sandbox) -> None:
        if box.state is SandboxState.FAILED:
            metadata = {"reason": box.failure} if box.failure else None
            raise ProviderUnavailable(box.reason or "the sandbox failed", metadata=metadata)

    def _forget(self, box: _Sandbox) -> None:
        for pending in (box.probing, box.reloading):
            if pending is not None:
                pending.cancel()

    async def _remove_pod(self, sandbox_id: str) -> None:
        with contextlib.suppress(ApiException):
            await self._api(
                self._core.delete_namespaced_pod,
                object_name(self.instance, sandbox_id),
                self.namespace,
                grace_period_seconds=0,
            )

    async def _remove(self, sandbox_id: str) -> None:
        """Pod (and its ``Sandbox`` resource), trust ConfigMap and workspace claim (unless
        kept). Idempotent."""
        ns = self.namespace
        self._peers.forget(sandbox_id)
        if self.sandbox_resources is not None:
            with contextlib.suppress(ApiException):
                await self._api(
                    self.sandbox_resources.delete, object_name(self.instance, sandbox_id)
                )
        await self._remove_pod(sandbox_id)
        with contextlib.suppress(ApiException):
            await self._api(
                self._core.delete_namespaced_config_map,
                object_name(self.instance, sandbox_id, "trust"),
                ns,
            )
        if not self.keep_volumes:
            with contextlib.suppress(ApiException):
                await self._api(
                    self._core.delete_namespaced_persistent_volume_claim,
                    object_name(self.instance, sandbox_id, "workspace"),
                    ns,
                )

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        """Delete the pod, keep the workspace claim (:mod:`sandlot.providers.podlife`).
        A ``Sandbox`` resource is scaled to ``replicas: 0`` first, so that its controller
        does not make the pod again (resume sets it back to 1)."""
        if self.sandbox_resources is not None and self.can_suspend(sandbox_id):
            box = self._known(sandbox_id)
            if box is not None and box.state is SandboxState.ACTIVE:
                try:
                    await self._api(
                        self.sandbox_resources.patch_spec,
                        object_name(self.instance, sandbox_id),
                        {"replicas": 0},
                    )
                except ApiException as exc:
                    # Gone (its pod goes too) is fine; otherwise the controller would make
                    # the pod again: the suspend fails, the sandbox untouched.
                    if exc.status != 404:
                        raise ProviderUnavailable(
                            f"scaling the Sandbox to zero failed: {exc.status} {exc.reason}"
                        ) from exc
        return await podlife.suspend(self, sandbox_id)

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        """Make the pod again on the same claim; return once it serves."""
        return await podlife.resume(self, sandbox_id)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        """The revocations are pushed to the pod's dataplane, where they hold at once, and
        written to the sandbox's ConfigMap, the copy a dataplane that starts again reads.
        Should the push fail, the dataplane is asked to re-read its trust directory every
        second until the kubelet has surely updated the mounted copy."""
        box = self._known(sandbox_id)
        if box is None:
            return
        doc = box.note_revoked(tokens)
        pushed = await self._push_revoked(box, doc)
        await self._patch_trust(sandbox_id, {"revoked.json": json.dumps(doc)})
        if box.reloading is not None:
            box.reloading.cancel()
            box.reloading = None
        if not pushed:
            box.reloading = asyncio.get_running_loop().create_task(self._reload_for(box))

    async def _push_revoked(self, box: _Sandbox, doc: Mapping[str, Any]) -> bool:
        """``POST /__control/revoke`` to the pod's dataplane; whether it took them."""
        upstream = box.upstream
        if upstream is None or box.state is not SandboxState.ACTIVE or not box.control_key:
            return False
        headers = {CONTROL_HEADER: box.control_key}
        try:
            resp = await upstream.client.post(
                "/__control/revoke", json=doc, headers=headers, timeout=0.5
            )
        except httpx.TransportError as exc:
            log.warning("pushing revocations to a pod failed: %s", type(exc).__name__)
            return False
        if resp.status_code != 200:
            log.warning("a pod's dataplane refused pushed revocations (%d)", resp.status_code)
            return False
        return True

    async def _read_trust(self, sandbox_id: str, box: _Sandbox) -> None:
        """A re-adopted sandbox's control key and revocations, from its ConfigMap."""
        name = object_name(self.instance, sandbox_id, "trust")
        try:
            cm = await self._api(self._core.read_namespaced_config_map, name, self.namespace)
        except (ApiException, ProviderUnavailable):
            return
        data = cm.data or {}
        box.control_key = str(data.get("control.key", ""))
        try:
            doc = json.loads(data.get("revoked.json", "{}"))
            items = doc.get("revoked", []) if isinstance(doc, dict) else []
            box.revoked = {str(i["jti"]): float(i["expires_at"]) for i in items}
        except (ValueError, TypeError, KeyError):
            box.revoked = {}

    async def _reload_for(self, box: _Sandbox) -> None:
        """Ask the dataplane to re-read its trust directory every second until the kubelet
        has surely updated the mounted copy (``revocation_sync_seconds``)."""
        deadline = time.monotonic() + self.revocation_sync
        while time.monotonic() < deadline:
            upstream = box.upstream
            if upstream is None or box.state is not SandboxState.ACTIVE:
                return
            with contextlib.suppress(httpx.TransportError):
                await upstream.client.post(
                    "/__control/reload", headers=await self._control_headers(box), timeout=5.0
                )
            await asyncio.sleep(1.0)

    async def _instance_pods(self) -> list[Any]:
        pods = await self._api(
            self._core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{LABEL_INSTANCE}={self.instance}",
        )
        return list(pods.items)

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        pods = await self._instance_pods()
        by_id = {(p.metadata.labels or {}).get(LABEL_SANDBOX): p for p in pods}
        lost: list[str] = []
        for rec in records:
            pod = by_id.get(rec.sandbox_id)
            suspended = podlife.adopt_suspended(self, rec, _Sandbox)
            if suspended is not None:
                self._sandboxes[rec.sandbox_id] = suspended
                await self._read_trust(rec.sandbox_id, suspended)
                if pod is not None:  # a suspend cut short: its pod goes now
                    await self._remove_pod(rec.sandbox_id)
                continue
            if rec.state is SandboxState.PROVISIONING and self._adopt_starting(rec, pod):
                continue
            ip = pod.status.pod_ip if pod is not None and pod.status is not None else None
            if (
                rec.state is SandboxState.PROVISIONING
                or pod is None
                or pod.metadata.deletion_timestamp is not None
                or (pod.metadata.labels or {}).get(LABEL_GENERATION) != str(rec.generation)
                or pod.status.phase != "Running"
                or pod_failure(pod) is not None
                or not ip
            ):
                lost.append(rec.sandbox_id)
                continue
            spec = SandboxSpec(rec.sandbox_id, rec.generation, rec.template, pool=rec.pool)
            box = _Sandbox(spec, SandboxState.ACTIVE)
            await self._read_trust(rec.sandbox_id, box)
            upstream = TcpUpstream(ip, self.settings.port)
            try:
                resp = await upstream.client.get(
                    "/__control/status", headers=await self._control_headers(box), timeout=5.0
                )
                ok = resp.status_code == 200
                seq = int(resp.json()["last_event_sequence"]) if ok else 0
            except (httpx.TransportError, ValueError, KeyError):
                ok, seq = False, 0
            if not ok:
                await upstream.close()
                lost.append(rec.sandbox_id)
                continue
            box.reason, box.upstream, box.pod_ip = "re-adopted after restart", upstream, ip
            box.pod_uid = pod.metadata.uid
            box.last_event_sequence = seq
            box.settled.set()
            self._sandboxes[rec.sandbox_id] = box
            await self._claims.reconcile(pod, rec.pool)
            # The broker's keys may have changed while nobody watched.
            with contextlib.suppress(ApiException, ProviderUnavailable):
                await self._patch_trust(rec.sandbox_id, {"jwks.json": self._jwks_text})
        await self.cleanup_leftovers(keep=set(self._sandboxes))
        return lost

    def _adopt_starting(self, rec: AdoptionRecord, pod: Any) -> bool:
        """A pod found for a sandbox still provisioning — another replica is starting it,
        or this process was killed while it started — is adopted and probed, not made
        again (which would delete the pod another replica waits for)."""
        box = starting_box(rec, pod, _Sandbox)
        if box is None:
            return False
        sid = rec.sandbox_id
        self._sandboxes[sid] = box
        self._peers.forget(sid)
        task = asyncio.get_running_loop().create_task(self._await_start(sid, box))
        self._tasks[sid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(sid, None))
        return True

    async def _await_start(self, sid: str, box: _Sandbox) -> None:
        """An adopted starting pod: probed once it runs (now, or on the watch's next
        event), failed if it does not serve within the start timeout."""
        await self._read_trust(sid, box)
        pod = box.pod
        ip = pod.status.pod_ip if pod is not None and pod.status is not None else None
        if pod.status is not None and pod.status.phase == "Running" and ip and box.probing is None:
            box.pod_ip = ip
            box.probing = asyncio.get_running_loop().create_task(self._probe(sid, box, ip))
        try:
            await asyncio.wait_for(box.settled.wait(), self.start_timeout)
        except TimeoutError:
            if box.state is SandboxState.PROVISIONING:
                await self._fail(sid, box, await self._pending_reason(sid))

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        """Delete this instance's pods, trust ConfigMaps and claims that belong to no
        sandbox in ``keep``; the ids removed."""
        selector = f"{LABEL_INSTANCE}={self.instance}"
        found = {(p.metadata.labels or {}).get(LABEL_SANDBOX) for p in await self._instance_pods()}
        maps = await self._api(
            self._core.list_namespaced_config_map, self.namespace, label_selector=selector
        )
        found |= {(m.metadata.labels or {}).get(LABEL_SANDBOX) for m in maps.items}
        if self.sandbox_resources is not None:
            made = await self._api(self.sandbox_resources.labelled, selector)
            found |= {(r["metadata"].get("labels") or {}).get(LABEL_SANDBOX) for r in made}
        if not self.keep_volumes:
            claims = await self._api(
                self._core.list_namespaced_persistent_volume_claim,
                self.namespace,
                label_selector=selector,
            )
            found |= {(c.metadata.labels or {}).get(LABEL_SANDBOX) for c in claims.items}
        removed = []
        for sid in sorted(s for s in found - keep if s):
            log.info("removing leftover sandbox %s", sid)
            await self._remove(sid)
            removed.append(sid)
        return removed

    async def claim_pooled(self, sandbox_id: str) -> bool:
        """A label update naming the pod's resourceVersion (:mod:`~sandlot.providers.k8spool`)."""
        box = self._known(sandbox_id)
        if box is None or box.state is not SandboxState.ACTIVE:
            return False
        name = object_name(self.instance, sandbox_id)
        try:
            taken = await self._claims.claim(name, box.pod)
        except (ApiException, ProviderUnavailable) as exc:
            log.warning("claiming pool pod %s failed: %s", name, exc)
            return False
        if taken:  # a pod made again for it (a resume) is no pool's
            box.spec = dataclasses.replace(box.spec, pool=None)
        return taken

    async def release_pooled(self, sandbox_id: str, pool: str) -> None:
        box = self._sandboxes.get(sandbox_id)
        if box is not None:
            box.spec = dataclasses.replace(box.spec, pool=pool)
        await self._claims.release(object_name(self.instance, sandbox_id), pool)

    async def list_sandboxes(self) -> set[str]:
        pods = await self._instance_pods()
        running = {(p.metadata.labels or {}).get(LABEL_SANDBOX) for p in pods} - {None}
        return set(self._sandboxes) | {str(s) for s in running}

    def image_for(self, template: Template) -> str:
        return self.settings.image_for(template)


def _api_message(exc: ApiException) -> str:
    """What the API server said of a refusal (its Status's ``message``), if anything."""
    try:
        doc = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return ""
    message = doc.get("message") if isinstance(doc, dict) else None
    return str(message)[:400] if message else ""


__all__ = ["KubernetesProvider"]

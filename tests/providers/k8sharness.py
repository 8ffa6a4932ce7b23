"""A kubernetes provider on the cluster of ``scripts/k8s-cluster``, its relay served on
127.0.0.1:0 as the embedded server serves ``/dp``, and tokens signed with a test key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import ProviderStatus, SandboxSpec
from sandlot.providers.kubernetes import KubernetesProvider
from sandlot.sdk import AsyncSandbox
from tests.dataplane.conftest import ISSUER, Keys
from tests.k8scluster import Cluster
from tests.servers import free_port

NAMESPACE = "default"


def core_api(cluster: Cluster) -> Any:
    return k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=cluster.kubeconfig))


@dataclass
class Harness:
    provider: KubernetesProvider
    keys: Keys
    base: str
    core: Any
    changes: list[tuple[str, ProviderStatus]]

    def url(self, sandbox_id: str, path: str = "") -> str:
        return f"{self.base}/dp/{sandbox_id}/v1{path}"

    def headers(self, sandbox_id: str, **over: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys.token(sandbox_id, **over)}"}

    def sandbox(self, sandbox_id: str, **over: Any) -> AsyncSandbox:
        grant = {
            "sandbox_id": sandbox_id,
            "http_url": self.url(sandbox_id),
            "token": self.keys.token(sandbox_id, **over),
        }
        return AsyncSandbox(grant, timeout=30)

    async def create(self, sandbox_id: str, generation: int = 1, **template: Any) -> None:
        resources = {k: template.pop(k) for k in ("cpu", "memory_mb", "pids") if k in template}
        resources.setdefault("memory_mb", 256)
        fields = {"name": "t", "image": "host", "resources": resources, **template}
        spec = SandboxSpec(sandbox_id, generation, Template(**fields))
        await self.provider.create(spec)
        await self.wait(sandbox_id, SandboxState.ACTIVE)

    async def wait(self, sandbox_id: str, state: SandboxState, timeout: float = 120) -> None:
        async with asyncio.timeout(timeout):
            while (status := await self.provider.status(sandbox_id)).state is not state:
                assert status.state is not SandboxState.FAILED, status.reason
                await asyncio.sleep(0.05)

    def pods(self) -> list[Any]:
        selector = f"sandlot.instance={self.provider.instance}"
        return list(self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)

    def policies(self) -> set[str]:
        net = k8s.NetworkingV1Api(self.core.api_client)
        selector = f"sandlot.instance={self.provider.instance}"
        found = net.list_namespaced_network_policy(NAMESPACE, label_selector=selector)
        return {p.metadata.name for p in found.items}

    def pod(self, sandbox_id: str) -> Any:
        (found,) = [
            p for p in self.pods() if p.metadata.labels.get("sandlot.sandbox") == sandbox_id
        ]
        return found


def make_provider(
    cluster: Cluster, image: str, data_dir: Path, keys: Keys, **config: Any
) -> KubernetesProvider:
    async def jwks() -> dict[str, Any]:
        return keys.jwks()

    return KubernetesProvider(
        {
            "kubeconfig": cluster.kubeconfig,
            "namespace": NAMESPACE,
            "image": image,
            # The node has the image; nothing is pulled (no registry is reachable).
            "image_pull_policy": "Never",
            # Two cores: requests are a sliver of the limits so tests' pods all fit.
            "requests_fraction": 0.01,
            "data_dir": data_dir,
            "issuer": ISSUER,
            "jwks": jwks,
            "jwks_refresh_seconds": 0.2,
            **config,
        }
    )


@contextlib.asynccontextmanager
async def serving(
    cluster: Cluster, image: str, data_dir: Path, keys: Keys | None = None, **config: Any
) -> AsyncIterator[Harness]:
    """The provider started, its relay served at ``/dp`` on loopback; closed after (the
    pods stay, as they do when a server stops)."""
    keys = keys or Keys()
    provider = make_provider(cluster, image, data_dir, keys, **config)
    changes: list[tuple[str, ProviderStatus]] = []
    await provider.start(lambda sid, status: changes.append((sid, status)))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"].startswith("/dp/"):
            scope = {**scope, "root_path": "/dp"}
        await provider.app(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
            ws_ping_interval=None,
        )
    )  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    core = core_api(cluster)
    try:
        yield Harness(provider, keys, f"http://127.0.0.1:{port}", core, changes)
    finally:
        server.should_exit = True
        await task
        await provider.close()
        core.api_client.close()

"""A docker provider on a private engine, its relay served on 127.0.0.1:0 as the embedded
server serves ``/dp``, and tokens signed with a test key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import ProviderStatus, SandboxSpec
from sandlot.providers.docker import DockerProvider
from sandlot.sdk import AsyncSandbox
from tests.dataplane.conftest import ISSUER, Keys
from tests.dockerengine import Engine
from tests.servers import free_port


@dataclass
class Harness:
    provider: DockerProvider
    keys: Keys
    base: str
    engine: Engine
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
        keys = ("cpu", "memory_mb", "pids", "disk_mb")
        resources = {k: template.pop(k) for k in keys if k in template}
        fields = {"name": "t", "image": "host", "resources": resources, **template}
        spec = SandboxSpec(sandbox_id, generation, Template(**fields))
        await self.provider.create(spec)
        await self.wait(sandbox_id, SandboxState.ACTIVE)

    async def wait(self, sandbox_id: str, state: SandboxState, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while (status := await self.provider.status(sandbox_id)).state is not state:
                assert status.state is not SandboxState.FAILED, status.reason
                await asyncio.sleep(0.02)

    def container(self, sandbox_id: str) -> Any:
        (found,) = self.engine.client.containers.list(
            all=True, filters={"label": f"sandlot.sandbox={sandbox_id}"}
        )
        return found


def make_provider(engine: Engine, image: str, data_dir: Path, keys: Keys, **config: Any) -> Any:
    async def jwks() -> dict[str, Any]:
        return keys.jwks()

    return DockerProvider(
        {
            "url": engine.url,
            "image": image,
            "data_dir": data_dir,
            "issuer": ISSUER,
            "jwks": jwks,
            "jwks_refresh_seconds": 0.2,
            **config,
        }
    )


@contextlib.asynccontextmanager
async def serving(
    engine: Engine, image: str, data_dir: Path, keys: Keys | None = None, **config: Any
) -> AsyncIterator[Harness]:
    """The provider started, its relay served at ``/dp`` on loopback; closed after (the
    containers stay, as they do when a server stops)."""
    keys = keys or Keys()
    provider = make_provider(engine, image, data_dir, keys, **config)
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
    try:
        yield Harness(provider, keys, f"http://127.0.0.1:{port}", engine, changes)
    finally:
        server.should_exit = True
        await task
        await provider.close()

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.broker.app import create_app
from sandlot.broker.core import Broker
from sandlot.broker.settings import BrokerSettings, load_settings
from sandlot.protocol.common import PrincipalType
from tests.broker.fakes import FakeProvider


class Clock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    broker: Broker
    provider: FakeProvider
    client: httpx.AsyncClient
    clock: Clock | None
    app: Any = None
    server: Any = None
    server_task: Any = None
    sock: Any = None

    async def serve(self) -> str:
        """Serve the app on a real loopback socket (for streaming responses)."""
        if self.sock is not None:
            return f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        import asyncio
        import socket

        import uvicorn

        sock = self.sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, lifespan="off", access_log=False, timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.server_task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def key(self, user: str, actor: str = "human", principal: str | None = None) -> dict[str, str]:
        raw, _ = self.broker.keys.create(
            user_id=user, principal_type=PrincipalType(actor), principal_id=principal
        )
        return {"Authorization": f"Bearer {raw}"}


MakeHarness = Callable[..., Any]


@pytest.fixture(params=["asgi", "loopback"])
async def make_harness(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[MakeHarness]:
    """The real broker app, in process (``asgi``) and on a loopback socket (``loopback``)."""
    made: list[Harness] = []

    async def make(
        provider: FakeProvider | None = None,
        *,
        clock: Clock | None = None,
        **overrides: Any,
    ) -> Harness:
        settings: BrokerSettings = load_settings(
            environ={}, data_dir=tmp_path / f"data{len(made)}", provider_mode="unisolated"
        )
        settings = replace(settings, **overrides)
        provider = provider or FakeProvider()
        broker = Broker(
            settings, provider, clock=clock or __import__("time").time, run_reaper=False
        )
        await broker.start()
        app = create_app(broker)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://broker")
        h = Harness(broker, provider, client, clock, app=app)
        made.append(h)
        if request.param == "loopback":
            base = await h.serve()
            await client.aclose()
            h.client = httpx.AsyncClient(base_url=base, timeout=30)
        return h

    yield make
    for h in made:
        if h.server is not None:
            h.server.should_exit = True
            await h.server_task
            h.sock.close()
        await h.client.aclose()
        await h.broker.stop()


@pytest.fixture
async def harness(make_harness: MakeHarness) -> Harness:
    return await make_harness()  # type: ignore[no-any-return]

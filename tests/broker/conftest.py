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

    def key(self, user: str, actor: str = "human", principal: str | None = None) -> dict[str, str]:
        raw, _ = self.broker.keys.create(
            user_id=user, principal_type=PrincipalType(actor), principal_id=principal
        )
        return {"Authorization": f"Bearer {raw}"}


MakeHarness = Callable[..., Any]


@pytest.fixture
async def make_harness(tmp_path: Path) -> AsyncIterator[MakeHarness]:
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
        h = Harness(broker, provider, client, clock)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.client.aclose()
        await h.broker.stop()


@pytest.fixture
async def harness(make_harness: MakeHarness) -> Harness:
    return await make_harness()  # type: ignore[no-any-return]

"""A stopping broker waits for its provider calls in flight a bounded time, then cancels
them (as a crash would end them: the next start recovers them)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from sandlot.broker.app import create_app
from sandlot.broker.core import Broker
from sandlot.broker.settings import load_settings
from sandlot.protocol.common import PrincipalType
from sandlot.providers.base import ProviderStatus, SandboxSpec
from tests.broker.fakes import FakeProvider


class CreateNeverReturns(FakeProvider):
    """A provider whose creation never returns (a host that never answers)."""

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        self.created.append(spec.sandbox_id)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_provider_call_that_never_ends_does_not_hold_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sandlot.broker.core.STOP_DRAIN_SECONDS", 0.5)
    settings = load_settings(environ={}, data_dir=tmp_path / "data", provider_mode="unisolated")
    provider = CreateNeverReturns()
    broker = Broker(settings, provider, run_reaper=False)
    await broker.start()
    raw, _ = broker.keys.create(user_id="alice", principal_type=PrincipalType.AGENT)
    transport = httpx.ASGITransport(app=create_app(broker))
    async with httpx.AsyncClient(transport=transport, base_url="http://broker") as client:
        r = await client.post(
            "/v1/sandbox/sessions",
            json={"thread_id": "thr_stuck", "mode": "ensure"},
            headers={"Authorization": f"Bearer {raw}"},
        )
        assert r.status_code == 200, r.text
    async with asyncio.timeout(10):
        while provider.created != [r.json()["sandbox"]["id"]]:
            await asyncio.sleep(0.01)
    # Without the bound, this waited for the creation for good.
    async with asyncio.timeout(60):
        await broker.stop()
    assert not broker.started

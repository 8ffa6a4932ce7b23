"""A sandbox host that registers again with another address or secret (a restart on a
new port, a rotated credential): the broker's clients of its registration before are
closed once the calls through them are over, not kept for the broker's life (each
re-registration left an open client and a scope behind)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from sandlot.broker.app import create_app
from sandlot.broker.core import Broker
from sandlot.broker.settings import load_settings
from sandlot.protocol.common import PrincipalType
from tests.pg import postgres_cluster
from tests.providers.peers import host_api

SECRET = "host-secret-" + "x" * 20


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with postgres_cluster() as url:
        yield url


async def test_a_hosts_former_clients_are_closed_once_retired(store: str, tmp_path: Path) -> None:
    settings = load_settings(
        environ={},
        data_dir=tmp_path / "broker",
        store_url=store,
        sandbox_hosts="registered",
        provider_mode="unisolated",
        public_url="http://127.0.0.1:1",
    )
    broker = Broker(replace(settings, admins=frozenset({"admin"})), None, run_reaper=False)
    await broker.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(broker)), base_url="http://broker", timeout=60
    )
    try:
        admin, _ = broker.keys.create(user_id="admin", principal_type=PrincipalType.HUMAN)
        alice, _ = broker.keys.create(user_id="alice", principal_type=PrincipalType.AGENT)
        made = await client.post(
            "/v1/hosts/keys", json={"name": "h1"}, headers={"Authorization": f"Bearer {admin}"}
        )
        host = {"Authorization": f"Bearer {made.json()['key']}"}
        # Each registration read as it is made (a broker rereads them every 2 s).
        broker.remote.RECORD_TTL = 0.0
        async with host_api(SECRET) as first, host_api(SECRET) as second:
            scopes, fleet_clients = [], []
            for round_, url in enumerate([first, second, first, second]):
                reg = {"provider": "local", "provider_url": url, "provider_secret": SECRET,
                       "dataplane_url": "http://127.0.0.1:9", "capacity": 50}  # fmt: skip
                assert (await client.post("/v1/hosts/register", json=reg, headers=host)).is_success
                # A reaper pass through the host's scope, a sandbox made through the fleet.
                assert (await client.post("/v1/hosts/reap", headers=host)).status_code == 200
                r = await client.post(
                    "/v1/sandbox/sessions",
                    json={"thread_id": f"thr_{round_}", "mode": "ensure"},
                    headers={"Authorization": f"Bearer {alice}"},
                )
                assert r.status_code == 200, r.text
                await broker.sandboxes.drain()
                scopes.append(broker.host_api.scope(made.json()["host_id"]))
                fleet_clients.append(await broker.remote._for(r.json()["sandbox"]["id"]))
            # Kept while calls through them may run: none closed yet.
            assert len(set(map(id, scopes))) == 4 and len(set(map(id, fleet_clients))) == 4
            assert not any(s.provider._client.is_closed for s in scopes)
            # Once retired long enough, the next call closes them; the current ones stay.
            broker.host_api.RETIRE_SECONDS = 0.0
            broker.remote.RETIRE_SECONDS = 0.0
            assert (await client.post("/v1/hosts/reap", headers=host)).status_code == 200
            r = await client.post(
                "/v1/sandbox/sessions",
                json={"thread_id": "thr_last", "mode": "ensure"},
                headers={"Authorization": f"Bearer {alice}"},
            )
            assert r.status_code == 200, r.text
            await broker.sandboxes.drain()
            async with asyncio.timeout(20):  # a retired scope is closed in the background
                while not all(s.provider._client.is_closed for s in scopes[:3]):
                    await asyncio.sleep(0.01)
            assert [s.provider._client.is_closed for s in scopes] == [True, True, True, False]
            assert [c._client.is_closed for c in fleet_clients] == [True, True, True, False]
            assert broker.host_api._retired == [] and broker.remote._retired == []
    finally:
        await client.aclose()
        await broker.stop()

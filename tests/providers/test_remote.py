"""The provider API a sandbox host serves (``provider_router``) and the broker's client
of it (``RemoteProvider``), on loopback: malformed calls are 400s, a host that answers
a byte at a time is given up at the call's deadline, and a host refusing the broker's
credential is a host unavailable, never the user's key refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sandlot.protocol.errors import ProviderUnavailable
from sandlot.protocol.sessions import Template
from sandlot.providers.base import SandboxSpec
from sandlot.providers.remote import SECRET_HEADER, RemoteProvider
from tests.providers.peers import host_api, trickling

SECRET = "s" * 32


@pytest.fixture
async def host() -> AsyncIterator[str]:
    async with host_api(SECRET) as url:
        yield url


def remote(url: str, secret: str = SECRET, **config: Any) -> RemoteProvider:
    return RemoteProvider({"url": url, "secret": secret, "dataplane_url": url, **config})


async def test_malformed_calls_are_answered_400(host: str) -> None:
    spec = {"sandbox_id": "sb_1", "generation": 1, "template": {"name": "t", "image": "host"}}
    creates: list[Any] = [
        b"{not json",
        b"[]",
        b"{}",
        {**spec, "generation": "one"},
        b'{"sandbox_id": "sb_1", "generation": 1e400, "template": {"name": "t", "image": "h"}}',
        {**spec, "template": {"name": 5}},
        {**spec, "name": ["a"]},
    ]
    revokes: list[Any] = [b"]", {}, {"tokens": [{"jti": "a"}]}, {"tokens": 5}]
    async with httpx.AsyncClient(base_url=host, headers={SECRET_HEADER: SECRET}) as client:

        async def post(path: str, body: Any) -> httpx.Response:
            if isinstance(body, bytes):
                return await client.post(path, content=body)
            return await client.post(path, json=body)

        for body in creates:
            r = await post("/internal/provider/sandboxes", body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST", body
        for body in revokes:
            r = await post("/internal/provider/sandboxes/sb_1/revoke", body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST", body
        # A well-formed one goes through.
        r = await post("/internal/provider/sandboxes", spec)
        assert r.status_code == 200 and r.json()["state"] in ("provisioning", "active")
        r = await client.post(
            "/internal/provider/sandboxes", json=spec, headers={SECRET_HEADER: "x"}
        )
        assert r.status_code == 401


async def test_a_host_refusing_the_brokers_credential_is_unavailable(host: str) -> None:
    provider = remote(host, secret="not-the-hosts-secret-at-all")
    try:
        with pytest.raises(ProviderUnavailable, match="refused this broker's credential"):
            await provider.status("sb_1")
    finally:
        await provider.close()


async def test_a_host_answering_a_byte_at_a_time_is_given_up_at_the_deadline() -> None:
    async with trickling() as url:
        provider = remote(url, call_timeout_seconds=1.0)
        try:
            spec = SandboxSpec("sb_1", 1, Template(name="t", image="host"))
            # Each read comes well within the client's read timeout (1 s); the whole
            # answer never does.
            async with asyncio.timeout(30):
                with pytest.raises(ProviderUnavailable, match="did not answer within 1 s"):
                    await provider.create(spec)
                with pytest.raises(ProviderUnavailable, match="did not answer within 1 s"):
                    await provider.status("sb_1")
        finally:
            await provider.close()

"""The SDK checks the ``protocol_version`` of the grants it is handed (PROTOCOL.md 2.1,
2.9, 2.10): a newer minor version is accepted (its unknown fields ignored), another
major version raises ProtocolVersionError before the grant is used.

Grants of another version come from two places: a bootstrap object (2.10) edited from
a real grant of our server, and a small HTTP server standing in for an outside broker of
another version (not our server: ours only speaks 1.x).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sandlot.sdk import AsyncSandbox, AsyncSandlot, ProtocolVersionError, Sandbox, Sandlot
from sandlot.sdk.types import Grant
from tests.servers import SandlotServer


async def _real_grant(server: SandlotServer, key: str, thread: str) -> dict[str, Any]:
    async with AsyncSandlot(server.url, key, auto_refresh=False) as client:
        sandbox = await client.ensure(thread)
        return dict(sandbox.grant.raw)


@pytest.mark.parametrize("version", ["2.0", "0.9", "3", "one", "", 1])
async def test_a_bootstrap_grant_of_another_major_version_is_refused(
    server: SandlotServer, human_key: str, version: object
) -> None:
    grant = await _real_grant(server, human_key, "thr_pv_refused")
    assert grant["protocol_version"] == "1.0"
    grant["protocol_version"] = version
    config = {"configurable": {"sandbox": grant}}
    with pytest.raises(ProtocolVersionError) as info:
        AsyncSandbox.from_config(config)
    err = info.value
    assert err.server_version == str(version) and err.client_version == "1.0"
    assert err.metadata == {"server_version": str(version), "client_version": "1.0"}
    assert "1.0" in str(err) and str(version) in str(err)
    with pytest.raises(ProtocolVersionError):
        Sandbox(grant)
    with pytest.raises(ProtocolVersionError):
        Grant.from_response(grant)


async def test_a_newer_minor_version_is_used_and_its_new_fields_ignored(
    server: SandlotServer, human_key: str
) -> None:
    grant = await _real_grant(server, human_key, "thr_pv_minor")
    grant["protocol_version"] = "1.7"
    grant["a_field_of_1_7"] = {"anything": [1, 2]}
    grant["binding"]["another_new_field"] = True
    async with AsyncSandbox(grant) as sandbox:
        assert sandbox.grant.protocol_version == "1.7"
        assert (await sandbox.run("echo ok")).stdout == "ok\n"
    # A grant without a version (built by hand) is taken as is.
    del grant["protocol_version"]
    async with AsyncSandbox(grant) as sandbox:
        assert (await sandbox.run("echo ok")).stdout == "ok\n"


class _OutsideBroker(BaseHTTPRequestHandler):
    """A broker of another protocol version: answers every negotiation with ``grant``
    (its dataplane is this same server) and records every request it gets."""

    protocol_version = "HTTP/1.1"
    grant: dict[str, Any] = {}
    seen: list[str] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.seen.append(f"{self.command} {self.path}")
        body = json.dumps(self.grant).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def outside_broker() -> Iterator[tuple[str, type[_OutsideBroker]]]:
    handler = type("Handler", (_OutsideBroker,), {"grant": {}, "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def _grant_of(url: str, version: str, state: str) -> dict[str, Any]:
    dataplane = {"http_base_url": f"{url}/dp/sb_x/v1", "ws_base_url": f"ws{url[4:]}/dp/sb_x/v1"}
    return {
        "protocol_version": version,
        "session_id": "ssn_x",
        "thread_id": "thr_x",
        "sandbox": {"id": "sb_x", "provider": "elsewhere", **dataplane},
        "token": "tok",
        "expires_at": "2099-01-01T00:00:00Z",
        "binding": {
            "id": "ssn_x",
            "scope": {"type": "thread", "id": "thr_x"},
            "sandbox_id": "sb_x",
            "provider": "elsewhere",
            "state": state,
            "last_event_sequence": 1,
        },
        "dataplane": dataplane,
        "credentials": {"access_token": "tok", "expires_at": "2099-01-01T00:00:00Z"},
        "policy": {"token_ttl_seconds": 900, "lease_ttl_seconds": 300},
        "refresh_url": "/v1/sandbox/sessions/ssn_x/refresh",
        "fields_of_a_later_version": {"x": 1},
    }


async def test_a_broker_of_another_major_version_is_refused_before_the_grant_is_used(
    outside_broker: tuple[str, type[_OutsideBroker]],
) -> None:
    url, handler = outside_broker
    # Provisioning: a 1.x client would now wait on the binding's events.
    handler.grant = _grant_of(url, "2.0", "provisioning")
    async with AsyncSandlot(url, "sk_test") as client:
        with pytest.raises(ProtocolVersionError) as info:
            await client.ensure("thr_x")
    assert info.value.server_version == "2.0"
    # The negotiation only: no wait on the events, no dataplane call, no refresh.
    assert handler.seen == ["POST /v1/sandbox/sessions"]
    with Sandlot(url, "sk_test") as sync_client, pytest.raises(ProtocolVersionError):
        sync_client.ensure("thr_x")
    # The alias shape (2.9) carries the version too.
    alias = {
        "protocol_version": "2.1",
        "sandbox_id": "sb_x",
        "token": "tok",
        "http_url": f"{url}/dp/sb_x/v1",
        "ws_url": f"ws{url[4:]}/dp/sb_x/v1",
    }
    with pytest.raises(ProtocolVersionError):
        AsyncSandbox(alias)


async def test_a_broker_of_a_newer_minor_version_is_used(
    outside_broker: tuple[str, type[_OutsideBroker]],
) -> None:
    url, handler = outside_broker
    handler.grant = _grant_of(url, "1.4", "active")
    async with AsyncSandlot(url, "sk_test", auto_refresh=False) as client:
        sandbox = await client.ensure("thr_x")
    assert sandbox.grant.protocol_version == "1.4"
    assert sandbox.grant.http_base_url == f"{url}/dp/sb_x/v1"
    assert handler.seen == ["POST /v1/sandbox/sessions"]

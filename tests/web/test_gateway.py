"""The gateway from the web server to its upstreams: its refusals, its pinning, its
header rules, caps, retries, breaker, error envelopes, version check and WebSocket
relay, against a real dataplane and against upstreams that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect

from sandlot.protocol.errors import (
    FileNotFound,
    Forbidden,
    InvalidRequest,
    PayloadTooLarge,
    ProviderUnavailable,
    SandlotError,
)
from sandlot.sdk import Grant
from sandlot.web.gateway import (
    Gateway,
    GatewaySettings,
    RelayEnd,
    Upstream,
    error_answer,
    relay,
)
from tests.servers import SandlotServer
from tests.web.upstreams import UPSTREAM_SECRET, MiB, Misbehaving, raw_upstream, serving

#: The dataplane token the web server holds (never the browser's).
TOKEN = "dp-token.for-the-gateway-only"
BROWSER = {
    "Authorization": "Bearer browser-credential",
    "Cookie": "workspace_session=browser-cookie",
    "X-Api-Key": "browser-api-key",
    "Origin": "http://evil.example",
    "Connection": "keep-alive, X-Hop",
    "X-Hop": "hop",
    "Keep-Alive": "timeout=5",
    "Proxy-Authorization": "Basic cHJveHk=",
    "TE": "trailers",
    "Upgrade": "h2c",
    "X-Request-Id": "rq-browser-1",
    "Accept": "application/json",
    "If-None-Match": '"e0"',
}


class FakeDNS:
    """A resolver the test controls: ``answers[host]`` is what the name resolves to."""

    def __init__(self, **answers: list[str]) -> None:
        self.answers = {k.replace("_", "."): v for k, v in answers.items()}
        self.asked = 0

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked += 1
        if host not in self.answers:
            raise OSError(f"unknown host {host}")
        return self.answers[host]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gateway_for(
    up: Misbehaving | int,
    *,
    dns: FakeDNS | None = None,
    clock: FakeClock | None = None,
    methods: frozenset[str] = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE"}),
    **settings: Any,
) -> Gateway:
    """A gateway to ``upstream.test:<port>`` under ``/up/`` (the name resolves to
    127.0.0.1 through ``dns`` only), with quick backoffs."""
    port = up.port if isinstance(up, Misbehaving) else up
    settings = {"backoff_base": 0.001, "max_retry_after": 0.01, **settings}
    return Gateway(
        [Upstream("up", f"http://upstream.test:{port}/up", ("/up/",), methods)],
        GatewaySettings(**settings),
        resolver=dns or FakeDNS(upstream_test=["127.0.0.1"]),
        clock=clock or FakeClock(),
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wire(exc: BaseException, request_id: str | None = None) -> str:
    """What the browser would receive for ``exc``: the envelope and headers, as text."""
    answer = error_answer(exc, request_id)
    return json.dumps([answer.status, answer.body, answer.headers])


# --- refusals ---------------------------------------------------------------------------


async def test_allowlist_refuses_other_hosts_ports_paths_methods(misbehaving: Misbehaving) -> None:
    port = misbehaving.port
    refusals = {
        f"http://other.test:{port}/up/echo": "host",
        f"http://127.0.0.1:{port}/up/echo": "host",
        f"http://upstream.test:{port + 1}/up/echo": "port",
        f"https://upstream.test:{port}/up/echo": "scheme",
        f"ftp://upstream.test:{port}/up/echo": "scheme",
        f"http://upstream.test:{port}/admin": "path",
        f"http://upstream.test:{port}/upper": "path",
        f"http://upstream.test:{port}/up/%2e%2e/admin": "path",
        f"http://upstream.test:{port}/up/x%2F..%2F..%2Fadmin": "path",
        f"http://user:pw@upstream.test:{port}/up/echo": "url",
        "http://[::1": "url",
    }
    async with gateway_for(misbehaving) as gw:
        for url, reason in refusals.items():
            with pytest.raises(Forbidden) as caught:
                await gw.request("GET", url, token=TOKEN, headers=BROWSER)
            assert caught.value.metadata["reason"] == reason, url
            answer = error_answer(caught.value)
            assert answer.status == 403 and answer.body["error"]["code"] == "FORBIDDEN"
            assert answer.body["error"]["request_id"] == "rq-browser-1"
        with pytest.raises(Forbidden) as caught:
            await gw.request("PATCH", misbehaving.url("/up/echo"), token=TOKEN)
        assert caught.value.metadata["reason"] == "method"
        with pytest.raises(Forbidden) as caught:
            await gw.websocket(f"ws://upstream.test:{port}/elsewhere", token=TOKEN)
        assert caught.value.metadata["reason"] == "path"
        refused = gw.registry.get_sample_value("sandlot_gateway_refusals_total", {"reason": "host"})
        assert refused == 2
    # Nothing reached the upstream, not even the version check.
    assert sum(misbehaving.hits.values()) == 0


async def test_a_redirect_is_refused_and_not_followed(misbehaving: Misbehaving) -> None:
    async with gateway_for(misbehaving) as gw:
        with pytest.raises(Forbidden) as caught:
            await gw.request("GET", misbehaving.url("/up/redirect"), token=TOKEN)
    assert caught.value.metadata["reason"] == "redirect"
    assert error_answer(caught.value).status == 403
    assert misbehaving.hits["redirect"] == 1 and misbehaving.hits["echo"] == 0


async def test_a_dns_answer_that_changes_is_refused(
    misbehaving: Misbehaving, caplog: pytest.LogCaptureFixture
) -> None:
    dns = FakeDNS(upstream_test=["127.0.0.1"])
    caplog.set_level(logging.INFO, logger="sandlot.web")
    async with gateway_for(misbehaving, dns=dns, dns_recheck_seconds=0) as gw:
        answer = await gw.request("GET", misbehaving.url("/up/echo"), token=TOKEN)
        assert answer.status_code == 200
        # The connection went to the pinned address, the request kept the name.
        assert misbehaving.headers["host"] == f"upstream.test:{misbehaving.port}"
        dns.answers["upstream.test"] = ["127.0.0.2"]
        with pytest.raises(Forbidden) as caught:
            await gw.request("GET", misbehaving.url("/up/echo"), token=TOKEN)
        assert caught.value.metadata["reason"] == "dns_changed"
        assert misbehaving.hits["echo"] == 1
        logged = [r.getMessage() for r in caplog.records if "not its pinned" in r.getMessage()]
        assert logged and "127.0.0.2" in logged[0] and "127.0.0.1" in logged[0]
        # An answer that holds the pinned address again is fine; another one never is.
        dns.answers["upstream.test"] = ["127.0.0.3", "127.0.0.1"]
        assert (await gw.request("GET", misbehaving.url("/up/echo"), token=TOKEN)).json()
        dns.answers["upstream.test"] = ["127.0.0.3"]
        with pytest.raises(Forbidden):
            await gw.websocket(misbehaving.url("/up/ws"), token=TOKEN)
    assert misbehaving.hits["echo"] == 2 and dns.asked >= 4


# --- headers ----------------------------------------------------------------------------


async def test_browser_credentials_and_hop_by_hop_headers_are_not_forwarded(
    misbehaving: Misbehaving,
) -> None:
    async with gateway_for(misbehaving) as gw:
        answer = await gw.request(
            "POST", misbehaving.url("/up/echo"), token=TOKEN, headers=BROWSER, content=b"hi"
        )
        got = misbehaving.headers
        assert got["authorization"] == f"Bearer {TOKEN}"
        for name in (
            "cookie",
            "x-api-key",
            "origin",
            "x-hop",
            "keep-alive",
            "proxy-authorization",
            "te",
            "upgrade",
        ):
            assert name not in got, name
        assert got["x-request-id"] == "rq-browser-1"
        assert got["accept"] == "application/json" and got["if-none-match"] == '"e0"'
        assert answer.json() == {"method": "POST", "body": "hi"}
        # The answer's headers are filtered too; the request id is the browser's.
        assert "set-cookie" not in answer.headers and "x-upstream-secret" not in answer.headers
        assert answer.headers["etag"] == '"e1"' and answer.headers["cache-control"] == "no-store"
        assert answer.headers["x-request-id"] == answer.request_id == "rq-browser-1"
        # No id from the browser: the gateway makes one and sends it.
        answer = await gw.request("GET", misbehaving.url("/up/echo"), token=TOKEN)
        assert answer.request_id.startswith("req_")
        assert misbehaving.headers["x-request-id"] == answer.request_id


async def test_websocket_headers_are_filtered_too(misbehaving: Misbehaving) -> None:
    async with gateway_for(misbehaving) as gw:
        upstream = await gw.websocket(misbehaving.url("/up/ws"), token=TOKEN, headers=BROWSER)
        try:
            got = json.loads(await upstream.recv())["headers"]
            await upstream.send("ping")
            assert await upstream.recv() == "echo:ping"
        finally:
            await upstream.close()
    assert got["authorization"] == f"Bearer {TOKEN}"
    assert "cookie" not in got and "origin" not in got and "x-api-key" not in got
    assert got["x-request-id"] == "rq-browser-1"
    assert got["host"] == f"upstream.test:{misbehaving.port}"


# --- sizes ------------------------------------------------------------------------------


async def test_answers_past_the_cap_are_refused(misbehaving: Misbehaving) -> None:
    async with gateway_for(misbehaving, max_json_bytes=MiB, max_file_bytes=MiB) as gw:
        # Declared too large: refused before the body is read.
        with pytest.raises(PayloadTooLarge) as caught:
            await gw.request("GET", misbehaving.url("/up/big"), token=TOKEN, headers=BROWSER)
        assert caught.value.metadata == {"reason": "too_large", "limit": MiB}
        assert error_answer(caught.value).body["error"]["request_id"] == "rq-browser-1"
        # Not declared (chunked): cut once the cap is passed while it streams.
        received = 0
        with pytest.raises(PayloadTooLarge):
            async with gw.stream("GET", misbehaving.url("/up/big-chunked"), token=TOKEN) as answer:
                assert "content-length" not in answer.headers
                async for chunk in answer.aiter_bytes():
                    received += len(chunk)
        assert 0 < received <= MiB
        # Within a larger cap, both pass whole.
        whole = await gw.request(
            "GET", misbehaving.url("/up/big-chunked"), token=TOKEN, max_bytes=4 * MiB
        )
        assert len(whole.content) == 2 * MiB


async def test_a_body_shorter_or_longer_than_its_content_length_is_an_error() -> None:
    async with raw_upstream() as port, gateway_for(port) as gw:
        base = f"http://upstream.test:{port}/up"
        for path in ("/short", "/long", "/drop"):
            with pytest.raises(ProviderUnavailable) as caught:
                await gw.request("GET", base + path, token=TOKEN)
            expected = "connection_lost" if path == "/drop" else "length_mismatch"
            assert caught.value.metadata["reason"] == expected, path
        # The extra bytes of /long were a whole second answer; the connection they came
        # on was dropped, so the next call gets its own answer, not that one.
        assert (await gw.request("GET", base + "/fresh", token=TOKEN)).content == b"fresh"
        failures = gw.registry.get_sample_value(
            "sandlot_gateway_body_failures_total", {"upstream": "up", "reason": "length_mismatch"}
        )
        assert failures == 2


# --- retries ----------------------------------------------------------------------------


async def test_only_idempotent_calls_are_retried(misbehaving: Misbehaving) -> None:
    url = misbehaving.url("/up/status/503")
    async with gateway_for(misbehaving, retries=2, breaker_failures=100) as gw:
        for method, kwargs, hits in (
            ("GET", {}, 3),
            ("PUT", {"content": b"x"}, 3),
            ("POST", {"content": b"x"}, 1),
            ("POST", {"content": b"x", "idempotent": True}, 3),
            ("POST", {"content": b"x", "headers": {"Idempotency-Key": "k1"}}, 3),
        ):
            before = misbehaving.hits["status/503"]
            with pytest.raises(ProviderUnavailable):
                await gw.request(method, url, token=TOKEN, **kwargs)
            assert misbehaving.hits["status/503"] - before == hits, (method, kwargs)
        # A 500 is not one to retry; a Retry-After is followed (capped).
        with pytest.raises(ProviderUnavailable):
            await gw.request("GET", misbehaving.url("/up/status/500"), token=TOKEN)
        assert misbehaving.hits["status/500"] == 1
        with pytest.raises(ProviderUnavailable) as caught:
            await gw.request("GET", url + "?retry_after=120", token=TOKEN)
        assert caught.value.retry_after == 120
        assert (
            gw.registry.get_sample_value("sandlot_gateway_retries_total", {"upstream": "up"}) == 10
        )


async def test_connect_failures_are_retried_for_idempotent_calls_only() -> None:
    port = closed_port()
    async with gateway_for(port, retries=2, breaker_failures=100) as gw:
        with pytest.raises(ProviderUnavailable) as caught:
            await gw.request("GET", f"http://upstream.test:{port}/up/x", token=TOKEN)
        assert caught.value.metadata["reason"] == "unreachable"
        assert (
            gw.registry.get_sample_value("sandlot_gateway_retries_total", {"upstream": "up"}) == 2
        )
        with pytest.raises(ProviderUnavailable):
            await gw.request("POST", f"http://upstream.test:{port}/up/x", token=TOKEN)
        assert (
            gw.registry.get_sample_value("sandlot_gateway_retries_total", {"upstream": "up"}) == 2
        )


# --- the breaker ------------------------------------------------------------------------


async def test_breaker_opens_after_failures_then_a_trial_closes_it(
    misbehaving: Misbehaving,
) -> None:
    clock = FakeClock()
    url = misbehaving.url("/up/flaky")
    settings = {"retries": 0, "breaker_failures": 3, "breaker_cool_down": 10.0}
    async with gateway_for(misbehaving, clock=clock, **settings) as gw:
        assert gw.states() == {"up": "closed"}
        misbehaving.failing = True
        for _ in range(3):
            with pytest.raises(ProviderUnavailable) as caught:
                await gw.request("GET", url, token=TOKEN)
            assert caught.value.metadata["reason"] == "upstream_status"
        assert gw.states() == {"up": "open"}
        state = {"upstream": "up", "state": "open"}
        assert gw.registry.get_sample_value("sandlot_gateway_breaker_state", state) == 1
        # Open: refused at once, retryable, with the cool-down left as Retry-After.
        clock.now += 4
        with pytest.raises(ProviderUnavailable) as caught:
            await gw.request("GET", url, token=TOKEN)
        assert caught.value.metadata["reason"] == "circuit_open"
        assert caught.value.retry_after == pytest.approx(6)
        assert error_answer(caught.value).headers["Retry-After"] == "6"
        assert misbehaving.hits["flaky"] == 3
        # Half-open: one trial (the version check comes first again); it fails: open again.
        misbehaving.failing_version = True
        clock.now += 6
        assert gw.states() == {"up": "half-open"}
        versions = misbehaving.hits["version"]
        with pytest.raises(ProviderUnavailable):
            await gw.request("GET", url, token=TOKEN)
        assert misbehaving.hits["version"] == versions + 1 and gw.states() == {"up": "open"}
        # Cool-down again, the upstream is back: the trial succeeds and closes it.
        misbehaving.failing = misbehaving.failing_version = False
        clock.now += 10
        assert gw.states() == {"up": "half-open"}
        assert (await gw.request("GET", url, token=TOKEN)).json() == {"ok": True}
        assert gw.states() == {"up": "closed"}
        assert misbehaving.hits["version"] == versions + 2 and misbehaving.hits["flaky"] == 4


async def test_the_dataplanes_own_5xx_envelope_does_not_open_the_breaker(
    misbehaving: Misbehaving,
) -> None:
    # A 5xx in the dataplane's own envelope says its host is up (one sandbox failing);
    # only answers that do not come from the dataplane itself count.
    async with gateway_for(misbehaving, retries=0, breaker_failures=2) as gw:
        for _ in range(3):
            with pytest.raises(ProviderUnavailable) as caught:
                await gw.request("GET", misbehaving.url("/up/own-503"), token=TOKEN)
            assert caught.value.metadata["upstream_status"] == 503
        assert gw.states() == {"up": "closed"}
        for _ in range(2):
            with pytest.raises(ProviderUnavailable):
                await gw.request("GET", misbehaving.url("/up/status/503"), token=TOKEN)
        assert gw.states() == {"up": "open"}


# --- envelopes --------------------------------------------------------------------------


async def test_upstream_failures_become_envelopes_without_body_or_token(
    misbehaving: Misbehaving, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with raw_upstream() as raw_port:
        raw = gateway_for(raw_port, retries=0)
        gw = gateway_for(misbehaving, retries=0, read_timeout=0.5, breaker_failures=100)
        async with raw, gw:
            cases = [
                (gw, misbehaving.url("/up/status/503?retry_after=7"), "upstream_status"),
                (gw, misbehaving.url("/up/status/502"), "upstream_status"),
                (gw, misbehaving.url("/up/slow"), "timeout"),
                (raw, f"http://upstream.test:{raw_port}/up/drop", "connection_lost"),
                (gw, f"http://upstream.test:{closed_port()}/up/x", None),
            ]
            answers = []
            for gateway, url, reason in cases:
                if reason is None:  # not allowlisted: the port differs
                    with pytest.raises(Forbidden) as forbidden:
                        await gateway.request("GET", url, token=TOKEN, headers=BROWSER)
                    answers.append(wire(forbidden.value))
                    continue
                with pytest.raises(ProviderUnavailable) as caught:
                    await gateway.request("GET", url, token=TOKEN, headers=BROWSER)
                assert caught.value.metadata["reason"] == reason, url
                answer = error_answer(caught.value)
                assert answer.status == 503
                error = answer.body["error"]
                assert error["code"] == "PROVIDER_UNAVAILABLE" and error["retryable"] is True
                assert error["request_id"] == "rq-browser-1"
                answers.append(wire(caught.value))
            assert (
                error_answer(ProviderUnavailable("x", retry_after=7)).headers["Retry-After"] == "7"
            )
    said = "\n".join(answers)
    for secret in (UPSTREAM_SECRET, TOKEN, "browser-credential", "browser-cookie", "upstream.test"):
        assert secret not in said
    # Never a token in a log line.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "upstream up" in logged
    for secret in (TOKEN, "browser-credential", "browser-cookie"):
        assert secret not in logged
    # Anything else (a bug) reaches the browser as a bare INTERNAL.
    answer = error_answer(RuntimeError(f"boom {TOKEN}"), "rq-1")
    assert answer.status == 500 and TOKEN not in json.dumps(answer.body)


async def test_an_upstream_4xx_envelope_keeps_only_what_is_trusted(
    misbehaving: Misbehaving,
) -> None:
    async with gateway_for(misbehaving) as gw:
        with pytest.raises(FileNotFound) as caught:
            await gw.request("GET", misbehaving.url("/up/envelope"), token=TOKEN, headers=BROWSER)
        error = error_answer(caught.value).body["error"]
        assert error["code"] == "FILE_NOT_FOUND" and error["message"] == "no such file: notes.txt"
        assert error["metadata"] == {"path": "notes.txt"}
        assert error["request_id"] == "rq-browser-1"
        assert UPSTREAM_SECRET not in wire(caught.value)
        # A 4xx that is not the dataplane's envelope: the status's class, no body.
        with pytest.raises(InvalidRequest) as caught:
            await gw.request("GET", misbehaving.url("/up/status/418"), token=TOKEN)
        assert caught.value.message == "the sandbox host answered 418"
        assert UPSTREAM_SECRET not in wire(caught.value)
        assert gw.states() == {"up": "closed"}


# --- the version check ------------------------------------------------------------------


async def test_an_incompatible_api_version_fails_fast_with_a_diagnostic(
    misbehaving: Misbehaving,
) -> None:
    misbehaving.api_version = "2.0"
    async with gateway_for(misbehaving) as gw:
        for _ in range(2):
            with pytest.raises(ProviderUnavailable) as caught:
                await gw.request("GET", misbehaving.url("/up/echo"), token=TOKEN)
            assert caught.value.metadata["reason"] == "api_version"
            assert "api_version 2.0" in caught.value.message and "speaks 1" in caught.value.message
            assert caught.value.metadata["upstream_api_version"] == "2.0"
        # Asked once; the calls never reached the data path.
        assert misbehaving.hits["version"] == 1 and misbehaving.hits["echo"] == 0
    misbehaving.api_version, misbehaving.version_status = "1", 404
    async with gateway_for(misbehaving) as gw:
        with pytest.raises(ProviderUnavailable) as caught:
            await gw.websocket(misbehaving.url("/up/ws"), token=TOKEN)
        assert "did not answer GET __meta/version as a sandlot dataplane" in caught.value.message


# --- the real dataplane -----------------------------------------------------------------


def dataplane_gateway(server: SandlotServer, **settings: Any) -> Gateway:
    return Gateway(
        [Upstream("dp", f"{server.url}/dp", ("/dp/",))],
        GatewaySettings(**settings),
    )


async def test_calls_to_the_real_dataplane(dataplane: tuple[SandlotServer, Grant]) -> None:
    server, grant = dataplane
    base = grant.http_base_url
    async with dataplane_gateway(server) as gw:
        # The browser's own Authorization is dropped: the gateway's token is the one used.
        body = json.dumps({"path": "gw.txt", "content": "through the gateway"}).encode()
        headers = {**BROWSER, "Content-Type": "application/json"}
        wrote = await gw.request(
            "PUT", f"{base}/fs/write", token=grant.token, headers=headers, content=body
        )
        assert wrote.json()["etag"]
        read = await gw.request("GET", f"{base}/fs/read?path=gw.txt", token=grant.token)
        assert read.json()["content"] == "through the gateway"
        async with gw.stream("GET", f"{base}/files/download?path=gw.txt", token=grant.token) as dl:
            assert dl.headers["content-length"] == "19"
            assert await dl.aread() == b"through the gateway"
        with pytest.raises(FileNotFound) as caught:
            await gw.request(
                "GET", f"{base}/fs/read?path=missing.txt", token=grant.token, headers=BROWSER
            )
        assert caught.value.request_id == "rq-browser-1"
        assert error_answer(caught.value).body["error"]["request_id"] == "rq-browser-1"
        # Outside the allowlisted prefix: the broker's API on the same port is not reachable.
        with pytest.raises(Forbidden):
            await gw.request("GET", f"{server.url}/v1/sandbox/sessions", token=grant.token)
        assert gw.states() == {"dp": "closed"}
        ok = {"upstream": "dp", "method": "GET", "outcome": "200"}
        assert gw.registry.get_sample_value("sandlot_gateway_requests_total", ok) >= 2


async def test_websocket_relay_round_trip_to_the_real_dataplane(
    dataplane: tuple[SandlotServer, Grant],
) -> None:
    server, grant = dataplane
    ends: list[RelayEnd] = []
    ended = asyncio.Event()
    async with dataplane_gateway(server) as gw:

        async def exec_socket(ws: WebSocket) -> None:
            await ws.accept()
            try:
                upstream = await gw.websocket(
                    f"{grant.ws_base_url}/exec/ws", token=grant.token, headers=ws.headers
                )
            except SandlotError as exc:
                await ws.close(4000, exc.message)
                return
            ends.append(await relay(ws, upstream, queue_frames=4))
            ended.set()

        app = Starlette(routes=[WebSocketRoute("/ws/exec", exec_socket)])
        async with serving(app) as port:
            frames: list[dict[str, Any]] = []
            async with connect(
                f"ws://127.0.0.1:{port}/ws/exec",
                origin="http://evil.example",
                additional_headers={"Cookie": "workspace_session=1", "Authorization": "Bearer no"},
            ) as browser:
                await browser.send(json.dumps({"type": "start", "command": "echo relay-$((40+2))"}))
                async for message in browser:
                    frames.append(json.loads(message))
                    if frames[-1]["type"] in ("exit", "error"):
                        break
            await asyncio.wait_for(ended.wait(), 10)
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "ready" and kinds[-1] == "exit", frames
    assert frames[-1]["exit_code"] == 0
    assert "relay-42" in "".join(f.get("data", "") for f in frames if f["type"] == "stdout")
    assert ends and ends[0].closed_by in ("browser", "upstream")


async def test_long_lived_streams_have_connections_of_their_own(
    dataplane: tuple[SandlotServer, Grant],
) -> None:
    """Event streams stay open as long as their browsers: each has a connection of its
    own, at most ``max_streams`` (one more is refused), so the short calls keep their
    pool (one connection here); a closed stream frees its slot."""
    server, grant = dataplane
    events = f"{grant.http_base_url}/events?after=0&tail=0"
    settings = {"max_connections": 1, "pool_timeout": 2.0, "max_streams": 2}
    async with dataplane_gateway(server, **settings) as gw, contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            answer = await stack.enter_async_context(
                gw.stream("GET", events, token=grant.token, long_lived=True)
            )
            assert await anext(answer.aiter_bytes())
        assert gw.streams_open == 2
        with pytest.raises(ProviderUnavailable) as caught:
            async with gw.stream("GET", events, token=grant.token, long_lived=True):
                pass
        assert caught.value.metadata["reason"] == "streams"
        read = await gw.request(
            "GET", f"{grant.http_base_url}/fs/list?path=/workspace", token=grant.token
        )
        assert read.status_code == 200
        # A short call's stream left half-read (its request cancelled) drops its
        # connection: the pool's one connection is free for the next call.
        async with anyio.create_task_group() as tasks:
            first = anyio.Event()

            async def read_on() -> None:
                async with gw.stream("GET", events, token=grant.token) as answer:
                    async for _ in answer.aiter_bytes():
                        first.set()

            tasks.start_soon(read_on)
            await first.wait()
            tasks.cancel_scope.cancel()
        read = await gw.request(
            "GET", f"{grant.http_base_url}/fs/list?path=/workspace", token=grant.token
        )
        assert read.status_code == 200
        await stack.aclose()
        assert gw.streams_open == 0
        async with gw.stream("GET", events, token=grant.token, long_lived=True) as answer:
            assert await anext(answer.aiter_bytes())

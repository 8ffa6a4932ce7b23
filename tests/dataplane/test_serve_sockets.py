"""WebSockets of a real ``sandlot serve``: who may create a shell, how many sockets a token and a
sandbox may hold, and the dataplane's figures at ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from tests.servers import SandlotServer, running

PER_TOKEN = 3
PER_SANDBOX = 5

CONFIG = """
[quotas]
max_live_sandboxes_per_user = 1000
negotiation_rate_per_second = 100000
negotiation_burst = 100000
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    env = {
        "SANDLOT_DP_MAX_WEBSOCKETS_PER_TOKEN": str(PER_TOKEN),
        "SANDLOT_DP_MAX_WEBSOCKETS_PER_SANDBOX": str(PER_SANDBOX),
    }
    with running(tmp_path_factory.mktemp("ws") / "d", config=CONFIG, env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def alice(server: SandlotServer) -> dict[str, str]:
    return server.headers("alice")


def negotiate(
    srv: SandlotServer, headers: dict[str, str], thread: str, caps: list[str] | None = None
) -> dict[str, Any]:
    """A grant for the thread's sandbox, once that sandbox is active."""
    body: dict[str, Any] = {"scope": {"type": "thread", "id": thread}, "mode": "ensure"}
    if caps is not None:
        body["requested_capabilities"] = caps
    r = httpx.post(f"{srv.url}/v1/sandbox/sessions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    grant: dict[str, Any] = r.json()
    deadline = time.monotonic() + 60
    while grant["binding"]["state"] != "active":
        assert time.monotonic() < deadline, grant
        time.sleep(0.1)
        snap = httpx.get(
            f"{srv.url}/v1/sandbox/sessions/{grant['session_id']}", headers=headers
        ).json()
        grant["binding"] = snap["binding"]
    return grant


def bearer(grant: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {grant['token']}"}


async def closed_with(
    url: str, headers: dict[str, str] | None = None, frame: dict[str, Any] | None = None
) -> tuple[int, str, list[dict[str, Any]]]:
    """Connect, maybe send one frame, read until the server closes: (code, reason, frames)."""
    frames: list[dict[str, Any]] = []
    async with websockets.connect(url, additional_headers=headers or {}) as ws:
        if frame is not None:
            with contextlib.suppress(websockets.ConnectionClosed):  # closed before it was sent
                await ws.send(json.dumps(frame))
        with pytest.raises(websockets.ConnectionClosed) as info:
            while True:
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    assert info.value.rcvd is not None, "the server did not close the socket"
    return info.value.rcvd.code, info.value.rcvd.reason, frames


# --- observers never create ---------------------------------------------------------------


def test_observer_never_creates_a_shell(server: SandlotServer, alice: dict[str, str]) -> None:
    full = negotiate(server, alice, "thr_observe")
    watcher = negotiate(server, alice, "thr_observe", ["shell_observe"])
    assert watcher["credentials"]["granted_capabilities"] == ["shell_observe"]
    ws_base = full["dataplane"]["ws_base_url"]
    dp = full["dataplane"]["http_base_url"]

    def shell_names() -> list[str]:
        r = httpx.get(f"{dp}/shells", headers=bearer(watcher))
        assert r.status_code == 200, r.text
        return sorted(s["name"] for s in r.json()["shells"])

    async def run() -> None:
        for query in ("session=new&role=observer", "session=new&role=observer&create=true"):
            code, reason, frames = await closed_with(f"{ws_base}/shell/ws?{query}", bearer(watcher))
            assert code == 4404, (code, reason, frames)
            assert frames[-1]["type"] == "error" and frames[-1]["code"] == "NOT_FOUND"
        # Holding ``shell`` does not make an observer a creator either.
        code, _, _ = await closed_with(
            f"{ws_base}/shell/ws?session=new2&role=observer", bearer(full)
        )
        assert code == 4404
        # Nor does the auth frame instead of the header.
        code, _, _ = await closed_with(
            f"{ws_base}/shell/ws?session=new3&role=observer",
            frame={"type": "auth", "token": watcher["token"]},
        )
        assert code == 4404
        assert shell_names() == []
        # An observer can neither drive nor start commands on any exec route.
        for path, frame in (
            ("/shell/ws?session=new&role=driver", None),
            ("/exec/ws", {"type": "start", "command": "true"}),
            ("/execute/ws", {"type": "execute", "command": "true"}),
        ):
            code, _, _ = await closed_with(f"{ws_base}{path}", bearer(watcher), frame)
            assert code == 4403, path
        assert shell_names() == []
        # A driver creates; then the observer watches that shell.
        async with websockets.connect(
            f"{ws_base}/shell/ws?session=s1&role=driver&profile=sh", additional_headers=bearer(full)
        ) as driver:
            assert json.loads(await driver.recv())["type"] == "session"
            async with websockets.connect(
                f"{ws_base}/shell/ws?session=s1&role=observer", additional_headers=bearer(watcher)
            ) as observer:
                first = json.loads(await asyncio.wait_for(observer.recv(), 10))
                assert first["type"] == "session" and first["role"] == "observer"
        assert shell_names() == ["s1"]

    asyncio.run(run())


# --- WebSocket limits ---------------------------------------------------------------------


class Sockets:
    """Open sockets of a test, each proven open by a ping answered with a pong."""

    def __init__(self, ws_base: str) -> None:
        self.ws_base = ws_base
        self.open: list[Any] = []

    async def connect(self, route: str, grant: dict[str, Any], *, header: bool = True) -> Any:
        headers = bearer(grant) if header else {}
        ws = await websockets.connect(f"{self.ws_base}{route}", additional_headers=headers)
        if not header:
            await ws.send(json.dumps({"type": "auth", "token": grant["token"]}))
        if route.startswith("/exec"):
            await ws.send(json.dumps({"type": "start", "command": "sleep 60"}))
        elif route.startswith("/execute"):
            await ws.send(json.dumps({"type": "execute", "command": "sleep 60"}))
        await ws.send(json.dumps({"type": "ping"}))
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if frame.get("type") == "pong":
                break
        self.open.append(ws)
        return ws

    async def refused(self, route: str, grant: dict[str, Any], *, header: bool = True) -> str:
        frame = None if header else {"type": "auth", "token": grant["token"]}
        code, reason, frames = await closed_with(
            f"{self.ws_base}{route}", bearer(grant) if header else None, frame
        )
        assert code == 4429, (code, reason, frames)
        assert [f["type"] for f in frames] == ["error"], frames  # no auth_ok first
        assert frames[-1]["code"] == "RATE_LIMITED"
        assert frames[-1]["retryable"] is True
        return reason

    async def close_all(self) -> None:
        for ws in self.open:
            await ws.close()
        self.open.clear()


ROUTES = ["/events/ws", "/shell/ws?session=lim&profile=sh", "/exec/ws", "/execute/ws"]


def test_websocket_limits_per_token_and_per_sandbox(
    server: SandlotServer, alice: dict[str, str]
) -> None:
    a = negotiate(server, alice, "thr_limits")
    b = negotiate(server, alice, "thr_limits")
    assert a["sandbox"]["id"] == b["sandbox"]["id"] and a["token"] != b["token"]
    sockets = Sockets(a["dataplane"]["ws_base_url"])

    async def run() -> None:
        # One token: PER_TOKEN sockets, whatever the route; the next one is refused.
        for i in range(PER_TOKEN):
            await sockets.connect(ROUTES[i % len(ROUTES)], a, header=i % 2 == 0)
        for route in ROUTES:
            assert "token" in await sockets.refused(route, a)
        assert "token" in await sockets.refused("/events/ws", a, header=False)
        # The sandbox: PER_SANDBOX sockets of all its tokens together.
        for i in range(PER_SANDBOX - PER_TOKEN):
            await sockets.connect(ROUTES[(i + 1) % len(ROUTES)], b)
        for route in ROUTES:
            assert "sandbox" in await sockets.refused(route, b)
        # A socket that ends gives its place back.
        await sockets.open.pop(0).close()
        await eventually(lambda: sockets.connect("/execute/ws", b))
        assert "sandbox" in await sockets.refused("/events/ws", b)
        await sockets.close_all()

        # No leak: sockets ended every way there is, many times over the limits.
        ws_base = sockets.ws_base
        for i in range(3 * PER_SANDBOX):
            route = ROUTES[i % len(ROUTES)]
            ws = await sockets.connect(route, a if i % 2 else b)
            await ws.close()
            sockets.open.clear()
            # Refused credentials, an unknown shell, a command that ends by itself.
            code, _, _ = await closed_with(f"{ws_base}{route}", {"Authorization": "Bearer x"})
            assert code == 4401
            code, _, _ = await closed_with(
                f"{ws_base}/shell/ws?session=none&create=false", bearer(a)
            )
            assert code == 4404
            code, _, frames = await closed_with(
                f"{ws_base}/exec/ws", bearer(b), {"type": "start", "command": "true"}
            )
            assert code == 1000 and frames[-1]["type"] == "exit"
            # Dropped without a close frame.
            raw = await websockets.connect(f"{ws_base}/events/ws", additional_headers=bearer(a))
            raw.transport.abort()
        # Every place is free again.
        await eventually(lambda: fill(sockets, a, b))
        assert "sandbox" in await sockets.refused("/events/ws", b)
        await sockets.close_all()

    asyncio.run(run())


def test_event_streams_count_like_websockets(server: SandlotServer, alice: dict[str, str]) -> None:
    """``GET /events`` (SSE) holds a connection as long as a WebSocket does: it takes a
    place, is refused with 429 beyond the limits, and gives the place back when it ends."""
    grant = negotiate(server, alice, "thr_sse_limits")
    url = f"{grant['dataplane']['http_base_url']}/events"

    async def run() -> None:
        async with httpx.AsyncClient(headers=bearer(grant), timeout=10) as client:
            streams = []
            for _ in range(PER_TOKEN):
                stream = client.stream("GET", url)
                response = await stream.__aenter__()
                assert response.status_code == 200
                streams.append(stream)
            refused = await client.get(url)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "RATE_LIMITED"
            assert "token" in refused.json()["error"]["message"]
            # WebSockets and streams share the token's places.
            sockets = Sockets(grant["dataplane"]["ws_base_url"])
            assert "token" in await sockets.refused("/events/ws", grant)
            await streams.pop().__aexit__(None, None, None)

            async def one_more() -> None:
                response = await client.get(url, params={"after": "x"})  # 400, not 429
                assert response.status_code == 400, response.text
                stream = client.stream("GET", url)
                opened = await stream.__aenter__()
                if opened.status_code != 200:
                    await stream.__aexit__(None, None, None)
                    raise AssertionError(opened.status_code)
                streams.append(stream)

            await eventually(one_more)
            for stream in streams:
                await stream.__aexit__(None, None, None)
        # Every place given back: the token's and the sandbox's all open again.
        other = negotiate(server, alice, "thr_sse_limits")
        sockets = Sockets(grant["dataplane"]["ws_base_url"])
        await eventually(lambda: fill(sockets, grant, other))
        await sockets.close_all()

    asyncio.run(run())


async def fill(sockets: Sockets, a: dict[str, Any], b: dict[str, Any]) -> None:
    try:
        for i in range(PER_TOKEN):
            await sockets.connect(ROUTES[i], a)
        for i in range(PER_SANDBOX - PER_TOKEN):
            await sockets.connect(ROUTES[i], b)
    except BaseException:
        await sockets.close_all()
        raise


async def eventually(attempt: Any, timeout: float = 5.0) -> None:
    """A socket's place is given back when the server has seen it end: retry until then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await attempt()
            return
        except (websockets.ConnectionClosed, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_sockets_awaiting_their_auth_frame_are_limited(
    server: SandlotServer, alice: dict[str, str]
) -> None:
    """Sockets that have not authenticated yet hold places as one token of their own does,
    so that nobody without a token can take the sandbox's places."""
    a = negotiate(server, alice, "thr_pending")
    ws_base = a["dataplane"]["ws_base_url"]

    async def run() -> None:
        pending = [await websockets.connect(f"{ws_base}/events/ws") for _ in range(PER_TOKEN)]
        code, reason, _ = await closed_with(f"{ws_base}/events/ws")
        assert code == 4429 and "authenticat" in reason
        # A client with credentials in its header is not held back by them.
        sockets = Sockets(ws_base)
        await sockets.connect("/events/ws", a)
        await sockets.close_all()
        for ws in pending:
            await ws.close()

    asyncio.run(run())


# --- metrics ------------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{.*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    assert found, f"{name}{labels} not in /metrics"
    return total


def test_dataplane_metrics_at_the_broker(server: SandlotServer, alice: dict[str, str]) -> None:
    g = negotiate(server, alice, "thr_metrics")
    dp = g["dataplane"]["http_base_url"]
    ws_base = g["dataplane"]["ws_base_url"]
    sid = g["sandbox"]["id"]

    def scrape() -> str:
        r = httpx.get(f"{server.url}/metrics")
        assert r.status_code == 200
        return r.text

    before = scrape()
    for _ in range(3):
        assert httpx.get(f"{dp}/fs/stat?path=.", headers=bearer(g)).status_code == 200
    assert httpx.get(f"{dp}/fs/stat?path=missing", headers=bearer(g)).status_code == 404
    assert httpx.get(f"{dp}/execs/ex_missing", headers=bearer(g)).status_code == 404
    assert httpx.get(f"{server.url}/dp/{sid}/v1/nowhere", headers=bearer(g)).status_code == 404
    after = scrape()

    def grew(name: str, by: float, **labels: str) -> None:
        try:
            old = metric(before, name, **labels)
        except AssertionError:
            old = 0.0
        assert metric(after, name, **labels) - old >= by, (name, labels)

    grew("sandlot_dataplane_requests_total", 3, method="GET", route="/fs/stat", status="200")
    grew("sandlot_dataplane_requests_total", 1, method="GET", route="/fs/stat", status="404")
    grew(
        "sandlot_dataplane_requests_total", 1, method="GET", route="/execs/{exec_id}", status="404"
    )
    grew("sandlot_dataplane_requests_total", 1, route="unmatched", status="404")
    grew("sandlot_dataplane_request_duration_seconds_count", 4, method="GET", route="/fs/stat")
    grew("sandlot_errors_total", 1, code="FILE_NOT_FOUND")
    grew("sandlot_errors_total", 1, code="EXEC_NOT_FOUND")

    async def run() -> None:
        async with (
            websockets.connect(f"{ws_base}/exec/ws", additional_headers=bearer(g)) as ex,
            websockets.connect(
                f"{ws_base}/shell/ws?session=m&profile=sh", additional_headers=bearer(g)
            ) as sh,
        ):
            await ex.send(json.dumps({"type": "start", "command": "sleep 30"}))
            assert json.loads(await ex.recv())["type"] == "ready"
            assert json.loads(await sh.recv())["type"] == "session"
            text = await asyncio.to_thread(scrape)
            assert metric(text, "sandlot_dataplane_websockets", route="/exec/ws") >= 1
            assert metric(text, "sandlot_dataplane_websockets", route="/shell/ws") >= 1
            assert metric(text, "sandlot_dataplane_execs_running") >= 1
            assert metric(text, "sandlot_dataplane_shells") >= 1
            await ex.send(json.dumps({"type": "kill"}))
        deadline = time.monotonic() + 5
        while metric(await asyncio.to_thread(scrape), "sandlot_dataplane_websockets") > 0:
            assert time.monotonic() < deadline, "open WebSockets never went back to 0"
            await asyncio.sleep(0.1)

    asyncio.run(run())

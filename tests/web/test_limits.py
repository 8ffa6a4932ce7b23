"""The limits of the routes that walk the workspace (``/api/tree``, ``/api/search``,
``/api/v1/grep``) and of the terminal sockets, read from the settings, and the web
server's own metrics at ``/api/metrics``: the same in both modes.

``local``: the web app in this process over a temporary folder, its budgets given in its
settings; ``sandbox``: a real ``sandlot serve``, its budgets given in the environment
(``SANDLOT_WEB_…``). A browser signs in with a real API key; the budgets refill so
slowly (one token in 1000 s) that a refused request stays refused whatever the machine's
speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sandlot.broker.keys import KeyService
from sandlot.broker.store import Store
from sandlot.protocol.common import PrincipalType
from sandlot.protocol.errors import RateLimited
from sandlot.sdk import Sandlot
from sandlot.web.app import create_web_app
from sandlot.web.limits import RouteGate, RouteLimits, SocketLimits, Walk
from sandlot.web.live import live_routes
from sandlot.web.settings import ConfigError, WebSettings, WorkspaceMode, load_web_settings
from tests.servers import SandlotServer
from tests.web.browser import Browser
from tests.web.conftest import Clock, ThreadedServer, login_with_key

THREAD = "thr_limits"
BUDGETS = {
    "SANDLOT_WEB_TREE_BURST": "3",
    "SANDLOT_WEB_TREE_PER_SECOND": "0.001",
    "SANDLOT_WEB_SEARCH_BURST": "2",
    "SANDLOT_WEB_SEARCH_PER_SECOND": "0.001",
    "SANDLOT_WEB_WS_USER_CONNECT_BURST": "2",
    "SANDLOT_WEB_WS_USER_CONNECTS_PER_SECOND": "0.001",
}
USERS = ("ada", "bob", "cy", "dee")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@dataclass
class Served:
    """A web app in one mode: how to sign a user in, and what its server logged."""

    mode: str
    base: str
    #: (client, CSRF token, session cookie) of a user signed in with an API key.
    sign_in: Callable[[str], tuple[httpx.Client, str, str]]
    logs: Callable[[], str]
    #: The workspace each user works on (``?thread=``; ignored in local mode).
    threads: dict[str, str]


def _local(tmp: Path) -> Iterator[Served]:
    root = tmp / "folder"
    root.mkdir()
    (root / "notes.md").write_text("needle\n")
    store = Store(f"sqlite:///{tmp / 'keys.db'}")
    store.migrate()
    keys = KeyService(store)
    settings = load_web_settings(
        BUDGETS,
        mode=WorkspaceMode.LOCAL,
        root=root,
        local_users=frozenset(USERS),
        data_dir=tmp / "data",
    )
    lines = Lines()
    rootlog = logging.getLogger()
    level = rootlog.level
    rootlog.addHandler(lines)
    rootlog.setLevel(logging.INFO)
    app = create_web_app(
        settings, broker_url=None, authenticator=keys, extra_routes=live_routes(settings)
    )
    server = ThreadedServer(app).start()
    clients: list[httpx.Client] = []

    def sign_in(user: str) -> tuple[httpx.Client, str, str]:
        key, _ = keys.create(user_id=user, principal_type=PrincipalType.HUMAN)
        client, csrf, cookie = login_with_key(server.url, key, [])
        clients.append(client)
        return client, csrf, cookie

    try:
        yield Served("local", server.url, sign_in, lambda: "\n".join(lines.lines), {})
    finally:
        for client in clients:
            client.close()
        server.stop()
        rootlog.removeHandler(lines)
        rootlog.setLevel(level)
        store.dispose()


def _sandbox(tmp: Path) -> Iterator[Served]:
    server = SandlotServer(tmp / "d", env=BUDGETS).start()
    clients: list[Any] = []
    threads = {user: f"{THREAD}_{user}" for user in USERS}

    def sign_in(user: str) -> tuple[httpx.Client, str, str]:
        key = server.key(user)
        sdk = Sandlot(server.url, key, auto_refresh=False)
        clients.append(sdk)
        sdk.ensure(threads[user]).write("/workspace/notes.md", "needle\n")
        client, csrf, cookie = login_with_key(server.url, key, [])
        clients.append(client)
        return client, csrf, cookie

    try:
        yield Served("sandbox", server.url, sign_in, lambda: "".join(server.output), threads)
    finally:
        for client in clients:
            client.close()
        server.stop()
        server.cleanup()


@pytest.fixture(scope="module", params=["local", "sandbox"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp(f"limits-{request.param}")
    make = _local if request.param == "local" else _sandbox
    yield from make(tmp)


def _get(served: Served, client: httpx.Client, user: str, route: str, **params: Any) -> Any:
    thread = served.threads.get(user)
    return client.get(route, params={**({"thread": thread} if thread else {}), **params})


def _refused(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 429, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["code"] == "RATE_LIMITED" and error["retryable"] is True
    assert error["request_id"] == r.headers["x-request-id"]
    return dict(error)


def test_walking_routes_spend_each_users_budget(served: Served) -> None:
    ada, _, _ = served.sign_in("ada")
    for _ in range(3):
        r = _get(served, ada, "ada", "/api/tree", path=".")
        assert r.status_code == 200, r.text
    error = _refused(_get(served, ada, "ada", "/api/tree", path="."))
    assert "tree" in error["message"]
    # Refused before anything is asked of the workspace: even a bad path is 429 now.
    _refused(_get(served, ada, "ada", "/api/tree", path="../.."))
    # Search and grep share one budget, apart from the tree's.
    assert _get(served, ada, "ada", "/api/search", q="*.md").status_code == 200
    assert _get(served, ada, "ada", "/api/v1/grep", q="needle").status_code == 200
    _refused(_get(served, ada, "ada", "/api/search", q="*.md"))
    _refused(_get(served, ada, "ada", "/api/v1/grep", q="needle"))
    # Other routes are not limited.
    r = _get(served, ada, "ada", "/api/file", path="notes.md")
    assert r.status_code == 200 and r.json()["content"] == "needle\n"
    # Another user has a budget of their own.
    bob, _, _ = served.sign_in("bob")
    assert _get(served, bob, "bob", "/api/tree", path=".").status_code == 200
    assert _get(served, bob, "bob", "/api/search", q="*.md").status_code == 200
    logs = served.logs()
    metrics = scrape(ada)
    for route, refused in (("/api/tree", 2), ("/api/search", 1), ("/api/v1/grep", 1)):
        assert metrics[("sandlot_web_route_limited_total", (("route", route),))] == refused
    assert metrics[("sandlot_web_ready", ())] == 1
    assert "/api/tree refused for ada: over its rate limit" in logs
    assert "/api/v1/grep refused for ada: over its rate limit" in logs
    assert "refused for bob" not in logs


async def test_socket_limits_come_from_the_settings(served: Served) -> None:
    client, csrf, cookie = served.sign_in("cy")
    browser = Browser(served.base, None, cookie, csrf)
    thread = served.threads.get("cy")
    for _ in range(2):
        async with browser.socket(thread=thread) as sock:
            assert (await sock.frame())["type"] == "session"
            open_now = scrape(client)[("sandlot_web_sockets_open", (("channel", "pty"),))]
            assert open_now >= 1
    async with browser.socket(thread=thread) as sock:
        code, frames = await sock.closed()
    assert code == 4429
    assert frames[0]["error"]["code"] == "RATE_LIMITED"
    # Counted once the server has closed its side (it may finish after the browser).
    await eventually(
        client,
        {
            ("sandlot_web_socket_disconnects_total", (("channel", "pty"), ("side", "browser"))): 2,
            ("sandlot_web_socket_disconnects_total", (("channel", "pty"), ("side", "limit"))): 1,
            (
                "sandlot_web_attach_failures_total",
                (("channel", "pty"), ("reason", "rate_limited")),
            ): 1,
            ("sandlot_web_sockets_open", (("channel", "pty"),)): 0,
        },
    )


async def test_chat_sockets_are_counted_apart(served: Served) -> None:
    client, csrf, cookie = served.sign_in("dee")
    browser = Browser(served.base, None, cookie, csrf)
    async with browser.socket(
        "/ws/claude-stream", thread=served.threads.get("dee"), provider="nope"
    ) as sock:
        code, _ = await sock.closed()
    assert code == 4003
    await eventually(
        client,
        {
            (
                "sandlot_web_attach_failures_total",
                (("channel", "chat"), ("reason", "unknown_provider")),
            ): 1,
            ("sandlot_web_socket_disconnects_total", (("channel", "chat"), ("side", "server"))): 1,
            ("sandlot_web_sockets_open", (("channel", "chat"),)): 0,
        },
    )


def test_readiness_is_exported_as_readyz_answers(tmp_path: Path) -> None:
    root = tmp_path / "folder"
    root.mkdir()
    settings = WebSettings(
        mode=WorkspaceMode.LOCAL, root=root, local_users=frozenset({"ada"}), data_dir=tmp_path
    )
    registry = CollectorRegistry()
    app = create_web_app(settings, broker_url=None, authenticator=None, registry=registry)
    # The local dataplane starts with the app's lifespan: not ready before.
    assert registry.get_sample_value("sandlot_web_ready") == 0
    server = ThreadedServer(app).start()
    try:
        ready = httpx.get(f"{server.url}/api/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        metrics = parse(httpx.get(f"{server.url}/api/metrics").text)
        assert metrics[("sandlot_web_ready", ())] == 1
    finally:
        server.stop()
    assert registry.get_sample_value("sandlot_web_ready") == 0


# --- metrics as a scraper reads them --------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(client: httpx.Client) -> Samples:
    r = client.get("/api/metrics")
    assert r.status_code == 200, r.text
    return parse(r.text)


async def eventually(client: httpx.Client, expected: Samples) -> None:
    """Scrape until every sample in ``expected`` has its value (or fail after 30 s)."""
    seen: Samples = {}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while True:
                seen = await asyncio.to_thread(scrape, client)
                if all(seen.get(key, 0) == value for key, value in expected.items()):
                    return
                await asyncio.sleep(0.05)
    assert {key: seen.get(key, 0) for key in expected} == expected


# --- the budgets themselves -----------------------------------------------------------


def test_a_route_budget_refills_and_says_when() -> None:
    clock = Clock()
    gate = RouteGate(RouteLimits(tree_burst=2, tree_per_second=0.5), clock=clock)
    gate.admit(Walk.TREE, "ada")
    gate.admit(Walk.TREE, "ada")
    with pytest.raises(RateLimited) as refused:
        gate.admit(Walk.TREE, "ada")
    assert refused.value.retry_after == pytest.approx(2.0)
    clock.advance(1.5)
    with pytest.raises(RateLimited) as refused:
        gate.admit(Walk.TREE, "ada")
    assert refused.value.retry_after == pytest.approx(0.5)
    clock.advance(0.5)
    gate.admit(Walk.TREE, "ada")
    # The search budget is another one.
    gate.admit(Walk.SEARCH, "ada")


def test_route_limits_from_the_environment() -> None:
    assert load_web_settings({}).route_limits == RouteLimits()
    settings = load_web_settings(BUDGETS)
    assert settings.route_limits == RouteLimits(
        tree_burst=3, tree_per_second=0.001, search_burst=2, search_per_second=0.001
    )
    for name, raw, says in [
        ("SANDLOT_WEB_TREE_BURST", "lots", "is not a number"),
        ("SANDLOT_WEB_SEARCH_PER_SECOND", "0", "must be positive"),
        ("SANDLOT_WEB_TREE_PER_SECOND", "-1", "must be positive"),
        ("SANDLOT_WEB_SEARCH_BURST", "nan", "must be positive"),
    ]:
        with pytest.raises(ConfigError, match=f"{name}.*{says}"):
            load_web_settings({name: raw})
    # Arguments come before the environment.
    given = RouteLimits(tree_burst=7)
    assert load_web_settings(BUDGETS, route_limits=given).route_limits is given
    assert WebSettings().route_limits == RouteLimits()


def test_socket_limits_from_the_environment() -> None:
    assert load_web_settings({}).socket_limits == SocketLimits()
    env = {
        "SANDLOT_WEB_WS_USER_CONNECT_BURST": "5",
        "SANDLOT_WEB_WS_IP_CONNECTS_PER_SECOND": "0.5",
        "SANDLOT_WEB_WS_MAX_SOCKETS_PER_USER": "3",
        "SANDLOT_WEB_WS_OUTPUT_QUEUE_BYTES": "65536",
        "SANDLOT_WEB_WS_CLOSE_TIMEOUT": "1.5",
    }
    assert load_web_settings(env).socket_limits == SocketLimits(
        user_connect_burst=5,
        ip_connects_per_second=0.5,
        max_sockets_per_user=3,
        output_queue_bytes=65536,
        close_timeout=1.5,
    )
    for name, raw, says in [
        ("SANDLOT_WEB_WS_MAX_SOCKETS_PER_USER", "2.5", "is not a whole number"),
        ("SANDLOT_WEB_WS_INPUT_QUEUE_FRAMES", "many", "is not a whole number"),
        ("SANDLOT_WEB_WS_USER_CONNECT_BURST", "x", "is not a number"),
        ("SANDLOT_WEB_WS_OUTPUT_QUEUE_FRAMES", "0", "must be positive"),
        ("SANDLOT_WEB_WS_CLOSE_TIMEOUT", "inf", "must be positive"),
    ]:
        with pytest.raises(ConfigError, match=f"{name}.*{says}"):
            load_web_settings({name: raw})
    # Every field has its variable.
    for field in dataclasses.fields(SocketLimits):
        name = f"SANDLOT_WEB_WS_{field.name.upper()}"
        assert getattr(load_web_settings({name: "7"}).socket_limits, field.name) == 7

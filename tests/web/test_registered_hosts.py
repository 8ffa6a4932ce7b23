"""The browser workspace of a broker whose sandboxes are on registered hosts.

A ``sandlot serve`` on PostgreSQL with ``hosts.mode = "registered"`` serves no dataplane
of its own; its web app's gateway reaches each sandbox on the dataplane of its host, a
``sandlot host`` registered through the broker's API, discovered from the store. The
browser gets files and trees as with a local dataplane, never a token (the suite's leak
scan checks every answer and log line); a URL of no registered host stays refused.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.pg import postgres_cluster
from tests.sandbox_hosts import SandlotHost
from tests.servers import SandlotServer
from tests.web.conftest import login_with_key

CONFIG = """
admins = ["admin"]
[policy]
reaper_interval_seconds = 0.3
[hosts]
heartbeat_seconds = 0.5
lost_after_seconds = 12
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SandlotServer, SandlotHost]]:
    base = tmp_path_factory.mktemp("web-registered")
    with postgres_cluster() as url:
        config = CONFIG + f'[server]\nstore_url = "{url}"\n'
        srv = SandlotServer(base / "b", config=config, env={"SANDLOT_SANDBOX_HOSTS": "registered"})
        host: SandlotHost | None = None
        try:
            srv.start(timeout=90)
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "sandlot.cli.main",
                    "keys",
                    "create-host",
                    "--json",
                    "--data-dir",
                    str(srv.data_dir),
                    "--config",
                    str(srv.config_path),
                ],
                capture_output=True,
                check=True,
                timeout=60,
            )
            key = json.loads(out.stdout)["key"]
            host = SandlotHost(base / "h", store=None, broker_url=srv.url, capacity=4, key=key)
            host.start()
            yield srv, host
        finally:
            srv.stop()
            if host is not None:
                host.stop()
                host.cleanup()


@pytest.mark.timeout(240)
def test_the_workspace_reaches_the_sandbox_on_its_registered_host(
    fleet: tuple[SandlotServer, SandlotHost],
) -> None:
    srv, host = fleet
    key = srv.key("ada")
    # The broker serves no dataplane: only its registered hosts do.
    assert httpx.get(f"{srv.url}/dp/__meta/version").status_code == 404
    bodies: list[str] = []
    browser, csrf, _cookie = login_with_key(srv.url, key, bodies)
    with contextlib.closing(browser):
        made = browser.post(
            "/api/v1/workspace",
            params={"thread": "thr_web"},
            headers={"X-CSRF-Token": csrf, "Origin": srv.url},
        )
        assert made.status_code == 200, made.text
        r = browser.get("/api/tree", params={"path": ".", "thread": "thr_web"})
        assert r.status_code == 200, r.text
        assert r.json() == {"entries": [], "path": "."}
        # The sandbox the workspace negotiated is on the host.
        sandboxes = httpx.get(
            f"{srv.url}/v1/sandboxes", headers={"Authorization": f"Bearer {key}"}
        ).json()["items"]
        (sandbox,) = sandboxes
        assert sandbox["dataplane"]["http_base_url"].startswith(f"{host.url}/dp/")
        assert sandbox["id"] in host.provider_ids()

        written = browser.put(
            "/api/file",
            params={"path": "notes.txt", "thread": "thr_web"},
            json={"content": "written from the browser\n"},
            headers={"X-CSRF-Token": csrf, "Origin": srv.url},
        )
        assert written.status_code == 200, written.text
        # What the browser wrote is on the host, seen through the SDK's own grant.
        grant = httpx.post(
            f"{srv.url}/v1/sandbox/sessions",
            json={"thread_id": "thr_web", "mode": "ensure"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ).json()
        assert grant["sandbox"]["id"] == sandbox["id"]
        r = httpx.post(
            f"{grant['dataplane']['http_base_url']}/exec",
            json={"command": "cat notes.txt; echo from-the-sdk > other.txt"},
            headers={"Authorization": f"Bearer {grant['token']}"},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["stdout"] == "written from the browser\n"
        r = browser.get("/api/file", params={"path": "other.txt", "thread": "thr_web"})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == "from-the-sdk\n"
        tree = browser.get("/api/tree", params={"path": ".", "thread": "thr_web"}).json()
        assert {e["name"] for e in tree["entries"]} == {"notes.txt", "other.txt"}

        # The host's dataplane is a discovered upstream: shown, not counted for readiness.
        ready = browser.get("/api/readyz").json()
        assert ready["ready"] is True, ready
        assert ready["gateway"] == {f"host:{host.host_id}": "closed"}, ready
        # Nothing the browser received carries the dataplane's token.
        assert grant["token"] not in "".join(bodies) + r.text + json.dumps(tree)


def test_discovered_upstreams_admit_only_registered_dataplanes() -> None:
    import asyncio

    from sandlot.protocol.errors import Forbidden
    from sandlot.web.allowlist import Upstream
    from sandlot.web.gateway import Gateway
    from sandlot.web.workspaces import dataplane_upstream

    asked: list[int] = []
    known = [dataplane_upstream("host:h_1", "http://127.0.0.1:9/dp")]

    async def discover() -> list[Upstream]:
        asked.append(1)
        return list(known)

    async def run() -> None:
        async with Gateway([], discover=discover, discover_seconds=0.0) as gateway:
            # A URL of no registered host is refused after asking again: never reached.
            for url in (
                "http://127.0.0.1:10/dp/sb_1/v1/exec",
                "http://127.0.0.1:9/other/sb_1/v1/exec",
                "http://127.0.0.1:9/dp/../admin",
            ):
                with pytest.raises(Forbidden):
                    await gateway.request("POST", url, token="t.t.t")
            assert len(asked) >= 2
            assert set(gateway.states()) == {"host:h_1"}
            assert gateway.states(discovered=False) == {}
            # A host that left is dropped at the next discovery.
            known.clear()
            with pytest.raises(Forbidden):
                await gateway.request("POST", "http://127.0.0.1:10/dp/sb_1/v1/x", token="t.t.t")
            assert gateway.states() == {}

    asyncio.run(run())

"""Sandbox operations through a replica that is not the sandbox's host, forwarded to that
host's provider API (the HTTP provider of ``--workers`` and registered hosts), and
replicas in ``hosts.mode = "mixed"``: each runs sandboxes and places new ones on the
host with the most free slots, itself and ``sandlot host`` processes alike.

Real replicas on PostgreSQL (``tests/pg.py``), separate processes on loopback.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.broker.test_e2e import FAST_REAPER, wait_active
from tests.broker.test_replicas import _wait_ready, running_replicas
from tests.figures import RecordProperty, report
from tests.pg import postgres_cluster
from tests.sandbox_hosts import SandlotHost
from tests.servers import SandlotServer, free_port

#: Heartbeats short enough that placement sees every host at once in a test.
HOSTS = FAST_REAPER + "[hosts]\nheartbeat_seconds = 0.5\nlost_after_seconds = 12\n"


def _sql(store: str, query: str, **params: Any) -> list[Any]:
    engine = create_engine(store.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(query), params).all())
    finally:
        engine.dispose()


def _store(srv: SandlotServer) -> str:
    config = (srv.data_dir.parent / f"{srv.data_dir.name}-config.toml").read_text()
    for line in config.splitlines():
        if line.startswith("store_url"):
            return str(json.loads(line.split("=", 1)[1].strip()))
    raise AssertionError("no store_url in the replica's configuration")


def _ensure(url: str, headers: dict[str, str], thread: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": "ensure"},
        headers=headers,
        timeout=60,
    )


def _exec(grant: dict[str, Any], command: str) -> tuple[int, str]:
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(
            f"{grant['dataplane']['http_base_url']}/exec",
            json={"command": command},
            headers={"Authorization": f"Bearer {grant['token']}"},
            timeout=60,
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            return r.status_code, r.json().get("stdout", "") if r.status_code == 200 else r.text
        time.sleep(0.2)  # still starting (retryable)


def _act(url: str, headers: dict[str, str], sandbox_id: str, action: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/sandboxes/{sandbox_id}/{action}", headers=headers, timeout=60)


def _phases(store: str, sandbox_id: str) -> list[tuple[str, str | None]]:
    """The sandbox's phase events (its log in the store): (to, reason)."""
    rows = _sql(
        store, "SELECT event FROM events WHERE stream_id = :i ORDER BY sequence", i=sandbox_id
    )
    out = []
    for (event,) in rows:
        ev = event if isinstance(event, dict) else json.loads(event)
        phase = ev["details"].get("phase")
        if phase:
            out.append((phase["to"], phase["reason"]))
    return out


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SandlotServer]]:
    with running_replicas(tmp_path_factory.mktemp("cross")) as servers:
        yield servers


@pytest.mark.timeout(240)
def test_suspend_and_resume_through_the_other_replica(
    replicas: list[SandlotServer], record_property: RecordProperty
) -> None:
    """A sandbox of replica a, suspended and resumed through replica b (the request, the
    ensure of its thread, a lease heartbeat): b forwards each to a's provider API; the
    same sandbox comes back with its files, never ``failed``, never a new one."""
    a, b = replicas
    headers = a.headers("cross")
    store = _store(a)
    # Each replica registered its host with a provider API the others reach.
    hosts = _sql(store, "SELECT provider_url, credential IS NOT NULL FROM hosts ORDER BY 1")
    assert sorted(h[0] for h in hosts) == sorted([a.url, b.url]) and all(h[1] for h in hosts)
    # That API asks for the host's credential.
    r = httpx.get(f"{a.url}/internal/provider/sandboxes", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED", r.text

    r = _ensure(a.url, headers, "cross_1")
    assert r.status_code == 200, r.text
    grant = r.json()
    sid, sandbox = grant["session_id"], grant["sandbox"]["id"]
    assert grant["dataplane"]["http_base_url"].startswith(a.url + "/dp/")
    wait_active(a.url, headers, grant)
    assert _exec(grant, "echo kept > /workspace/kept && echo ok") == (200, "ok\n")

    rounds = []
    for how in ("request", "ensure", "request"):
        r = _act(b.url, headers, sandbox, "suspend")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "suspended", r.json()
        seen_at_a = httpx.get(f"{a.url}/v1/sandboxes/{sandbox}", headers=headers).json()
        assert seen_at_a["state"] == "suspended", seen_at_a
        if how == "request":
            r = _act(b.url, headers, sandbox, "resume")
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "active", r.json()
        else:
            r = _ensure(b.url, headers, "cross_1")
            assert r.status_code == 200, r.text
            assert r.json()["session_id"] == sid and r.json()["sandbox"]["id"] == sandbox
            grant = r.json()
            wait_active(b.url, headers, grant)
        rounds.append(how)
        assert _exec(grant, "cat /workspace/kept") == (200, "kept\n")

    # A heartbeat at b resumes a suspended sandbox of a's as well.
    assert _act(b.url, headers, sandbox, "suspend").json()["state"] == "suspended"
    beat = httpx.post(f"{b.url}/v1/sandbox/sessions/{sid}/heartbeat", headers=headers, timeout=30)
    assert beat.status_code == 200, beat.text
    assert beat.json()["state"] == "active", beat.json()
    assert _exec(grant, "cat /workspace/kept") == (200, "kept\n")

    phases = _phases(store, sandbox)
    assert ("failed", "sandbox vanished") not in phases and phases[-1][0] != "failed", phases
    assert [p for p in phases if p[0] == "suspended"] == [
        ("suspended", "suspended by request")
    ] * 4, phases
    assert _sql(store, "SELECT count(*) FROM sandboxes WHERE scope_key = 'thread:cross_1'") == [
        (1,)
    ]
    # Released at b: a's sandbox is torn down by a (b forwards the deletion).
    r = httpx.delete(
        f"{b.url}/v1/sandbox/sessions/{sid}?terminate=true", headers=headers, timeout=30
    )
    assert r.status_code in (200, 202, 204), r.text
    deadline = time.monotonic() + 30
    while _sql(store, "SELECT state FROM sandboxes WHERE id = :i", i=sandbox) != [("terminated",)]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    report(
        record_property,
        "a sandbox of replica a suspended at replica b 4 times and resumed there by request "
        "(2), by its thread's ensure (1) and by a heartbeat (1), each forwarded to a's "
        "provider API: the same sandbox, its files kept, never failed; released at b, "
        "torn down at a",
    )


@pytest.mark.timeout(300)
def test_mixed_replicas_place_on_themselves_and_registered_hosts(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    """Two replicas in ``mixed`` mode and one ``sandlot host``, capacity 2 each: new
    sandboxes go to the host with the most free slots whichever replica is asked (a
    replica creates on the other replica's host through its provider API), never past a
    capacity; the 7th is refused at both (503 ``no_capacity``); each runs, and each is
    suspended and resumed through a replica that does not host it."""
    capacity = 2
    with postgres_cluster() as store:
        config = HOSTS + f'[server]\nstore_url = "{store}"\n'
        ports = [free_port(), free_port()]
        issuer = f"http://127.0.0.1:{ports[0]}"
        servers: list[SandlotServer] = []
        host: SandlotHost | None = None
        try:
            for name, port in zip(("a", "b"), ports, strict=True):
                own = f"http://127.0.0.1:{port}"
                env = {
                    "SANDLOT_PUBLIC_URL": issuer,
                    "SANDLOT_DATAPLANE_URL": own,
                    "SANDLOT_SANDBOX_HOSTS": "mixed",
                    "SANDLOT_HOST_CAPACITY": str(capacity),
                }
                srv = SandlotServer(tmp_path / name, config=config, env=env)
                srv.port = port
                servers.append(srv.start(timeout=90))
                srv.url = own
                _wait_ready(own)
            host = SandlotHost(
                tmp_path / "h1", store=store, broker_url=issuer, capacity=capacity, config=HOSTS
            ).start(timeout=90)
            _mixed(servers, host, store, capacity, record_property)
        finally:
            for srv in servers:
                srv.stop()
                srv.cleanup()
            if host is not None:
                host.stop()
                host.cleanup()


def _mixed(
    servers: list[SandlotServer],
    host: SandlotHost,
    store: str,
    capacity: int,
    record_property: RecordProperty,
) -> None:
    a, b = servers
    headers = a.headers("mixed")
    where = {a.url: "a", b.url: "b", host.url: "h1"}

    def placed_on(grant: dict[str, Any]) -> str:
        url = grant["dataplane"]["http_base_url"]
        (name,) = [n for u, n in where.items() if url.startswith(u + "/dp/")]
        return name

    grants: dict[str, dict[str, Any]] = {}
    asked: dict[str, str] = {}
    for i in range(3 * capacity):
        srv = servers[i % 2]
        thread = f"mixed_{i}"
        deadline = time.monotonic() + 30
        while True:
            r = _ensure(srv.url, headers, thread)
            # A host whose heartbeat is late on a loaded machine is skipped meanwhile.
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert r.status_code == 200, r.text
        grants[thread], asked[thread] = r.json(), "ab"[i % 2]
    spread = Counter(placed_on(g) for g in grants.values())
    assert spread == {"a": capacity, "b": capacity, "h1": capacity}, spread
    # Some were created by the replica that does not host them (forwarded creation).
    across = [t for t, g in grants.items() if placed_on(g) not in (asked[t], "h1")]
    assert across, (asked, {t: placed_on(g) for t, g in grants.items()})
    for thread, grant in grants.items():
        assert _exec(grant, f"echo {thread} > mark && cat mark") == (200, f"{thread}\n")

    # Full: refused at both replicas, retryable, with the reason.
    for srv in servers:
        r = _ensure(srv.url, headers, f"mixed_full_{srv.url[-5:]}")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "PROVIDER_UNAVAILABLE" and err["retryable"], err
        assert err["metadata"]["reason"] == "no_capacity", err

    # Suspend and resume each through a replica that does not host it.
    for thread, grant in grants.items():
        on = placed_on(grant)
        via = b if on == "a" else a
        sandbox = grant["sandbox"]["id"]
        r = _act(via.url, headers, sandbox, "suspend")
        assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
        r = _ensure(via.url, headers, thread)
        assert r.status_code == 200, r.text
        assert r.json()["sandbox"]["id"] == sandbox
        wait_active(via.url, headers, r.json())
        assert _exec(r.json(), "cat mark") == (200, f"{thread}\n")
    hosts = _sql(store, "SELECT count(*) FROM hosts WHERE provider_url IS NOT NULL")
    assert hosts == [(3,)], hosts
    live = _sql(
        store,
        "SELECT count(*) FROM sandboxes WHERE scope_key LIKE 'thread:mixed_%' "
        "AND state NOT IN ('terminated', 'failed')",
    )
    assert live == [(3 * capacity,)], live
    report(
        record_property,
        f"2 replicas in mixed mode + 1 sandlot host, capacity {capacity} each: "
        f"{3 * capacity} sandboxes placed {dict(sorted(spread.items()))} ({len(across)} "
        "created by the other replica through its provider API), the next refused at both "
        "(503 no_capacity); each suspended and resumed through a replica that does not host "
        "it, its files kept",
    )


@pytest.mark.timeout(240)
def test_forwarding_to_and_from_workers(tmp_path: Path, record_property: RecordProperty) -> None:
    """A replica with ``--workers 2`` beside a plain one: the plain one reaches the
    sandboxes of the other's sandbox host (its provider API on the dataplane port), and
    the workers reach the plain one's (a worker forwards as a single process does)."""
    with postgres_cluster() as store:
        config = HOSTS + f'[server]\nstore_url = "{store}"\n'
        plain_port = free_port()
        issuer = f"http://127.0.0.1:{plain_port}"
        plain = SandlotServer(
            tmp_path / "plain",
            config=config,
            env={"SANDLOT_PUBLIC_URL": issuer, "SANDLOT_DATAPLANE_URL": issuer},
        )
        plain.port = plain_port
        workers = SandlotServer(
            tmp_path / "workers",
            workers=2,
            config=config,
            env={"SANDLOT_PUBLIC_URL": issuer, "SANDLOT_DATAPLANE_PORT": str(free_port())},
        )
        # It announces the issuer: its own port is the one it is given.
        workers_port = workers.port = free_port()
        servers = [plain, workers]
        try:
            # A loaded machine starts --workers slowly.
            plain.start(timeout=90)
            plain.url = issuer
            workers.start(timeout=90)
            workers.url = f"http://127.0.0.1:{workers_port}"
            _wait_ready(workers.url)
            headers = plain.headers("workers")
            done = []
            for host, via in ((workers, plain), (plain, workers)):
                thread = f"workers_{len(done)}"
                r = _ensure(host.url, headers, thread)
                assert r.status_code == 200, r.text
                grant = r.json()
                sandbox = grant["sandbox"]["id"]
                assert not grant["dataplane"]["http_base_url"].startswith(via.url + "/")
                wait_active(host.url, headers, grant)
                assert _exec(grant, "echo here > /workspace/f && echo ok") == (200, "ok\n")
                # Several times: the workers' requests spread over both worker processes.
                for _ in range(3):
                    r = _act(via.url, headers, sandbox, "suspend")
                    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
                    r = _ensure(via.url, headers, thread)
                    assert r.status_code == 200 and r.json()["sandbox"]["id"] == sandbox, r.text
                    wait_active(via.url, headers, r.json())
                    assert _exec(r.json(), "cat /workspace/f") == (200, "here\n")
                phases = _phases(store, sandbox)
                assert "failed" not in [p[0] for p in phases], phases
                done.append(thread)
            (provider_url,) = _sql(
                store,
                "SELECT provider_url FROM hosts WHERE provider_url != :p",
                p=issuer,
            )[0]
            # The workers' sandbox host is reached on its own (dataplane) port.
            assert provider_url != workers.url and provider_url.startswith("http://127.0.0.1:")
        finally:
            for srv in servers:
                srv.stop()
                srv.cleanup()
    report(
        record_property,
        "a replica with --workers 2 beside a plain one on PostgreSQL: each one's sandbox "
        "suspended and resumed 3 times through the other (from worker processes, and into "
        "the workers' sandbox host): the same sandbox, its files kept, never failed",
    )


def test_mixed_mode_settings(tmp_path: Path) -> None:
    from sandlot.broker.core import Broker
    from sandlot.broker.settings import ConfigError, load_settings

    config = tmp_path / "c.toml"
    config.write_text('[hosts]\nmode = "mixed"\nprovider_url = "http://10.0.0.11:8765"\n')
    settings = load_settings(environ={}, config_file=config, data_dir=tmp_path)
    assert settings.sandbox_hosts == "mixed"
    assert settings.host_provider_url == "http://10.0.0.11:8765"
    env = {"SANDLOT_HOST_PROVIDER_URL": "http://10.0.0.12:8765"}
    assert (
        load_settings(environ=env, config_file=config, data_dir=tmp_path).host_provider_url
        == "http://10.0.0.12:8765"
    )
    # One SQLite store is one machine: nothing to place on but itself.
    from sandlot.broker.assembly import build_provider

    ref: list[Broker] = []
    with pytest.raises(ConfigError, match="server store"):
        Broker(settings, build_provider(settings, ref))

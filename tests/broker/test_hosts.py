"""Sandbox hosts apart from the brokers: two broker replicas (``hosts.mode = "registered"``)
and two ``sandlot host`` processes on one PostgreSQL, all separate processes on loopback.

Placement by the documented rule (most free slots, ties to the smallest host id) within
each host's capacity; a full fleet answers 503 PROVIDER_UNAVAILABLE; a host killed with
``kill -9`` turns its sandboxes ``failed`` (``host_lost``) once, seen by a subscriber of
the other replica; the next ensure of that thread is refused with SESSION_EXPIRED; the
host that comes back removes what it still ran; a user's quota holds under concurrent
creations at both replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from sandlot.sdk import Sandlot
from tests.broker.test_e2e import wait_active
from tests.pg import postgres_cluster
from tests.sandbox_hosts import SandlotHost
from tests.servers import SandlotServer, free_port

QUOTA = 3
CAPACITY = 3
#: Long enough that a healthy host on a loaded machine never misses it.
LOST_AFTER = 12.0

FLEET = f"""
[policy]
reaper_interval_seconds = 0.3
[quotas]
max_live_sandboxes_per_user = {QUOTA}
negotiation_rate_per_second = 100000
negotiation_burst = 100000
[hosts]
heartbeat_seconds = 0.5
lost_after_seconds = {LOST_AFTER}
"""


class Fleet:
    def __init__(self, store: str, brokers: list[SandlotServer], hosts: list[SandlotHost]) -> None:
        self.store = store
        self.brokers = brokers
        self.hosts = hosts

    def sql(self, query: str, **params: Any) -> list[Any]:
        engine = create_engine(self.store.replace("postgresql://", "postgresql+psycopg://"))
        try:
            with engine.connect() as conn:
                return list(conn.execute(text(query), params).all())
        finally:
            engine.dispose()

    def execute(self, query: str, **params: Any) -> None:
        engine = create_engine(self.store.replace("postgresql://", "postgresql+psycopg://"))
        try:
            with engine.begin() as conn:
                conn.execute(text(query), params)
        finally:
            engine.dispose()

    def host_of(self, grant: dict[str, Any]) -> SandlotHost:
        url = grant["dataplane"]["http_base_url"]
        (host,) = [h for h in self.hosts if url.startswith(h.url + "/")]
        return host


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    with postgres_cluster() as url:
        config = FLEET + f'[server]\nstore_url = "{url}"\n'
        ports = [free_port(), free_port()]
        issuer = f"http://127.0.0.1:{ports[0]}"
        brokers: list[SandlotServer] = []
        hosts: list[SandlotHost] = []
        try:
            for name, port in zip(("a", "b"), ports, strict=True):
                env = {"SANDLOT_PUBLIC_URL": issuer, "SANDLOT_SANDBOX_HOSTS": "registered"}
                srv = SandlotServer(base / name, config=config, env=env)
                srv.port = port
                brokers.append(srv.start())
                srv.url = f"http://127.0.0.1:{port}"
            for name in ("h1", "h2"):
                host = SandlotHost(
                    base / name, store=url, broker_url=issuer, capacity=CAPACITY, config=FLEET
                )
                hosts.append(host.start())
            yield Fleet(url, brokers, hosts)
        finally:
            for srv in brokers:
                srv.stop()
            for host in hosts:
                host.stop()
                host.cleanup()


def _ensure(url: str, headers: dict[str, str], thread: str, mode: str = "ensure") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": mode},
        headers=headers,
        timeout=30,
    )


def _exec(dataplane: str, token: str, command: str) -> httpx.Response:
    """``POST /exec`` at a sandbox's dataplane with its grant's token."""
    return httpx.post(
        f"{dataplane}/exec",
        json={"command": command},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def _terminate_all(fleet: Fleet, grants: list[tuple[dict[str, str], dict[str, Any]]]) -> None:
    a = fleet.brokers[0]
    for headers, grant in grants:
        r = httpx.delete(
            f"{a.url}/v1/sandbox/sessions/{grant['session_id']}?terminate=true",
            headers=headers,
            timeout=30,
        )
        assert r.status_code in (202, 204), r.text
    ids = [g["sandbox"]["id"] for _, g in grants]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {
            r.state for r in fleet.sql("SELECT state FROM sandboxes WHERE id = ANY(:ids)", ids=ids)
        }
        if states <= {"terminated"}:
            return
        time.sleep(0.2)
    raise AssertionError(f"teardowns never finished: {states}")


@pytest.mark.timeout(240)
def test_placement_spreads_by_free_slots_within_capacity(fleet: Fleet) -> None:
    a, b = fleet.brokers
    users = [a.headers("place1"), a.headers("place2")]
    order = sorted(h.host_id for h in fleet.hosts)
    grants = []
    placed = []
    for i in range(2 * CAPACITY):
        headers = users[i // QUOTA]
        r = _ensure((a, b)[i % 2].url, headers, f"thr_place_{i}")
        assert r.status_code == 200, r.text
        grants.append((headers, r.json()))
        placed.append(fleet.host_of(r.json()).host_id)
    # Most free slots first, ties to the smallest host id: the hosts take turns.
    assert placed == [order[i % 2] for i in range(2 * CAPACITY)], placed
    assert Counter(placed) == {h: CAPACITY for h in order}
    rows = fleet.sql("SELECT host, provider, dataplane_http FROM sandboxes")
    assert {r.provider for r in rows} == {"local"}

    # Each sandbox runs on its host: commands run there, files stay there.
    for headers, grant in (grants[0], grants[1]):
        wait_active(a.url, headers, grant)
        token = {"Authorization": f"Bearer {grant['token']}"}
        dp = grant["dataplane"]["http_base_url"]
        r = httpx.post(f"{dp}/exec", json={"command": "echo here > f; cat f"}, headers=token)
        assert r.status_code == 200 and r.json()["stdout"] == "here\n", r.text
        assert grant["sandbox"]["id"] in fleet.host_of(grant).provider_ids()

    # The fleet is full: a clear, retryable answer at either replica, never a 500.
    third = a.headers("place3")
    for srv in (a, b):
        r = _ensure(srv.url, third, "thr_place_full")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "PROVIDER_UNAVAILABLE" and err["retryable"] is True, err
        assert err["metadata"]["reason"] == "no_capacity", err

    # Freed slots are placed on again.
    _terminate_all(fleet, grants[:1])
    r = _ensure(b.url, third, "thr_place_full")
    assert r.status_code == 200, r.text
    assert fleet.host_of(r.json()).host_id == placed[0]
    _terminate_all(fleet, [*grants[1:], (third, r.json())])


@pytest.mark.timeout(240)
def test_quota_holds_under_concurrent_creations_at_both_replicas(fleet: Fleet) -> None:
    a, b = fleet.brokers
    headers = a.headers("quota")

    async def storm() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{(a, b)[i % 2].url}/v1/sandbox/sessions",
                        json={"thread_id": f"thr_quota_{i}", "mode": "ensure"},
                        headers=headers,
                    )
                    for i in range(10)
                )
            )

    answers = asyncio.run(storm())
    codes = Counter(r.status_code for r in answers)
    assert codes == {200: QUOTA, 429: 10 - QUOTA}, [r.text for r in answers]
    assert {r.json()["error"]["code"] for r in answers if r.status_code == 429} == {
        "QUOTA_EXCEEDED"
    }
    live = fleet.sql(
        "SELECT count(*) AS n FROM sandboxes WHERE owner_user_id = 'quota' "
        "AND state NOT IN ('terminated', 'failed', 'terminating')"
    )
    assert live[0].n == QUOTA
    _terminate_all(fleet, [(headers, r.json()) for r in answers if r.status_code == 200])


class Subscriber:
    """Every event of a binding's log after ``after``, read at one replica."""

    def __init__(self, url: str, headers: dict[str, str], sid: str, after: int) -> None:
        self.events: list[dict[str, Any]] = []
        self.opened = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(url, headers, sid, after), daemon=True
        )
        self._thread.start()
        assert self.opened.wait(10)

    def _run(self, url: str, headers: dict[str, str], sid: str, after: int) -> None:
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream(
                "GET",
                f"{url}/v1/sandbox/sessions/{sid}/events?after={after}",
                headers=headers,
                timeout=httpx.Timeout(60, read=60),
            ) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith(": stream open"):
                    self.opened.set()
                if line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                if self._stop.is_set():
                    return

    def close(self) -> None:
        # The reader ends at its next line (the stream's keep-alive, or the process's exit).
        self._stop.set()


@pytest.mark.timeout(240)
def test_a_lost_host_fails_its_sandboxes_once(fleet: Fleet) -> None:
    a, b = fleet.brokers
    headers = a.headers("lost")
    r = _ensure(a.url, headers, "thr_lost")
    assert r.status_code == 200, r.text
    grant = r.json()
    sid, sandbox_id = grant["session_id"], grant["sandbox"]["id"]
    wait_active(a.url, headers, grant)
    host = fleet.host_of(grant)
    other = next(h for h in fleet.hosts if h is not host)
    r = _exec(grant["dataplane"]["http_base_url"], grant["token"], "echo kept > notes.txt")
    assert r.status_code == 200, r.text

    after = httpx.get(f"{b.url}/v1/sandbox/sessions/{sid}", headers=headers).json()["binding"][
        "last_event_sequence"
    ]
    subscriber = Subscriber(b.url, headers, sid, after)
    host.kill9()
    try:
        deadline = time.monotonic() + LOST_AFTER + 20
        while time.monotonic() < deadline:
            if any(e["event_type"] == "binding.failed" for e in subscriber.events):
                break
            time.sleep(0.1)
        # A few more reaper passes of both replicas: nothing fails twice.
        time.sleep(2.0)
    finally:
        subscriber.close()
    failed = [e for e in subscriber.events if e["event_type"] == "binding.failed"]
    state = fleet.sql("SELECT state, reason FROM sandboxes WHERE id = :s", s=sandbox_id)
    assert len(failed) == 1, (subscriber.events, state, fleet.sql("SELECT * FROM hosts"))
    assert failed[0]["details"]["phase"] == {
        "from": "active",
        "to": "failed",
        "reason": "host_lost",
    }
    assert (
        fleet.sql(
            "SELECT count(*) AS n FROM events WHERE stream_id = :s "
            "AND event->>'event_type' = 'sandbox.failed'",
            s=sandbox_id,
        )[0].n
        == 1
    )
    (row,) = fleet.sql("SELECT state, reason FROM sandboxes WHERE id = :s", s=sandbox_id)
    assert (row.state, row.reason) == ("failed", "host_lost")
    (hrow,) = fleet.sql("SELECT state FROM hosts WHERE id = :h", h=host.host_id)
    assert hrow.state == "lost"
    snap = httpx.get(f"{b.url}/v1/sandboxes/{sandbox_id}", headers=headers).json()
    assert snap["state"] == "failed", snap
    # Its tokens are revoked: none outlives the loss, should the host come back.
    revoked = fleet.sql(
        "SELECT count(*) AS n FROM tokens WHERE sandbox_id = :s AND revoked_at IS NULL",
        s=sandbox_id,
    )
    assert revoked[0].n == 0

    # The next ensure says what happened instead of handing out an empty sandbox.
    for srv in (a, b):
        r = _ensure(srv.url, headers, "thr_lost")
        assert r.status_code == 410, r.text
        err = r.json()["error"]
        assert err["code"] == "SESSION_EXPIRED", err
        assert err["metadata"]["reason"] == "host_lost", err
        assert err["metadata"]["sandbox_id"] == sandbox_id, err
    # New placements skip the lost host; create_only starts over knowingly.
    r = _ensure(b.url, headers, "thr_lost", mode="create_only")
    assert r.status_code == 200, r.text
    fresh = r.json()
    assert fresh["session_id"] != sid and fleet.host_of(fresh) is other
    wait_active(b.url, headers, fresh)
    r = _ensure(a.url, headers, "thr_lost")
    assert r.status_code == 200 and r.json()["session_id"] == fresh["session_id"], r.text

    # The host comes back: it is placeable again, and what it still ran of the failed
    # sandbox is removed by its reaper, never re-adopted.
    host.restart()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sandbox_id in host.provider_ids():
        time.sleep(0.2)
    assert sandbox_id not in host.provider_ids()
    (hrow,) = fleet.sql("SELECT state FROM hosts WHERE id = :h", h=host.host_id)
    assert hrow.state == "up"
    (row,) = fleet.sql("SELECT state, reason FROM sandboxes WHERE id = :s", s=sandbox_id)
    assert (row.state, row.reason) == ("failed", "host_lost")
    _terminate_all(fleet, [(headers, fresh)])


@pytest.mark.timeout(240)
def test_a_new_sandbox_whose_host_cannot_be_reached_is_placed_on_another(fleet: Fleet) -> None:
    # The host is gone but its heartbeats are still fresh (the seconds before it is
    # declared lost): placement still picks it, the creation cannot reach it, and the
    # sandbox is placed again on the other host instead of failing.
    a, _b = fleet.brokers
    gone = min(fleet.hosts, key=lambda h: h.host_id)  # ties in free slots go to it
    other = next(h for h in fleet.hosts if h is not gone)
    fleet.execute(
        "UPDATE hosts SET heartbeat_at = heartbeat_at + 3600 WHERE id = :h", h=gone.host_id
    )
    gone.kill9()
    grants: list[tuple[dict[str, str], dict[str, Any]]] = []
    try:
        for n in range(2):
            headers = a.headers(f"placed{n}")
            r = _ensure(a.url, headers, f"thr_placed{n}")
            assert r.status_code == 200, r.text
            grants.append((headers, r.json()))
        placed = []
        for headers, grant in grants:
            snap = wait_active(a.url, headers, grant, timeout=60)
            assert snap["dataplane"]["http_base_url"].startswith(other.url + "/"), snap
            sid = grant["sandbox"]["id"]
            (row,) = fleet.sql("SELECT host FROM sandboxes WHERE id = :s", s=sid)
            assert row.host == other.host_id
            events = [
                json.loads(e.event) if isinstance(e.event, str) else e.event
                for e in fleet.sql(
                    "SELECT event FROM events WHERE stream_id IN (:s, :b) ORDER BY sequence",
                    s=sid,
                    b=grant["session_id"],
                )
            ]
            moves = [e for e in events if e["event_type"] in ("sandbox.placed", "binding.placed")]
            if moves:
                placed.append(grant)
                reasons = {e["details"]["phase"]["reason"] for e in moves}
                assert reasons == {
                    f"placed on host {other.host_id}: host {gone.host_id} cannot be reached "
                    "(the sandbox host is unreachable)"
                }, reasons
                assert len(moves) == 2  # one on the sandbox's log, one on the binding's
            # The grant's token works at the dataplane the snapshot names.
            r = _exec(snap["dataplane"]["http_base_url"], grant["token"], "echo here")
            assert r.status_code == 200 and r.json()["stdout"] == "here\n", r.text
        assert placed, "no sandbox was placed on the unreachable host first"
        # The other host is the fuller now: the next placement picks the unreachable
        # one, and the SDK's ensure follows the sandbox to where it was placed again.
        with Sandlot(a.url, a.key("placed_sdk", "agent"), timeout=60) as client:
            sandbox = client.ensure("thr_placed_sdk")
            assert sandbox.grant.http_base_url.startswith(other.url + "/")
            assert sandbox.run("echo sdk").stdout == "sdk\n"
            session = sandbox.grant.session_id
            assert session is not None
            grants.append((a.headers("placed_sdk"), {"session_id": session,
                           "sandbox": {"id": sandbox.grant.sandbox_id}}))  # fmt: skip
    finally:
        gone.start()
    _terminate_all(fleet, grants)


@pytest.mark.timeout(240)
def test_a_host_restarted_in_time_keeps_its_sandboxes(fleet: Fleet) -> None:
    a, _b = fleet.brokers
    headers = a.headers("back")
    r = _ensure(a.url, headers, "thr_back")
    assert r.status_code == 200, r.text
    grant = r.json()
    wait_active(a.url, headers, grant)
    token = {"Authorization": f"Bearer {grant['token']}"}
    dp = grant["dataplane"]["http_base_url"]
    r = httpx.post(f"{dp}/exec", json={"command": "echo kept > notes.txt"}, headers=token)
    assert r.status_code == 200, r.text
    host = fleet.host_of(grant)
    # Back "within the delay" whatever the machine's load: its last heartbeat is dated
    # ahead, so no reaper declares it lost while it restarts.
    fleet.execute(
        "UPDATE hosts SET heartbeat_at = heartbeat_at + 3600 WHERE id = :h", h=host.host_id
    )
    host.kill9()
    host.start()
    r = httpx.post(f"{dp}/exec", json={"command": "cat notes.txt"}, headers=token, timeout=30)
    assert r.status_code == 200 and r.json()["stdout"] == "kept\n", (
        r.text,
        fleet.sql("SELECT state, reason FROM sandboxes WHERE id = :s", s=grant["sandbox"]["id"]),
        fleet.sql("SELECT id, state, heartbeat_at, lost_at FROM hosts"),
        host.output[-3000:],
    )
    # Its own heartbeats again (dated now), and its sandbox is still live.
    (hrow,) = fleet.sql(
        "SELECT state, heartbeat_at, started_at FROM hosts WHERE id = :h", h=host.host_id
    )
    assert hrow.state == "up" and hrow.heartbeat_at < hrow.started_at + 600
    (row,) = fleet.sql("SELECT state FROM sandboxes WHERE id = :s", s=grant["sandbox"]["id"])
    assert row.state == "active"
    _terminate_all(fleet, [(headers, grant)])


def test_registered_mode_needs_a_server_store(tmp_path: Path) -> None:
    from sandlot.broker.core import Broker
    from sandlot.broker.settings import ConfigError, load_settings

    settings = load_settings(environ={}, data_dir=tmp_path, sandbox_hosts="registered")
    with pytest.raises(ConfigError, match="server store"):
        Broker(settings, None)


def test_hosts_settings_are_checked(tmp_path: Path) -> None:
    from sandlot.broker.settings import ConfigError, load_settings

    with pytest.raises(ConfigError, match=r"hosts\.mode"):
        load_settings(environ={"SANDLOT_SANDBOX_HOSTS": "elsewhere"}, data_dir=tmp_path)
    with pytest.raises(ConfigError, match="capacity"):
        load_settings(environ={"SANDLOT_HOST_CAPACITY": "0"}, data_dir=tmp_path)
    with pytest.raises(ConfigError, match="capacity must be from 1 to 1000000"):
        load_settings(environ={"SANDLOT_HOST_CAPACITY": str(2**31)}, data_dir=tmp_path)
    config = tmp_path / "c.toml"
    config.write_text("[hosts]\nheartbeat_seconds = 30\nlost_after_seconds = 20\n")
    with pytest.raises(ConfigError, match="heartbeat_seconds"):
        load_settings(environ={}, config_file=config, data_dir=tmp_path)


def test_sandlot_host_says_what_it_needs(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOT_")}
    env["COLUMNS"] = "200"
    base = [sys.executable, "-m", "sandlot.cli.main", "host", "--data-dir", str(tmp_path)]
    out = subprocess.run(
        [*base, "--broker-url", "http://b"], capture_output=True, env=env, timeout=60
    )
    assert out.returncode == 2 and b"store" in out.stderr, out.stderr
    out = subprocess.run(
        [*base, "--store", "postgresql://u@127.0.0.1:1/x"], capture_output=True, env=env, timeout=60
    )
    assert out.returncode == 2 and b"public URL" in out.stderr, out.stderr
    out = subprocess.run(
        [
            *base,
            "--store",
            "postgresql://u@127.0.0.1:1/x",
            "--broker-url",
            "http://b",
            "--listen",
            "nowhere",
        ],
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and b"ADDRESS:PORT" in out.stderr.replace(b"\n", b""), out.stderr


@pytest.mark.timeout(240)
def test_workers_place_on_registered_hosts(tmp_path: Path) -> None:
    # `sandlot serve --workers 2` with registered hosts: the workers place and reach the
    # host as a single broker does.
    with postgres_cluster() as url:
        config = f'[policy]\nreaper_interval_seconds = 0.3\n[server]\nstore_url = "{url}"\n'
        env = {"SANDLOT_SANDBOX_HOSTS": "registered"}
        srv = SandlotServer(tmp_path / "a", workers=2, config=config, env=env).start()
        host = SandlotHost(tmp_path / "h", store=url, broker_url=srv.url, capacity=2)
        try:
            host.start()
            headers = srv.headers("workers")
            answers = [_ensure(srv.url, headers, f"thr_w{i}") for i in range(3)]
            assert [r.status_code for r in answers] == [200, 200, 503], [r.text for r in answers]
            grant = answers[0].json()
            assert grant["dataplane"]["http_base_url"].startswith(host.url + "/dp/")
            wait_active(srv.url, headers, grant)
            r = _exec(grant["dataplane"]["http_base_url"], grant["token"], "echo placed")
            assert r.status_code == 200 and r.json()["stdout"] == "placed\n", r.text
        finally:
            srv.stop()
            host.stop()
            host.cleanup()

"""Sandbox hosts without the store: ``sandlot host --broker URL --key-file FILE``.

Two broker replicas on PostgreSQL (``hosts.mode = "registered"``) and two ``sandlot
host`` processes that hold no database URL, only a host key an admin issued (one through
the admin route, one with ``sandlot keys create-host``). They register, beat, report
their sandboxes' states, have their sandboxes reaped and read revocations through the
brokers' authenticated routes; placement, loss and re-adoption behave as for hosts with
the store (tests/broker/test_hosts.py). Bad keys get clear answers; the key is stored
hashed and never appears in a log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.broker.test_e2e import wait_active
from tests.broker.test_hosts import Subscriber
from tests.pg import postgres_cluster
from tests.sandbox_hosts import SandlotHost
from tests.servers import SandlotServer, free_port

CAPACITY = 3
#: Long enough that a healthy host on a loaded machine never misses it.
LOST_AFTER = 20.0
IDLE = 3

FLEET = f"""
admins = ["admin"]
[policy]
reaper_interval_seconds = 0.3
idle_timeout_seconds = {IDLE}
[quotas]
negotiation_rate_per_second = 100000
negotiation_burst = 100000
[hosts]
heartbeat_seconds = 0.5
lost_after_seconds = {LOST_AFTER}
"""


class Fleet:
    def __init__(
        self,
        store: str,
        brokers: list[SandlotServer],
        hosts: list[SandlotHost],
        keys: list[str],
        admin: dict[str, str],
    ) -> None:
        self.store = store
        self.brokers = brokers
        self.hosts = hosts
        self.keys = keys
        self.admin = admin

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

    def state(self, sandbox_id: str) -> tuple[str, str | None]:
        (row,) = self.sql("SELECT state, reason FROM sandboxes WHERE id = :s", s=sandbox_id)
        return row.state, row.reason

    def wait_state(self, sandbox_id: str, wanted: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state(sandbox_id)[0] == wanted:
                return
            time.sleep(0.1)
        raise AssertionError(f"{sandbox_id} never {wanted}: {self.state(sandbox_id)}")


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOT_")}
    clean["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, "-m", "sandlot.cli.main", *argv],
        capture_output=True,
        env={**clean, **(env or {})},
        timeout=120,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("hostapi")
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
                brokers.append(srv.start(timeout=90))
                srv.url = f"http://127.0.0.1:{port}"
            a = brokers[0]
            admin = a.headers("admin")
            # One key from the admin route, one from the CLI on the store.
            r = httpx.post(f"{a.url}/v1/hosts/keys", json={"name": "h1"}, headers=admin)
            assert r.status_code == 201, r.text
            keys = [r.json()["key"]]
            out = _cli(
                "keys",
                "create-host",
                "--name",
                "h2",
                "--store",
                url,
                "--json",
                "--data-dir",
                str(base / "cli"),
            )
            assert out.returncode == 0, out.stderr
            keys.append(json.loads(out.stdout)["key"])
            for name, key, srv in zip(("h1", "h2"), keys, brokers, strict=True):
                host = SandlotHost(
                    base / name, store=None, broker_url=srv.url, capacity=CAPACITY, key=key
                )
                hosts.append(host.start(timeout=120))
            yield Fleet(url, brokers, hosts, keys, admin)
        finally:
            for srv in brokers:
                srv.stop()
                # What the replicas said, beside the hosts' logs, for a failure to be read.
                (base / f"{srv.data_dir.name}.log").write_text("".join(srv.output))
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


def _exec(grant: dict[str, Any], command: str) -> httpx.Response:
    return httpx.post(
        f"{grant['dataplane']['http_base_url']}/exec",
        json={"command": command},
        headers={"Authorization": f"Bearer {grant['token']}"},
        timeout=30,
    )


def _terminate(fleet: Fleet, headers: dict[str, str], grant: dict[str, Any]) -> None:
    r = httpx.delete(
        f"{fleet.brokers[0].url}/v1/sandbox/sessions/{grant['session_id']}?terminate=true",
        headers=headers,
        timeout=30,
    )
    assert r.status_code in (202, 204), r.text
    fleet.wait_state(grant["sandbox"]["id"], "terminated")


@pytest.mark.timeout(480)
def test_hosts_register_through_the_api_and_take_placements(fleet: Fleet) -> None:
    a, b = fleet.brokers
    ids = sorted(h.host_id for h in fleet.hosts)
    # The hosts' ids are their keys'; their rows say where brokers reach them.
    rows = fleet.sql("SELECT id, state, capacity, provider_url, credential FROM hosts ORDER BY id")
    assert [r.id for r in rows] == ids and {r.state for r in rows} == {"up"}
    assert {r.capacity for r in rows} == {CAPACITY}
    assert sorted(r.provider_url for r in rows) == sorted(h.url for h in fleet.hosts)
    # The keys are stored hashed: no key, and no secret part of one, is in the store.
    stored = fleet.sql("SELECT id, secret_hash FROM host_keys ORDER BY id")
    assert [r.id for r in stored] == ids
    for key in fleet.keys:
        secret = key.rsplit("_", 1)[1]
        assert all(secret not in r.secret_hash for r in stored)
        assert not fleet.sql(
            "SELECT 1 FROM hosts WHERE credential = :k OR credential = :s", k=key, s=secret
        )

    users = [a.headers("api1"), a.headers("api2")]
    grants, placed = [], []
    for i in range(2 * CAPACITY):
        headers = users[i % 2]
        r = _ensure((a, b)[i % 2].url, headers, f"thr_api_{i}")
        assert r.status_code == 200, r.text
        grants.append((headers, r.json()))
        placed.append(fleet.host_of(r.json()).host_id)
    # Most free slots first, ties to the smallest host id: the hosts take turns.
    assert placed == [ids[i % 2] for i in range(2 * CAPACITY)], placed
    assert Counter(placed) == {h: CAPACITY for h in ids}
    r = _ensure(a.url, a.headers("api3"), "thr_api_full")
    assert r.status_code == 503 and r.json()["error"]["metadata"]["reason"] == "no_capacity"

    # Each becomes active from the state its host reported through the API; commands run
    # on its host.
    for headers, grant in grants:
        wait_active(b.url, headers, grant)
    for _headers, grant in grants[:2]:
        r = _exec(grant, "echo there > f; cat f")
        assert r.status_code == 200 and r.json()["stdout"] == "there\n", r.text
        assert grant["sandbox"]["id"] in fleet.host_of(grant).provider_ids()
    for headers, grant in grants:
        _terminate(fleet, headers, grant)
    # Teardowns reached the hosts.
    for _headers, grant in grants:
        assert grant["sandbox"]["id"] not in fleet.host_of(grant).provider_ids()


@pytest.mark.timeout(480)
def test_revocations_and_reaper_passes_reach_api_hosts(fleet: Fleet) -> None:
    a, b = fleet.brokers
    headers = a.headers("reaped")
    r = _ensure(a.url, headers, "thr_reaped")
    assert r.status_code == 200, r.text
    grant = r.json()
    sandbox_id = grant["sandbox"]["id"]
    wait_active(a.url, headers, grant)
    assert _exec(grant, "echo kept > notes.txt").status_code == 200

    # A user's keys revoked in the store alone (the CLI, no broker involved): the host reads
    # the revocation through the API (every 0.2 s) and its dataplane refuses the token
    # within a second.
    revoker = a.headers("revoker")
    r = _ensure(a.url, revoker, "thr_revoker")
    assert r.status_code == 200, r.text
    doomed = r.json()
    wait_active(a.url, revoker, doomed)
    assert _exec(doomed, "true").status_code == 200
    out = _cli(
        "keys",
        "revoke",
        "--user",
        "revoker",
        "--store",
        fleet.store,
        "--data-dir",
        str(fleet.hosts[0].data_dir.parent / "cli"),
    )
    assert out.returncode == 0, out.stderr
    revoked = time.monotonic()
    while time.monotonic() - revoked < 5 and _exec(doomed, "true").status_code != 401:
        time.sleep(0.05)
    refused_after = time.monotonic() - revoked
    assert _exec(doomed, "true").status_code == 401
    assert refused_after < 1.0, refused_after

    # A release at the other replica: refused too.
    r = httpx.delete(f"{b.url}/v1/sandbox/sessions/{grant['session_id']}", headers=headers)
    assert r.status_code in (202, 204), r.text
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _exec(grant, "true").status_code != 401:
        time.sleep(0.05)
    assert _exec(grant, "true").status_code == 401

    # No lease, no activity: the reaper passes the host asks for idle it, then suspend it.
    fleet.wait_state(sandbox_id, "suspended", timeout=IDLE + 30)
    # The next ensure resumes it on its host, files kept.
    r = _ensure(b.url, headers, "thr_reaped")
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["sandbox"]["id"] == sandbox_id
    wait_active(b.url, headers, again)
    r = _exec(again, "cat notes.txt")
    assert r.status_code == 200 and r.json()["stdout"] == "kept\n", r.text
    _terminate(fleet, headers, again)
    _terminate(fleet, fleet.admin, doomed)


@pytest.mark.timeout(480)
def test_a_lost_api_host_fails_its_sandboxes_and_one_back_in_time_keeps_them(
    fleet: Fleet,
) -> None:
    a, b = fleet.brokers
    headers = a.headers("lostapi")
    r = _ensure(a.url, headers, "thr_lostapi")
    assert r.status_code == 200, r.text
    grant = r.json()
    sandbox_id = grant["sandbox"]["id"]
    wait_active(a.url, headers, grant)
    assert _exec(grant, "echo kept > notes.txt").status_code == 200
    host = fleet.host_of(grant)

    # Restarted within the delay: it re-adopts its sandbox (read through the API). "Within
    # the delay" whatever the machine's load: its last heartbeat is dated ahead, so no
    # reaper declares it lost while it restarts (its next heartbeat dates it now).
    fleet.execute(
        "UPDATE hosts SET heartbeat_at = heartbeat_at + 3600 WHERE id = :h", h=host.host_id
    )
    host.kill9()
    host.start(timeout=120)
    r = _exec(grant, "cat notes.txt")
    assert r.status_code == 200 and r.json()["stdout"] == "kept\n", (r.text, host.output[-3000:])
    assert fleet.state(sandbox_id)[0] == "active"

    # Gone for longer: declared lost, its sandbox failed once, seen at the other replica.
    sid = grant["session_id"]
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
        time.sleep(1.5)
    finally:
        subscriber.close()
    failed = [e for e in subscriber.events if e["event_type"] == "binding.failed"]
    assert len(failed) == 1, subscriber.events
    assert fleet.state(sandbox_id) == ("failed", "host_lost")
    r = _ensure(b.url, headers, "thr_lostapi")
    assert r.status_code == 410 and r.json()["error"]["metadata"]["reason"] == "host_lost"

    # Back later: up again, and what it still ran of the failed sandbox is removed.
    host.start(timeout=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sandbox_id in host.provider_ids():
        time.sleep(0.2)
    assert sandbox_id not in host.provider_ids()
    (hrow,) = fleet.sql("SELECT state FROM hosts WHERE id = :h", h=host.host_id)
    assert hrow.state == "up"
    assert fleet.state(sandbox_id) == ("failed", "host_lost")


@pytest.mark.timeout(240)
def test_host_routes_refuse_bad_keys(fleet: Fleet) -> None:
    a, _b = fleet.brokers
    url = f"{a.url}/v1/hosts/register"
    body = {
        "provider": "local",
        "provider_url": "http://127.0.0.1:1",
        "provider_secret": "x" * 32,
        "dataplane_url": "http://127.0.0.1:1",
        "capacity": 1,
    }
    good = fleet.keys[0]
    forged = good[: -len("A" * 43)] + "A" * 43
    for headers in (
        {},
        {"Authorization": "Bearer nonsense"},
        {"Authorization": f"Bearer {forged}"},
        # An API key is not a host key.
        fleet.admin,
    ):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "UNAUTHENTICATED"
    # Status reports only for the host's own sandboxes.
    r = httpx.post(
        f"{a.url}/v1/hosts/sandboxes/sb_nothere/status",
        json={"state": "active"},
        headers={"Authorization": f"Bearer {good}"},
    )
    assert r.status_code == 404, r.text
    # Malformed bodies are 400s, never 500s.
    r = httpx.post(url, json={**body, "capacity": 0}, headers={"Authorization": f"Bearer {good}"})
    assert r.status_code == 400, r.text
    # Only admins issue host keys; listings never show a key.
    user = a.headers("notadmin")
    assert httpx.post(f"{a.url}/v1/hosts/keys", json={}, headers=user).status_code == 403
    listed = httpx.get(f"{a.url}/v1/hosts/keys", headers=fleet.admin)
    assert listed.status_code == 200
    assert all(k not in listed.text for k in fleet.keys)
    assert {i["host_id"] for i in listed.json()["items"]} == {h.host_id for h in fleet.hosts}
    # Nothing logged a key.
    logs = "".join("".join(s.output) for s in fleet.brokers) + "".join(
        h.output for h in fleet.hosts
    )
    assert all(k.rsplit("_", 1)[1] not in logs for k in fleet.keys)


@pytest.mark.timeout(240)
def test_sandlot_host_says_what_is_wrong_with_its_key(fleet: Fleet, tmp_path: Path) -> None:
    a, _b = fleet.brokers
    base = ["host", "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0"]
    out = _cli(*base, "--broker", a.url)
    assert out.returncode == 2 and b"host's key" in out.stderr, out.stderr
    out = _cli(*base, "--broker", a.url, "--key", "sl_notahostkey")
    assert out.returncode == 2 and b"slh_" in out.stderr, out.stderr
    key_file = tmp_path / "key"
    key_file.write_text(fleet.keys[0][:-43] + "B" * 43)
    out = _cli(*base, "--broker", a.url, "--key-file", str(key_file))
    assert out.returncode == 1 and b"refuses this host key" in out.stderr, out.stderr
    assert b"B" * 43 not in out.stderr + out.stdout
    # A revoked key is refused at once, by both replicas.
    r = httpx.post(f"{a.url}/v1/hosts/keys", json={"name": "short-lived"}, headers=fleet.admin)
    revoked_key, revoked_host = r.json()["key"], r.json()["host_id"]
    r = httpx.delete(f"{a.url}/v1/hosts/keys/{revoked_host}", headers=fleet.admin)
    assert r.status_code == 204, r.text
    time.sleep(1.1)  # each replica trusts a looked-up key for up to a second
    for srv in fleet.brokers:
        r = httpx.get(
            f"{srv.url}/v1/hosts/self", headers={"Authorization": f"Bearer {revoked_key}"}
        )
        assert r.status_code == 401, r.text
    # A data directory of another host is refused (its sandboxes are not this key's).
    out = _cli(
        "host",
        "--data-dir",
        str(fleet.hosts[0].data_dir),
        "--broker",
        a.url,
        "--key",
        fleet.keys[1],
    )
    assert out.returncode == 2 and b"holds the sandboxes of host" in out.stderr, out.stderr
    # Both a store and a broker: one or the other.
    out = _cli(*base, "--broker", a.url, "--key", fleet.keys[0], "--store", fleet.store)
    assert out.returncode == 2 and b"not both" in out.stderr, out.stderr


@pytest.mark.timeout(300)
def test_a_broker_on_sqlite_says_it_registers_no_hosts(tmp_path: Path) -> None:
    srv = SandlotServer(tmp_path / "s").start(timeout=90)
    try:
        out = _cli("keys", "create-host", "--data-dir", str(srv.data_dir))
        assert out.returncode == 0, out.stderr
        key = out.stdout.decode().strip()
        r = httpx.get(f"{srv.url}/v1/hosts/self", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 501, r.text
        assert r.json()["error"]["code"] == "NOT_SUPPORTED"
        out = _cli(
            "host",
            "--data-dir",
            str(tmp_path / "h"),
            "--broker",
            srv.url,
            "--key",
            key,
            "--listen",
            "127.0.0.1:0",
        )
        assert out.returncode == 1 and b"cannot register hosts" in out.stderr, out.stderr
        assert b"SQLite" in out.stderr.replace(b"\n", b""), out.stderr
    finally:
        srv.stop()
        srv.cleanup()

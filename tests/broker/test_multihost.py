"""The multi-host run: 3 replicas on PostgreSQL behind HAProxy, each its own host, clients
in their own namespace (``tests/multihost.py``), and faults: kill -9 of a replica in the
middle of ensures, a replica cut from the database, PostgreSQL restarted, a replica that
hosts sandboxes cut from the balancer and the clients; and, in a topology of its own,
2 ``sandlot host`` nodes behind the balancer that the replicas place on
(``registered``), one partitioned from both networks and healed, then one partitioned in
the middle of an ensure storm.

Each fault runs during an ensure storm whose clients retry what is retryable (a
balancer's 502/503/504, ``503 BACKEND_UNAVAILABLE``) with the request's Idempotency-Key;
after it: one binding and one sandbox per thread, 0 server errors, every retried request
answered again alike (replayed), and after a reaper pass every replica's host runs
exactly the live sandboxes the store gives it (0 orphans either way).

CI size by default; ``SANDLOT_RELIABILITY_FULL=1`` (``./scripts/bench --reliability
--full``) for 100 threads x 200 concurrent ensures.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.broker.test_e2e import FAST_REAPER
from tests.figures import FULL, RecordProperty, report
from tests.multihost import MultiHost, multihost
from tests.sdk.test_server_crash import PRODUCER, expected_digest

#: The clean storm: threads x concurrent ensures each.
THREADS, PER_THREAD = (100, 200) if FULL else (10, 20)
#: A storm under a fault.
FAULT_THREADS, FAULT_PER_THREAD = (20, 200) if FULL else (4, 20)
#: Bytes of the exec stream that outlives its replica.
TOTAL = 32_000_000 if FULL else 8_000_000

pytestmark = [pytest.mark.reliability]


class Run:
    def __init__(self, cluster: MultiHost) -> None:
        self.cluster = cluster
        self.key = cluster.key("multihost", "agent")
        self.headers = {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with multihost(tmp_path_factory.mktemp("multihost")) as cluster:
        yield Run(cluster)
    # Nothing of the run is left: namespaces, links, the route, processes.
    assert cluster.topo.leftovers() == []


def storm(
    run: Run,
    prefix: str,
    threads: int,
    per_thread: int,
    fault: Callable[[], None] | None = None,
    names: list[str] | None = None,
) -> dict[str, Any]:
    """An ensure storm through the balancer; ``fault`` runs once the first thread is done,
    while the second thread's ensures are in flight. ``names``: these threads (existing
    ones, say) rather than ``threads`` new ones."""
    if names is None:
        names = [f"{prefix}_{i}_{uuid.uuid4().hex[:6]}" for i in range(threads)]
    call = run.cluster.driver.start(
        "storm", base=run.cluster.lb, headers=run.headers, threads=names, per_thread=per_thread
    )
    if fault is not None:
        call.wait_event("thread", timeout=600)
        fault()
    result: dict[str, Any] = call.result(1800)
    result["names"] = names
    return result


def assert_exactly_once(run: Run, result: dict[str, Any]) -> str:
    """One binding and one sandbox per thread (clients' view and store's), 0 server errors,
    every retried request replayed alike; the figure's words."""
    names = result["names"]
    assert result["server_errors"] == [], result["server_errors"][:5]
    assert result["gave_up"] == 0, result
    assert result["answers"] == {"200": len(names) * result["per_thread"]}, result["answers"]
    for name in names:
        got = result["threads"][name]
        assert len(got["sessions"]) == 1 and len(got["sandboxes"]) == 1, (name, got)
    like = f"thread:{names[0].rsplit('_', 2)[0]}_%"
    bindings, sandboxes = (
        run.cluster.counts("bindings", like),
        run.cluster.counts("sandboxes", like),
    )
    assert bindings == {f"thread:{n}": 1 for n in names}, bindings
    assert sandboxes == {f"thread:{n}": 1 for n in names}, sandboxes
    assert result["replays_mismatched"] == [], result["replays_mismatched"][:3]
    assert run.cluster.orphans() == {}
    retried = ", ".join(f"{n} {k}" for k, n in sorted(result["retried"].items())) or "none"
    return (
        f"{len(names)} bindings, {len(names)} sandboxes, 0 server errors, 0 orphans after a "
        f"reaper pass; retried: {retried}; {result['replays_checked']} retried requests sent "
        f"again: same binding, replayed ({result['seconds']:.0f} s)"
    )


def hosts_of(result: dict[str, Any]) -> dict[str, int]:
    """How many of the storm's sandboxes each replica hosts (from their dataplane routes)."""
    spread: dict[str, int] = {}
    for got in result["threads"].values():
        host = got["dataplanes"][0].split("/replicas/", 1)[1].split("/", 1)[0]
        spread[host] = spread.get(host, 0) + 1
    return dict(sorted(spread.items()))


@pytest.mark.timeout(1800 if FULL else 300)
def test_ensure_storm_over_three_replicas(run: Run, record_property: RecordProperty) -> None:
    result = storm(run, "clean", THREADS, PER_THREAD)
    result["per_thread"] = PER_THREAD
    figure = assert_exactly_once(run, result)
    spread = hosts_of(result)
    assert set(spread) == set(run.cluster.names), spread
    report(
        record_property,
        f"multi-host (namespaces: HAProxy, 3 replicas, PostgreSQL, clients): {PER_THREAD} "
        f"concurrent ensure for each of {THREADS} threads through the balancer: {figure}; "
        f"sandboxes on {spread}",
    )


@pytest.mark.timeout(180)
def test_revocation_at_one_replica_reaches_every_dataplane(
    run: Run, record_property: RecordProperty
) -> None:
    c = run.cluster
    releases = []
    for name in c.names:
        # Ensured at the replica itself: the sandbox is on that host.
        r = c.driver.call(
            "request",
            method="POST",
            url=f"{c.url(name)}/v1/sandbox/sessions",
            json={"thread_id": f"revoke_{name}_{uuid.uuid4().hex[:6]}", "mode": "ensure"},
            headers=run.headers,
            timeout=60,
        )
        assert r["status"] == 200, r
        grant = r["body"]
        through_lb = grant["dataplane"]["http_base_url"]
        assert f"/replicas/{name}/" in through_lb, through_lb
        direct = through_lb.replace(f"{c.lb}/replicas/{name}", c.url(name))
        releases.append(
            {
                # Every release at the first replica, whichever host runs the sandbox.
                "url": f"{c.url(c.names[0])}/v1/sandbox/sessions/{grant['session_id']}",
                "headers": run.headers,
                "token": grant["token"],
                "dataplanes": [through_lb, direct],
            }
        )
    latencies = c.driver.call("revoke", releases=releases)["latencies"]
    assert len(latencies) == 2 * len(c.names), latencies
    assert max(latencies.values()) < 1.0, latencies
    report(
        record_property,
        f"tokens of sandboxes on each of 3 hosts, revoked at one replica: refused (401) by "
        f"every dataplane (through the balancer and directly) within "
        f"{max(latencies.values()) * 1000:.0f} ms (median "
        f"{sorted(latencies.values())[len(latencies) // 2] * 1000:.0f} ms)",
    )


@pytest.mark.timeout(600)
def test_exec_stream_survives_its_replica_killed(run: Run, record_property: RecordProperty) -> None:
    c = run.cluster
    call = c.driver.start(
        "stream",
        base=c.lb,
        key=run.key,
        thread=f"stream_{uuid.uuid4().hex[:6]}",
        producer=PRODUCER,
        total=TOTAL,
    )
    granted = call.wait_event("dataplane", timeout=120)
    dataplane, session = granted["url"], granted["session"]
    host = dataplane.split("/replicas/", 1)[1].split("/", 1)[0]
    call.wait_event("third", timeout=300)
    c.replicas[host].kill9()
    # Meanwhile the others answer the control plane; then the host comes back.
    meanwhile = [
        c.driver.call(
            "request",
            method="GET",
            url=f"{c.lb}/v1/sandbox/sessions/{session}",
            headers=run.headers,
        )["status"]
        for _ in range(5)
    ]
    c.restart(host)
    result = call.result(300)
    assert meanwhile == [200] * 5, meanwhile
    assert result["out_of_order"] == [], result
    assert result["exit_code"] == 5, result
    assert result["received"] == TOTAL, result
    assert result["sha256"] == expected_digest(TOTAL)
    assert result["reconnects"] >= 1, result
    assert c.orphans() == {}
    report(
        record_property,
        f"multi-host: exec stream through the balancer, kill -9 of the replica it came "
        f"through after {TOTAL // 3:,} of {TOTAL:,} bytes, restart: every byte once "
        f"(identical SHA-256), {result['reconnects']} reconnects, 0 orphans",
    )


def _later(
    seconds: float, action: Callable[[], None], problems: list[BaseException]
) -> threading.Thread:
    def run() -> None:
        try:
            time.sleep(seconds)
            action()
        except BaseException as exc:  # reported by the test
            problems.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def faulted(
    run: Run,
    record_property: RecordProperty,
    name: str,
    fault: Callable[[], None],
    repair: Callable[[], None],
    after: float,
    what: str,
    notes: Callable[[], str] | None = None,
) -> None:
    """A storm; ``fault`` while its ensures are in flight, ``repair`` ``after`` seconds
    later (the storm goes on meanwhile); then every check."""
    problems: list[BaseException] = []
    repairs: list[threading.Thread] = []

    def inject() -> None:
        fault()
        repairs.append(_later(after, repair, problems))

    result = storm(run, name, FAULT_THREADS, FAULT_PER_THREAD, inject)
    for t in repairs:
        t.join()
    assert not problems, problems
    assert repairs, "the fault never ran"
    result["per_thread"] = FAULT_PER_THREAD
    figure = assert_exactly_once(run, result)
    report(
        record_property,
        f"multi-host, {what}, during {FAULT_PER_THREAD} concurrent ensure for each of "
        f"{FAULT_THREADS} threads through the balancer: {figure}"
        + (f"; {notes()}" if notes is not None else ""),
    )


@pytest.mark.timeout(1800 if FULL else 300)
def test_kill9_of_a_replica_mid_ensure(run: Run, record_property: RecordProperty) -> None:
    c = run.cluster
    faulted(
        run,
        record_property,
        "kill9",
        lambda: c.replicas["r2"].kill9(),
        lambda: c.restart("r2"),
        after=1.0,
        what="kill -9 of a replica mid-ensure (restarted 1 s later)",
    )


@pytest.mark.timeout(1800 if FULL else 300)
def test_replica_cut_from_the_database(run: Run, record_property: RecordProperty) -> None:
    c = run.cluster
    direct: list[str] = []

    def probe_then_heal() -> None:
        # Asked directly meanwhile, the cut replica answers (its connections to the
        # database time out in seconds, not when TCP gives up), and says the store is
        # unavailable.
        try:
            for n in range(2):
                r = c.driver.call(
                    "request",
                    method="POST",
                    url=f"{c.url('r3')}/v1/sandbox/sessions",
                    json={"thread_id": f"dbcut_direct_{n}", "mode": "ensure"},
                    headers=run.headers,
                    timeout=60,
                )
                body = r["body"] if isinstance(r["body"], dict) else {}
                direct.append(f"{r['status']} {body.get('error', {}).get('code', '')}".strip())
        finally:
            c.topo.heal("r3", "back")
        # Back by itself: the balancer's health checks pass again, no restart.
        c.wait_balanced({"r3"})

    faulted(
        run,
        record_property,
        "dbcut",
        lambda: c.topo.partition("r3", "back"),
        probe_then_heal,
        after=1.0,
        what="a replica cut from the database (link down), back by itself",
        notes=lambda: f"asked directly while cut, the replica answered {direct}",
    )
    assert direct == ["503 BACKEND_UNAVAILABLE"] * 2, direct


@pytest.mark.timeout(1800 if FULL else 300)
def test_postgresql_restarted(run: Run, record_property: RecordProperty) -> None:
    c = run.cluster
    faulted(
        run,
        record_property,
        "pgrestart",
        lambda: c.pg.stop("fast"),
        c.pg.start,
        after=3.0,
        what="PostgreSQL stopped mid-ensure and started 3 s later",
    )


@pytest.mark.timeout(600)
def test_replica_hosting_sandboxes_cut_from_clients(
    run: Run, record_property: RecordProperty
) -> None:
    """The sandboxes of a replica the balancer and clients cannot reach: their threads are
    still negotiated (by the other replicas) to the same binding and sandbox, never a new
    one; their dataplane answers 503 meanwhile; healed, the same sandbox, its files kept."""
    c = run.cluster
    result = storm(run, "cut", 6, 10)
    on_r1 = [n for n, got in result["threads"].items() if "/replicas/r1/" in got["dataplanes"][0]]
    if not on_r1:
        # Round robin placed none there: one made at r1 itself.
        name = f"cut_r1_{uuid.uuid4().hex[:6]}"
        r = c.driver.call(
            "request",
            method="POST",
            url=f"{c.url('r1')}/v1/sandbox/sessions",
            json={"thread_id": name, "mode": "ensure"},
            headers=run.headers,
        )
        assert r["status"] == 200, r
        on_r1 = [name]
    thread = on_r1[0]
    before = _ensure(run, thread)
    dataplane = before["dataplane"]["http_base_url"]
    written = _exec(run, dataplane, before["token"], "echo kept > /workspace/kept && echo ok")
    assert written == (200, "ok\n"), written

    c.topo.partition("r1", "front")
    try:
        c.wait_unbalanced("r1")
        during = [_ensure(run, thread) for _ in range(10)]
        assert {g["session_id"] for g in during} == {before["session_id"]}
        assert {g["sandbox"]["id"] for g in during} == {before["sandbox"]["id"]}
        status, _ = _exec(run, dataplane, during[-1]["token"], "true")
        assert status == 503, status
    finally:
        c.topo.heal("r1", "front")
    c.wait_balanced({"r1"})
    after = _ensure(run, thread)
    assert after["sandbox"]["id"] == before["sandbox"]["id"]
    assert _exec(run, dataplane, after["token"], "cat /workspace/kept") == (200, "kept\n")
    assert c.counts("sandboxes", f"thread:{thread}") == {f"thread:{thread}": 1}
    assert c.orphans() == {}
    report(
        record_property,
        "multi-host: a replica hosting sandboxes cut from the balancer and clients (link "
        "down): its threads negotiated by the others to the same binding and sandbox (10 of "
        "10), its dataplane 503 (retryable) meanwhile; healed: the same sandbox, its files "
        "kept, 0 duplicates, 0 orphans",
    )


def _ensure(run: Run, thread: str) -> dict[str, Any]:
    r = run.cluster.driver.call(
        "request",
        method="POST",
        url=f"{run.cluster.lb}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": "ensure"},
        headers={**run.headers, "Idempotency-Key": str(uuid.uuid4())},
        timeout=60,
    )
    assert r["status"] == 200, r
    return dict(r["body"])


def _exec(run: Run, dataplane: str, token: str, command: str) -> tuple[int, str]:
    r = run.cluster.driver.call(
        "request",
        method="POST",
        url=f"{dataplane}/exec",
        json={"command": command},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    body = r["body"]
    return r["status"], body.get("stdout", "") if isinstance(body, dict) else ""


#: Sandbox hosts apart from the replicas: heartbeats and loss short enough for CI, long
#: enough that a healthy host on a loaded machine never misses them.
HOST_HEARTBEAT, HOST_LOST_AFTER = 0.5, 6.0
HOSTS = FAST_REAPER + (
    f"[hosts]\nheartbeat_seconds = {HOST_HEARTBEAT}\nlost_after_seconds = {HOST_LOST_AFTER}\n"
)
HOST_THREADS = 6
#: Each host's capacity: room on one host for both hosts' threads, and a storm's.
HOST_CAPACITY = 32 if FULL else 16
#: The storm whose hosts are partitioned: threads x concurrent ensures each.
HOST_STORM_THREADS, HOST_STORM_PER_THREAD = (12, 200) if FULL else (6, 20)


@pytest.mark.timeout(2400 if FULL else 600)
def test_sandbox_host_partitioned_from_everything(
    tmp_path_factory: pytest.TempPathFactory, record_property: RecordProperty
) -> None:
    """Two ``sandlot host`` nodes reached through the balancer, the replicas placing on
    them (``registered``): one host cut from both networks has its sandboxes failed
    (``host_lost``) once; their threads say so (410) and start over on the other host;
    healed, it is ``up`` again and removes what it still ran. Then a host cut in the
    middle of an ensure storm: the same, and no thread rebound, every retry answered
    alike."""
    base = tmp_path_factory.mktemp("multihost-hosts")
    with multihost(
        base,
        settings=HOSTS,
        extra={"SANDLOT_SANDBOX_HOSTS": "registered"},
        hosts=("h1", "h2"),
    ) as c:
        for name in ("h1", "h2"):
            c.add_sandbox_host(name, capacity=HOST_CAPACITY, config=HOSTS)
        _partition_a_sandbox_host(c, record_property)
        _partition_a_host_mid_storm(c, record_property)
    assert c.topo.leftovers() == []


def _partition_a_sandbox_host(c: MultiHost, record_property: RecordProperty) -> None:
    run = Run(c)
    statuses: list[int] = []

    def ensure(thread: str, mode: str = "ensure") -> dict[str, Any]:
        r = c.driver.call(
            "request",
            method="POST",
            url=f"{c.lb}/v1/sandbox/sessions",
            json={"thread_id": thread, "mode": mode},
            headers={**run.headers, "Idempotency-Key": str(uuid.uuid4())},
            timeout=60,
        )
        statuses.append(r["status"])
        return dict(r)

    def host_of(grant: dict[str, Any]) -> str:
        return _host_of(c, grant["dataplane"]["http_base_url"])

    def exec_until_ok(grant: dict[str, Any], command: str) -> tuple[int, str]:
        # The sandbox may still be starting: its dataplane says so (retryable).
        deadline = time.monotonic() + 60
        while True:
            got = _exec(run, grant["dataplane"]["http_base_url"], grant["token"], command)
            if got[0] == 200 or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    tag = uuid.uuid4().hex[:6]
    threads = [f"hosts_{tag}_{i}" for i in range(HOST_THREADS)]
    grants = {}
    for thread in threads:
        r = ensure(thread)
        assert r["status"] == 200, r
        grants[thread] = r["body"]
    placed = {t: host_of(g) for t, g in grants.items()}
    spread = {n: sorted(placed.values()).count(n) for n in c.hosts}
    # Most free slots first: the hosts take turns (while both beat in time: a host whose
    # heartbeat is late on a loaded machine is skipped meanwhile, so no exact split).
    assert all(spread.values()), placed
    for thread, grant in grants.items():
        got = exec_until_ok(grant, f"echo {thread} > mark && cat mark")
        assert got == (200, f"{thread}\n"), (thread, got, c.hosts[placed[thread]].output[-2000:])

    # The host with more of them is cut (the survivor has room for their new sandboxes).
    victim = max(spread, key=lambda n: spread[n])
    (survivor,) = set(spread) - {victim}
    lost = [t for t in threads if placed[t] == victim]
    kept = [t for t in threads if placed[t] == survivor]
    watched = grants[lost[0]]
    sid = watched["session_id"]
    snap = c.driver.call(
        "request", method="GET", url=f"{c.url('r2')}/v1/sandbox/sessions/{sid}", headers=run.headers
    )["body"]
    subscriber = c.driver.start(
        "events",
        url=f"{c.url('r2')}/v1/sandbox/sessions/{sid}/events"
        f"?after={snap['binding']['last_event_sequence']}",
        headers=run.headers,
        until="binding.failed",
        linger=3.0,
        timeout=HOST_LOST_AFTER + 60,
    )
    subscriber.wait_event("open", timeout=30)

    c.topo.partition(victim, "front")
    c.topo.partition(victim, "back")
    cut_at = time.monotonic()
    try:
        events = subscriber.result(HOST_LOST_AFTER + 90)["events"]
        failed_after = time.monotonic() - cut_at
        failed = [e for e in events if e["event_type"] == "binding.failed"]
        assert len(failed) == 1, events
        assert failed[0]["details"]["phase"] == {
            "from": "active",
            "to": "failed",
            "reason": "host_lost",
        }, failed
        victim_id = c.hosts[victim].host_id
        assert c.pg.query(f"SELECT state FROM hosts WHERE id = '{victim_id}'") == [["lost"]]
        rows = c.pg.query(
            "SELECT state, reason FROM sandboxes WHERE id IN ("
            + ", ".join(f"'{grants[t]['sandbox']['id']}'" for t in lost)
            + ")"
        )
        assert rows == [["failed", "host_lost"]] * len(lost), rows
        # Each thread of the lost host says what happened; the others go on as before.
        for thread in lost:
            r = ensure(thread)
            assert r["status"] == 410, r
            err = r["body"]["error"]
            assert err["code"] == "SESSION_EXPIRED", err
            assert err["metadata"]["reason"] == "host_lost", err
        for thread in kept:
            r = ensure(thread)
            assert r["status"] == 200, r
            assert r["body"]["session_id"] == grants[thread]["session_id"], r
            assert exec_until_ok(r["body"], "cat mark") == (200, f"{thread}\n")
        # Starting over knowingly lands on the surviving host.
        r = ensure(lost[0], mode="create_only")
        assert r["status"] == 200, r
        fresh = r["body"]
        assert host_of(fresh) == survivor, fresh
        assert exec_until_ok(fresh, "cat mark 2>/dev/null; echo new") == (200, "new\n")
    finally:
        c.topo.heal(victim, "front")
        c.topo.heal(victim, "back")

    # Healed: the host beats again (up), and removes the failed sandboxes it still ran.
    deadline = time.monotonic() + 60
    while c.pg.query(f"SELECT state FROM hosts WHERE id = '{victim_id}'") != [["up"]]:
        assert time.monotonic() < deadline, c.hosts[victim].output[-3000:]
        time.sleep(0.2)
    assert c.orphans(timeout=60) == {}
    like = f"thread:hosts_{tag}_%"
    live = c.pg.query(
        "SELECT scope_key, count(*) FROM sandboxes WHERE scope_key LIKE "
        f"'{like}' AND state NOT IN ('terminated', 'failed') GROUP BY scope_key"
    )
    assert sorted(live) == sorted([[f"thread:{t}", "1"] for t in threads if t not in lost[1:]]), (
        live
    )
    assert c.counts("bindings", like).get(f"thread:{lost[0]}") == 2
    r = ensure(lost[0])
    assert r["status"] == 200 and r["body"]["session_id"] == fresh["session_id"], r
    assert [s for s in statuses if s >= 500] == [], statuses
    report(
        record_property,
        f"multi-host with 2 sandbox hosts (sandlot host nodes; 3 replicas placing on them): "
        f"{HOST_THREADS} threads placed {spread}, exec on each through its host's dataplane; "
        f"one host cut from both networks: its {len(lost)} sandboxes failed (host_lost) "
        f"once, seen by a subscriber {failed_after:.1f} s after the cut (lost_after "
        f"{HOST_LOST_AFTER:.0f} s), their ensures 410 SESSION_EXPIRED (host_lost), "
        f"create_only on the surviving host, the other host's {len(kept)} threads unchanged; "
        f"healed: the host up again, the failed sandboxes removed from it, 0 orphans, "
        f"0 duplicates, 0 server errors in {len(statuses)} requests",
    )


def _host_of(c: MultiHost, dataplane: str) -> str:
    """The sandbox host whose dataplane ``dataplane`` is (through the balancer)."""
    (name,) = [n for n, h in c.hosts.items() if dataplane.startswith(h.public + "/dp/")]
    return name


def _wait_host_state(c: MultiHost, host_id: str, state: str, timeout: float) -> float:
    """Until the store says the host is ``state``; the seconds it took."""
    started = time.monotonic()
    while c.pg.query(f"SELECT state FROM hosts WHERE id = '{host_id}'") != [[state]]:
        assert time.monotonic() - started < timeout, (host_id, state)
        time.sleep(0.1)
    return time.monotonic() - started


def _partition_a_host_mid_storm(c: MultiHost, record_property: RecordProperty) -> None:
    """Threads on both hosts (placed by a storm through the balancer, their dataplanes
    through it too); a storm over them, one host cut from both networks after its first
    thread: while the host is merely unreachable, every thread keeps its binding; once
    it is declared lost, a storm over the same threads: the lost host's threads answered
    410 ``host_lost`` (each retry alike), the others their binding; a storm of new
    threads lands on the surviving host alone; nothing rebound, nothing duplicated, no
    server error; healed, 0 orphans."""
    run = Run(c)
    made = storm(run, "hstorm", HOST_STORM_THREADS, HOST_STORM_PER_THREAD)
    made["per_thread"] = HOST_STORM_PER_THREAD
    assert_exactly_once(run, made)
    names: list[str] = made["names"]
    placed = {n: _host_of(c, made["threads"][n]["dataplanes"][0]) for n in names}
    for name in names:
        got = made["threads"][name]
        status, out = _exec_until_ok(run, got["dataplanes"][0], name)
        assert (status, out) == (200, f"{name}\n"), (name, status, out)
    # Both hosts, as a rule (a host whose heartbeat is late on a loaded machine is skipped
    # meanwhile: no exact split).
    spread = {h: list(placed.values()).count(h) for h in c.hosts}
    # The first thread's host is cut while the storm's later threads are in flight.
    victim = placed[names[0]]
    (survivor,) = set(c.hosts) - {victim}
    victim_id = c.hosts[victim].host_id
    lost = [n for n in names if placed[n] == victim]
    kept = [n for n in names if placed[n] == survivor]
    sessions = {n: made["threads"][n]["sessions"][0] for n in names}

    cut_at: list[float] = []

    def cut() -> None:
        c.topo.partition(victim, "front")
        c.topo.partition(victim, "back")
        cut_at.append(time.monotonic())

    try:
        during = storm(run, "", 0, HOST_STORM_PER_THREAD, fault=cut, names=names)
        _assert_unrebound(during, names, lost, sessions, HOST_STORM_PER_THREAD)
        _wait_host_state(c, victim_id, "lost", HOST_LOST_AFTER + 60)
        declared = time.monotonic() - cut_at[0]
        after = storm(run, "", 0, HOST_STORM_PER_THREAD, names=names)
        _assert_unrebound(after, names, lost, sessions, HOST_STORM_PER_THREAD)
        assert after["answers"] == {
            "200": len(kept) * HOST_STORM_PER_THREAD,
            "410 SESSION_EXPIRED": len(lost) * HOST_STORM_PER_THREAD,
        }, after["answers"]
        assert all(after["threads"][n]["sessions"] == [] for n in lost), after["threads"]
        # A retry of a refused ensure (its Idempotency-Key again) is refused alike.
        key = str(uuid.uuid4())
        refusals = [
            c.driver.call(
                "request",
                method="POST",
                url=f"{c.lb}/v1/sandbox/sessions",
                json={"thread_id": lost[0], "mode": "ensure"},
                headers={**run.headers, "Idempotency-Key": key},
                timeout=60,
            )
            for _ in range(2)
        ]
        assert [r["status"] for r in refusals] == [410, 410], refusals
        assert refusals[0]["body"] == refusals[1]["body"], refusals
        assert refusals[0]["body"]["error"]["metadata"]["reason"] == "host_lost", refusals
        # Failed once each, visibly: one binding.failed (host_lost) on each lost binding.
        for name in lost:
            rows = c.pg.query(
                "SELECT event::jsonb->'details'->'phase'->>'reason' FROM events "
                f"WHERE stream_id = '{sessions[name]}' "
                "AND event::jsonb->>'event_type' = 'binding.failed'"
            )
            assert rows == [["host_lost"]], (name, rows)
        states = c.pg.query(
            "SELECT s.state, s.reason, count(*) FROM sandboxes s JOIN bindings b "
            "ON b.sandbox_id = s.id WHERE b.id IN ("
            + ", ".join(f"'{sessions[n]}'" for n in lost)
            + ") GROUP BY s.state, s.reason"
        )
        assert states == [["failed", "host_lost", str(len(lost))]], states
        # New threads meanwhile: all on the surviving host, once each.
        fresh = storm(run, "hfresh", HOST_STORM_THREADS, HOST_STORM_PER_THREAD)
        assert fresh["server_errors"] == [] and fresh["gave_up"] == 0, fresh
        assert fresh["answers"] == {"200": HOST_STORM_THREADS * HOST_STORM_PER_THREAD}
        assert fresh["replays_mismatched"] == [], fresh["replays_mismatched"][:3]
        for name in fresh["names"]:
            got = fresh["threads"][name]
            assert len(got["sessions"]) == 1 and len(got["sandboxes"]) == 1, (name, got)
            assert _host_of(c, got["dataplanes"][0]) == survivor, got
        like = f"thread:{fresh['names'][0].rsplit('_', 2)[0]}_%"
        assert c.counts("bindings", like) == {f"thread:{n}": 1 for n in fresh["names"]}
        assert c.counts("sandboxes", like) == {f"thread:{n}": 1 for n in fresh["names"]}
    finally:
        c.topo.heal(victim, "front")
        c.topo.heal(victim, "back")
    _wait_host_state(c, victim_id, "up", 60)
    assert c.orphans(timeout=60) == {}
    # Nothing was rebound: one binding and one sandbox per thread of the storm.
    like = f"thread:{names[0].rsplit('_', 2)[0]}_%"
    assert c.counts("bindings", like) == {f"thread:{n}": 1 for n in names}
    assert c.counts("sandboxes", like) == {f"thread:{n}": 1 for n in names}
    for name in kept:
        status, out = _exec_until_ok(run, made["threads"][name]["dataplanes"][0], name, "cat mark")
        assert (status, out) == (200, f"{name}\n"), (name, status, out)
    report(
        record_property,
        f"multi-host, sandbox hosts behind the balancer: {HOST_STORM_THREADS} threads placed "
        f"{spread}; host {victim} cut from both networks during {HOST_STORM_PER_THREAD} "
        f"concurrent ensure for each: no thread answered another binding than its own "
        f"(answers {during['answers']}: 410 host_lost once it was declared lost, "
        f"seen {declared:.1f} s after the cut, {during['seconds']:.0f} s storm); a storm over the "
        f"same threads: its {len(lost)} threads 410 host_lost, each failed once (one "
        f"binding.failed), the other host's {len(kept)} their binding; a retried refusal "
        f"refused alike; {HOST_STORM_THREADS} new threads on "
        f"{survivor} alone; healed: 0 orphans, 0 duplicates, 0 server errors",
    )


def _assert_unrebound(
    result: dict[str, Any],
    names: list[str],
    lost: list[str],
    sessions: dict[str, str],
    per_thread: int,
) -> None:
    """No thread answered with another binding than its own; answers are 200 or, for a
    thread of the lost host once it is declared lost, 410; no server error, no retried
    request answered differently."""
    assert result["server_errors"] == [], result["server_errors"][:5]
    assert result["gave_up"] == 0, result
    assert set(result["answers"]) <= {"200", "410 SESSION_EXPIRED"}, result["answers"]
    assert sum(result["answers"].values()) == len(names) * per_thread, result["answers"]
    assert result["answers"].get("410 SESSION_EXPIRED", 0) <= len(lost) * per_thread
    for name in names:
        got = result["threads"][name]
        assert set(got["sessions"]) <= {sessions[name]}, (name, got)
        if name not in lost:
            assert got["sessions"] == [sessions[name]], (name, got)
    assert result["replays_mismatched"] == [], result["replays_mismatched"][:3]


def _exec_until_ok(
    run: Run, dataplane: str, thread: str, command: str | None = None
) -> tuple[int, str]:
    """Exec in a storm thread's sandbox with a fresh grant (the storm kept none)."""
    r = run.cluster.driver.call(
        "request",
        method="POST",
        url=f"{run.cluster.lb}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": "ensure"},
        headers=run.headers,
        timeout=60,
    )
    assert r["status"] == 200, r
    grant = r["body"]
    assert grant["dataplane"]["http_base_url"] == dataplane, grant
    deadline = time.monotonic() + 60
    while True:
        got = _exec(run, dataplane, grant["token"], command or f"echo {thread} > mark && cat mark")
        if got[0] == 200 or time.monotonic() > deadline:
            return got
        time.sleep(0.2)

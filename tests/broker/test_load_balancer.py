"""Two ``sandlot serve`` replicas on one PostgreSQL behind a real HAProxy (``tests/haproxy.py``).

Clients know the balancer only: grants point at ``{balancer}/replicas/NAME``, the route to
the replica that hosts the sandbox, so dataplane traffic crosses the balancer too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from sandlot.sdk import AsyncSandlot
from tests.broker.test_e2e import FAST_REAPER
from tests.broker.test_replicas import ensure_storm
from tests.faultproxy import serving
from tests.figures import RecordProperty, report
from tests.haproxy import REPLICA_HEADER, haproxy
from tests.pg import postgres_cluster
from tests.sdk.test_server_crash import PRODUCER, expected_digest
from tests.servers import SandlotServer, free_port
from tests.web.browser import Browser
from tests.web.test_terminals import opened

#: Bytes the streamed command prints.
TOTAL = 8_000_000


@dataclass
class Cluster:
    lb: str
    replicas: dict[str, SandlotServer]
    store_url: str

    def headers(self, user: str, actor: str = "human") -> dict[str, str]:
        return next(iter(self.replicas.values())).headers(user, actor)

    def key(self, user: str, actor: str = "human") -> str:
        return next(iter(self.replicas.values())).key(user, actor)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("balanced")
    with postgres_cluster() as url:
        config = FAST_REAPER + f'\n[server]\nstore_url = "{url}"\n'
        ports = {"a": free_port(), "b": free_port()}
        lb_port = free_port()
        lb = f"http://127.0.0.1:{lb_port}"
        replicas: dict[str, SandlotServer] = {}
        try:
            with haproxy(lb_port, ports):
                for name, port in ports.items():
                    # One issuer (the balancer); each replica's dataplane is reached
                    # through the balancer's route to that replica.
                    env = {
                        "SANDLOT_PUBLIC_URL": lb,
                        "SANDLOT_DATAPLANE_URL": f"{lb}/replicas/{name}",
                    }
                    replicas[name] = _start(
                        SandlotServer(base / name, config=config, env=env), port
                    )
                _wait_balanced(lb, set(ports))
                yield Cluster(lb, replicas, url)
        finally:
            for srv in replicas.values():
                srv.stop()
                srv.cleanup()


def _start(srv: SandlotServer, port: int) -> SandlotServer:
    """Start (or restart) a replica on ``port`` and wait until it is ready itself (it
    announces the balancer's address, which answers as soon as any replica does)."""
    srv.port = port
    srv.start()
    srv.port, srv.url = port, f"http://127.0.0.1:{port}"
    _wait_ready(srv.url)
    return srv


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} never became ready")


def _wait_balanced(lb: str, names: set[str], timeout: float = 30) -> None:
    """Until the balancer's health checks passed for every replica in ``names``."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{lb}/readyz", timeout=2)
        except httpx.HTTPError:
            r = None
        if r is not None and r.status_code == 200:
            seen.add(r.headers.get(REPLICA_HEADER, ""))
            if names <= seen:
                return
        time.sleep(0.05)
    raise AssertionError(f"the balancer never sent requests to all of {names}: {seen}")


@pytest.mark.reliability
@pytest.mark.timeout(240)
def test_ensures_through_the_balancer(cluster: Cluster, record_property: RecordProperty) -> None:
    headers = cluster.headers("lb")
    results = asyncio.run(ensure_storm([cluster.lb], headers, "thr_lb1", 60, connections=16))
    assert {r.status_code for r in results} == {200}, [r.text for r in results][:3]
    served = collections.Counter(r.headers[REPLICA_HEADER] for r in results)
    assert set(served) == set(cluster.replicas), served
    grants = [r.json() for r in results]
    assert len({g["session_id"] for g in grants}) == 1
    assert len({g["sandbox"]["id"] for g in grants}) == 1
    dataplane = grants[0]["dataplane"]["http_base_url"]
    assert dataplane.startswith(f"{cluster.lb}/replicas/"), dataplane

    # The command line, given the balancer's address only.
    env = {
        **os.environ,
        "SANDLOT_URL": cluster.lb,
        "SANDLOT_API_KEY": cluster.key("lb", "agent"),
    }
    for n in range(3):
        r = subprocess.run(
            [sys.executable, "-m", "sandlot.cli.main", "exec", "thr_lb2", "--", f"echo cli{n}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and r.stdout == f"cli{n}\n", (r.returncode, r.stdout, r.stderr)
    report(
        record_property,
        f"60 concurrent ensure of one thread through HAProxy over 2 replicas "
        f"({dict(sorted(served.items()))}): 1 binding, 1 sandbox, 0 errors; CLI exec through "
        "the balancer",
    )


@pytest.mark.reliability
@pytest.mark.timeout(120)
async def test_binding_events_through_the_balancer(cluster: Cluster) -> None:
    key = cluster.key("lbev", "agent")
    async with AsyncSandlot(cluster.lb, key) as client:
        sandbox = await client.ensure("thr_lbev")
        sid = sandbox.grant.session_id
        assert sid is not None
        snap = await client.session(sid)
        after = snap.binding.last_event_sequence
        seen: list[int] = []

        async def follow() -> None:
            async with client.binding_events(sid, after=after, timeout=60) as events:
                async for event in events:
                    seen.append(event.sequence)
                    return

        reader = asyncio.create_task(follow())
        await asyncio.sleep(0.5)
        # Released through the balancer: whichever replica takes it, the stream (held
        # open through the balancer, at either replica) sees it.
        await client.release(sid)
        await asyncio.wait_for(reader, 30)
    assert seen and seen[0] > after, (seen, after)


@pytest.mark.reliability
@pytest.mark.timeout(300)
async def test_exec_stream_survives_its_replica_killed(
    cluster: Cluster, record_property: RecordProperty
) -> None:
    key = cluster.key("lbcrash", "agent")
    thread = f"thr_lbcrash_{uuid.uuid4().hex[:6]}"
    digest = hashlib.sha256()
    received = 0
    restarted = threading.Event()
    problems: list[BaseException] = []
    meanwhile: list[int] = []

    async with AsyncSandlot(cluster.lb, key) as client:
        sandbox = await client.ensure(thread)
        dataplane = sandbox.grant.http_base_url
        host = next(
            n for n in cluster.replicas if dataplane.startswith(f"{cluster.lb}/replicas/{n}/")
        )
        srv = cluster.replicas[host]
        headers = {"Authorization": f"Bearer {key}"}

        def crash_and_restart() -> None:
            try:
                srv.kill9()
                # Meanwhile the other replica answers the control plane alone.
                for _ in range(5):
                    r = httpx.get(
                        f"{cluster.lb}/v1/sandbox/sessions/{sandbox.grant.session_id}",
                        headers=headers,
                        timeout=30,
                    )
                    meanwhile.append(r.status_code)
                _start(srv, srv.port)
            except BaseException as exc:  # reported by the test below
                problems.append(exc)
            finally:
                restarted.set()

        cmd = await sandbox.stream(["python3", "-c", PRODUCER, str(TOTAL)])
        crash: threading.Thread | None = None
        async with asyncio.timeout(240):
            async for chunk in cmd:
                if chunk.stream != "stdout":
                    continue
                assert chunk.offset == received, (chunk.offset, received)
                data = chunk.data.encode()
                digest.update(data)
                received += len(data)
                if crash is None and received >= TOTAL // 3:
                    crash = threading.Thread(target=crash_and_restart)
                    crash.start()
        await asyncio.to_thread(restarted.wait, 60)
        assert crash is not None
        assert not problems, problems
    assert meanwhile == [200] * 5, meanwhile
    assert cmd.exit_code == 5
    assert received == TOTAL
    assert digest.hexdigest() == expected_digest(TOTAL)
    assert cmd.reconnects >= 1
    report(
        record_property,
        f"exec stream through HAProxy, kill -9 of the replica hosting the sandbox after "
        f"{TOTAL // 3:,} of {TOTAL:,} bytes, restart: every byte once (identical SHA-256), "
        f"{cmd.reconnects} reconnects; the other replica answered the control plane meanwhile",
    )


@pytest.mark.timeout(180)
def test_a_sticky_balancer_keeps_a_client_on_its_replica_until_it_dies(cluster: Cluster) -> None:
    # The set-up docs/SCALE.md recommends: a cookie keeps a client on the replica that
    # answered it first; new clients are spread; a dead replica's clients move on.
    ports = {name: srv.port for name, srv in cluster.replicas.items()}
    with haproxy(free_port(), ports, sticky=True) as lb:
        _wait_balanced(lb, set(ports))
        headers = cluster.headers("sticky")
        thread = f"thr_sticky_{uuid.uuid4().hex[:6]}"
        body = {"thread_id": thread, "mode": "ensure"}
        first_seen: set[str] = set()
        clients = [httpx.Client(base_url=lb, timeout=30, headers=headers) for _ in range(4)]
        try:
            answered_by: list[str] = []
            for client in clients:
                rs = [client.post("/v1/sandbox/sessions", json=body) for _ in range(6)]
                assert {r.status_code for r in rs} == {200}, [r.text for r in rs][:2]
                served = {r.headers[REPLICA_HEADER] for r in rs}
                assert len(served) == 1, served  # every request of a client on one replica
                answered_by.append(served.pop())
            first_seen.update(answered_by)
            assert first_seen == set(ports), answered_by  # and the clients spread
            gone = answered_by[0]
            srv = cluster.replicas[gone]
            srv.kill9()
            try:
                after = [clients[0].post("/v1/sandbox/sessions", json=body) for _ in range(6)]
                assert {r.status_code for r in after} == {200}, [r.text for r in after][:2]
                moved = {r.headers[REPLICA_HEADER] for r in after}
                assert len(moved) == 1 and gone not in moved, moved
            finally:
                _start(srv, srv.port)
                _wait_balanced(cluster.lb, set(ports))
        finally:
            for client in clients:
                client.close()


@dataclass
class ReplicaBrowser(Browser):
    """A signed-in browser talking to one replica directly, its page's origin the
    balancer's (the public URL)."""

    public: str = ""

    @property
    def origin(self) -> str:
        return self.public


@pytest.mark.timeout(180)
async def test_a_browser_signs_in_and_works_whichever_replica_answers(cluster: Cluster) -> None:
    # ``sandlot open``'s request goes through the balancer; the browser's to the other
    # replica: the link, the session, its CSRF token and its terminals are the store's.
    key = await asyncio.to_thread(cluster.key, "web-ada")
    thread = f"thr_web_{uuid.uuid4().hex[:6]}"
    async with httpx.AsyncClient(timeout=60) as client:
        made = await client.post(
            f"{cluster.lb}/api/auth/links",
            headers={"Authorization": f"Bearer {key}"},
            json={"next": f"/?thread={thread}"},
        )
        assert made.status_code == 201, made.text
        link = made.json()["url"]
        assert link.startswith(f"{cluster.lb}/login?token=")
        maker = made.headers[REPLICA_HEADER]
        (other,) = set(cluster.replicas) - {maker}
        urls = {name: srv.url for name, srv in cluster.replicas.items()}
        signed_in = await client.get(
            urls[other] + link.removeprefix(cluster.lb), follow_redirects=False
        )
        assert signed_in.status_code == 303, signed_in.text
        assert signed_in.headers["location"] == f"/?thread={thread}"
        cookie = signed_in.cookies["sandlot_session"]
        spent = await client.get(urls[maker] + link.removeprefix(cluster.lb))
        assert spent.status_code == 401  # once, at whichever replica
        csrf = set()
        for url in urls.values():
            me = await client.get(
                f"{url}/api/auth/me", headers={"Cookie": f"sandlot_session={cookie}"}
            )
            assert me.status_code == 200 and me.json()["user"] == "web-ada", me.text
            csrf.add(me.json()["csrf_token"])
        assert len(csrf) == 1
    (token,) = csrf
    browsers = {
        name: ReplicaBrowser(url, None, cookie, token, public=cluster.lb)
        for name, url in urls.items()
    }
    # The thread's sandbox, made at one replica (the page's "Create" button), is the one
    # the other opens.
    made = await browsers[maker].request("POST", "/api/v1/workspace", params={"thread": thread})
    assert made.status_code == 200, made.text
    seen = await browsers[other].request("GET", "/api/v1/workspace", params={"thread": thread})
    assert seen.json()["workspace"] == made.json()["workspace"], seen.text
    # A terminal opened at one replica is attached to at the other (its signed id).
    created = await browsers[maker].request(
        "POST", "/api/sessions", params={"thread": thread}, json={"shell": "shared"}
    )
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    async with browsers[other].socket(thread=thread, session_id=session_id, resume=1) as sock:
        assert (await opened(sock))["name"] == "shared"
        await sock.type("echo across-$((6*7))\r")
        await sock.until_output("across-42")
    # Signing out at one replica signs out at every one.
    out = await browsers[other].request("POST", "/api/auth/logout")
    assert out.status_code == 200, out.text
    for browser in browsers.values():
        assert (await browser.request("GET", "/api/auth/me")).status_code == 401


async def _post_both(
    urls: list[str], headers: dict[str, str], body: dict[str, str]
) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(
            *(client.post(f"{u}/v1/sandbox/sessions", json=body, headers=headers) for u in urls)
        )


@pytest.mark.reliability
@pytest.mark.timeout(120)
def test_idempotency_key_across_replicas(cluster: Cluster, record_property: RecordProperty) -> None:
    a, b = (srv.url for srv in cluster.replicas.values())
    headers = cluster.headers("idem")
    body = {"thread_id": "thr_idem", "mode": "ensure"}

    # A retry that lands on the other replica gets the first answer, replayed.
    keyed = {**headers, "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    first = httpx.post(f"{a}/v1/sandbox/sessions", json=body, headers=keyed, timeout=60)
    assert first.status_code == 200, first.text
    again = httpx.post(f"{b}/v1/sandbox/sessions", json=body, headers=keyed, timeout=60)
    assert again.status_code == 200, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()

    # The same key with another body, at the other replica: refused.
    other = {"thread_id": "thr_idem_other", "mode": "ensure"}
    reused = httpx.post(f"{b}/v1/sandbox/sessions", json=other, headers=keyed, timeout=60)
    assert reused.status_code == 422, reused.text
    assert reused.json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"

    # The same key at both replicas at once: one runs, the other gets its answer.
    for n in range(5):
        keyed = {**headers, "Idempotency-Key": f"both-{n}-{uuid.uuid4().hex}"}
        body = {"thread_id": f"thr_idem_{n}", "mode": "ensure"}
        r1, r2 = asyncio.run(_post_both([a, b], keyed, body))
        assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
        assert r1.json() == r2.json()
        replayed = [r.headers.get("idempotent-replayed") for r in (r1, r2)]
        assert replayed.count("true") == 1, replayed
    report(
        record_property,
        "Idempotency-Key across 2 replicas: a retry at the other replica replays the first "
        "answer; the same key at both at once (5 times): one ran, the other got its answer",
    )


@pytest.mark.reliability
@pytest.mark.timeout(180)
def test_replica_losing_the_database_answers_503_and_recovers(
    cluster: Cluster, tmp_path: Path, record_property: RecordProperty
) -> None:
    """A third replica reaches the database through a proxy that is then cut for a while."""
    store = make_url(cluster.store_url)
    with serving(seed=7) as proxy:
        proxy.upstream = ("127.0.0.1", int(store.port or 5432))
        through = store.set(port=proxy.port).render_as_string(hide_password=False)
        config = FAST_REAPER + f'\n[server]\nstore_url = "{through}"\n'
        port = free_port()
        env = {
            "SANDLOT_PUBLIC_URL": cluster.lb,
            "SANDLOT_DATAPLANE_URL": f"http://127.0.0.1:{port}",
        }
        srv = _start(SandlotServer(tmp_path / "c", config=config, env=env), port)
        try:
            headers = srv.headers("dbloss")
            body = {"thread_id": "thr_dbloss", "mode": "ensure"}
            r = httpx.post(f"{srv.url}/v1/sandbox/sessions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            sid = r.json()["session_id"]

            outage = 8.0
            proxy.outage(outage)
            cut = time.monotonic()
            statuses: collections.Counter[str] = collections.Counter()
            while time.monotonic() - cut < outage - 1:
                for method, path, payload in (
                    ("GET", f"/v1/sandbox/sessions/{sid}", None),
                    ("POST", "/v1/sandbox/sessions", body),
                ):
                    r = httpx.request(
                        method, f"{srv.url}{path}", json=payload, headers=headers, timeout=30
                    )
                    if r.status_code == 200:
                        statuses["200"] += 1
                        continue
                    error = r.json()["error"]
                    statuses[f"{r.status_code} {error['code']}"] += 1
                    assert r.status_code == 503, r.text
                    assert error["code"] == "BACKEND_UNAVAILABLE" and error["retryable"], r.text
                time.sleep(0.1)
            assert statuses["503 BACKEND_UNAVAILABLE"] > 0, statuses
            assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 503

            # Back by itself once the database is: no restart.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                r = httpx.post(
                    f"{srv.url}/v1/sandbox/sessions", json=body, headers=headers, timeout=30
                )
                if r.status_code == 200:
                    break
                time.sleep(0.2)
            assert r.status_code == 200, r.text
            recovered = time.monotonic() - cut - outage
            assert r.json()["session_id"] == sid
            assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200
        finally:
            srv.stop()
            srv.cleanup()
    report(
        record_property,
        f"a replica's database cut for {outage:.0f} s: answers {dict(statuses)}, never a 500; "
        f"serving again {max(recovered, 0):.1f} s after the database came back, no restart",
    )

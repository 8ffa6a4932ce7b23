"""The broker on PostgreSQL: migrations, sessions, and atomic ensure across worker processes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text

from sandlot.broker.audit import AuditLog
from sandlot.broker.events import EventHub, StoreListener, append_event
from sandlot.broker.pools import PoolService
from sandlot.broker.store import Store
from sandlot.broker.store.database import MIGRATIONS
from sandlot.broker.store.schema import bindings, pools, sandboxes
from tests.broker.test_e2e import FAST_REAPER, _storm, wait_active
from tests.figures import RecordProperty, report
from tests.pg import postgres_cluster
from tests.servers import SandlotServer


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_cluster() as url:
        yield url


@pytest.mark.reliability
@pytest.mark.timeout(240)
def test_serve_on_postgres_with_workers(
    tmp_path: Path, pg_url: str, record_property: RecordProperty
) -> None:
    config = FAST_REAPER + f'\n[server]\nstore_url = "{pg_url}"\n'
    srv = SandlotServer(tmp_path / "d", workers=4, config=config).start()
    try:
        headers = srv.headers("pg")
        for thread in ("thr_a", "thr_b", "thr_c"):
            results = asyncio.run(_storm(srv.url, headers, thread, 200))
            assert all(r.status_code == 200 for r in results), {r.status_code for r in results}
            assert len({r.json()["session_id"] for r in results}) == 1
        report(
            record_property,
            "200 concurrent ensure per thread, 3 threads, 4 worker processes (PostgreSQL): "
            "1 binding per thread, 0 server errors",
        )
        grant = results[0].json()
        wait_active(srv.url, headers, grant)
        r = httpx.post(
            f"{grant['dataplane']['http_base_url']}/exec",
            json={"command": "echo pg"},
            headers={"Authorization": f"Bearer {grant['token']}"},
        )
        assert r.status_code == 200 and r.json()["stdout"] == "pg\n"
        sid = grant["session_id"]
        assert (
            httpx.post(
                f"{srv.url}/v1/sandbox/sessions/{sid}/refresh", json={}, headers=headers
            ).status_code
            == 200
        )
        assert (
            httpx.delete(
                f"{srv.url}/v1/sandbox/sessions/{sid}?terminate=true", headers=headers
            ).status_code
            == 204
        )
    finally:
        srv.stop()
        srv.cleanup()
    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        for thread in ("thr_a", "thr_b", "thr_c"):
            n = conn.execute(
                text("SELECT count(*) FROM bindings WHERE scope_key = :k"),
                {"k": f"thread:{thread}"},
            ).scalar_one()
            assert n == 1
    engine.dispose()


@pytest.mark.timeout(60)
def test_notifications_wake_subscribers_of_another_process(pg_url: str) -> None:
    """An event committed through another connection wakes this process's subscriber
    through LISTEN/NOTIFY alone (its wait would otherwise last 30 s), and again after
    the listening connection is killed and comes back by itself."""
    store = Store(pg_url)
    store.migrate()
    other = Store(pg_url)

    def append(stream: str) -> None:
        with other.write() as conn:
            conn.execute(
                bindings.insert().values(
                    id=stream,
                    scope_key=f"thread:{stream}",
                    sandbox_id="sb_x",
                    owner_user_id="u",
                    created_at=0.0,
                    event_seq=0,
                )
            )
            append_event(conn, bindings, stream, "binding.created", {}, state="active")

    async def woken(hub: EventHub, stream: str) -> float:
        seen = hub.version(stream)
        started = time.monotonic()
        waiter = asyncio.create_task(hub.wait(stream, 30.0, seen))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(append, stream)
        await waiter
        return time.monotonic() - started

    async def scenario() -> None:
        hub = EventHub()
        hub.bind_loop(asyncio.get_running_loop())
        listener = StoreListener(store.url, hub)
        listener.start()
        try:
            assert await asyncio.to_thread(listener.connected.wait, 10)
            assert await woken(hub, "ssn_notify1") < 10
            with store.engine.connect() as conn:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE query LIKE 'LISTEN%'"
                    )
                )
            deadline = time.monotonic() + 15
            while listener.connected.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await asyncio.to_thread(listener.connected.wait, 15)
            assert await woken(hub, "ssn_notify2") < 10
        finally:
            listener.stop()

    try:
        asyncio.run(scenario())
    finally:
        store.dispose()
        other.dispose()


@pytest.mark.timeout(60)
def test_two_reapers_refilling_one_pool_count_one_after_the_other(pg_url: str) -> None:
    """The pool's gap is counted under the pool's row lock: a second replica's count waits
    for the first one's insert to commit, and sees it (without the lock both would count
    the same gap and both fill it)."""
    store = Store(pg_url)
    store.migrate()
    replicas = [PoolService(Store(pg_url), None), PoolService(Store(pg_url), None)]  # type: ignore[arg-type]
    with store.write() as conn:
        conn.execute(
            pools.insert().values(
                name="refill", template="default", min_ready=2, max_ready=3, source="api"
            )
        )
    locked, counted = threading.Event(), []

    def first() -> None:
        with replicas[0].store.write() as conn:
            counted.append(("a", replicas[0].missing_locked(conn, "refill")))
            locked.set()
            time.sleep(0.5)  # the other replica's reaper counts meanwhile
            conn.execute(
                sandboxes.insert().values(
                    id="sb_refill_a", template="default", provider="local",
                    state="provisioning", generation=1, created_at=0.0, updated_at=0.0,
                    last_active_at=0.0, hard_deadline=0.0, idle_timeout=60, event_seq=0,
                    pool="refill",
                )
            )  # fmt: skip
            counted.append(("a committed", 0))

    def second() -> None:
        locked.wait(10)
        with replicas[1].store.write() as conn:
            counted.append(("b", replicas[1].missing_locked(conn, "refill")))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in (store, *(r.store for r in replicas)):
        s.dispose()
    assert counted == [("a", 2), ("a committed", 0), ("b", 1)], counted


@pytest.mark.timeout(120)
def test_audit_ids_go_past_32_bits_once_the_store_is_upgraded(pg_url: str) -> None:
    """A store made before migration 0010, its audit ids a 32-bit serial about to run out,
    upgraded in place: the next rows get ids past 2**31, and reading after such an id
    works (before, the row after 2**31 - 1 could not be written, and every request that
    audits answered 500)."""
    admin = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://"))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("CREATE DATABASE audit_upgrade"))
    admin.dispose()
    store = Store(pg_url.rsplit("/", 1)[0] + "/audit_upgrade")
    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS)
    with store.engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0009")
        conn.execute(text("SELECT setval('audit_id_seq', 2147483645)"))
        conn.commit()
    log = AuditLog(store)
    log.write(None, "before.upgrade")
    store.migrate()
    for n in range(3):
        log.write(None, f"after.upgrade.{n}")
    rows = log.query(after=2147483646)
    store.dispose()
    assert [(r["id"], r["action"]) for r in rows] == [
        (2147483647, "after.upgrade.0"),
        (2147483648, "after.upgrade.1"),
        (2147483649, "after.upgrade.2"),
    ]

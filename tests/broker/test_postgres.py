"""The broker on PostgreSQL: migrations, sessions, and atomic ensure across worker processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

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

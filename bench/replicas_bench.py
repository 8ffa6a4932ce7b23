"""Broker replicas: ensure on an existing binding through HAProxy with 3 ``sandlot serve``
replicas on PostgreSQL, beside 1 ``sandlot serve`` on SQLite, in one run.

Run: ``.venv/bin/python bench/replicas_bench.py [--n 600] [--seconds 8]``

Both set-ups run at once on this machine (loopback): PostgreSQL 15 (``tests/pg.py``,
with ``fsync=on`` and ``synchronous_commit=off``, the durability of SQLite's WAL with
``synchronous=NORMAL`` that sandlot uses), three replicas on it, each with its own data
directory, behind a real HAProxy (``tests/haproxy.py``), and one replica on SQLite. The
replicas are behind two balancers at once: the set-up docs/SCALE.md recommends (round
robin by connection: a keep-alive connection's requests stay on its replica,
``option prefer-last-server``), which the target is read on, and round robin request by
request, printed beside it (each request of one client on another replica: on one
machine, three processes taking turns on 2 cores, each finding its caches cold), and
one replica without a balancer. Every
ensure carries a fresh ``Idempotency-Key``, as clients send; samples are interleaved in
blocks with the HTTP floors (``GET /healthz`` direct and through the balancer). The load
phase (16 clients, each its own connection) goes through the recommended balancer and
says how its ensures spread over the replicas. Then, per ensure, what it costs (the
figures SCALE.md's cost
model is built from): the brokers' CPU, PostgreSQL's CPU and its statements (from
``pg_stat_statements``: those sent, each a round trip, and those run inside a function,
marked ``↳``; the replicas' background work measured over an idle period of the same
length and taken off), at a throughput of 16 concurrent clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from measure import interleave, pct  # noqa: E402
from served import CONFIG  # noqa: E402
from targets import report  # noqa: E402
from tests.haproxy import REPLICA_HEADER, haproxy  # noqa: E402
from tests.pg import postgres_cluster  # noqa: E402
from tests.servers import SandlotServer, free_port  # noqa: E402

NEGOTIATE = "/v1/sandbox/sessions"
WARM = {"thread_id": "warm", "mode": "ensure"}
PG_OPTIONS = (
    "-c fsync=on -c synchronous_commit=off "
    "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"
)
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of ``pids`` and their children that were waited for."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15])
    return total / TICKS


def postgres_pids(postmaster: int) -> list[int]:
    """The cluster's processes: the postmaster and its children (backends, workers)."""
    found = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == postmaster:
                    found.append(int(entry))
    return found


class Postgres:
    def __init__(self, url: str) -> None:
        from sqlalchemy import create_engine

        self.engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        with self.engine.begin() as conn:
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            data = conn.exec_driver_sql("SHOW data_directory").scalar_one()
        self.postmaster = int(Path(data, "postmaster.pid").read_text().split()[0])

    def statements(self) -> float:
        """Statements sent by clients (each a round trip), not those run inside a function."""
        with self.engine.begin() as conn:
            return float(
                conn.exec_driver_sql(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE toplevel"
                ).scalar_one()
            )

    def breakdown(
        self, since: dict[str, tuple[float, float]], per: int
    ) -> list[tuple[float, float, str]]:
        """Statements run since ``since`` (from :meth:`by_statement`): calls per ensure and
        the mean time of one, in microseconds."""
        now = self.by_statement()
        rows = []
        for q, (calls, total) in now.items():
            calls0, total0 = since.get(q, (0.0, 0.0))
            if calls > calls0:
                rows.append(((calls - calls0) / per, (total - total0) / (calls - calls0) * 1000, q))
        return sorted(rows)[::-1]

    def by_statement(self) -> dict[str, tuple[float, float]]:
        """Calls and total time (ms) by statement; those run inside a function (not a round
        trip each) are marked ``↳``."""
        with self.engine.begin() as conn:
            rows = conn.exec_driver_sql(
                "SELECT query, toplevel, sum(calls), sum(total_exec_time) FROM pg_stat_statements "
                "GROUP BY query, toplevel"
            ).all()
        return {("" if top else "↳ ") + str(q): (float(c), float(t)) for q, top, c, t in rows}

    def cpu(self) -> float:
        return cpu_seconds(postgres_pids(self.postmaster))


@contextlib.contextmanager
def started(srv: SandlotServer, port: int) -> Iterator[SandlotServer]:
    srv.port = port
    try:
        srv.start(timeout=180)
        srv.url = f"http://127.0.0.1:{port}"
        yield srv
    finally:
        srv.stop()
        srv.cleanup()


async def load(
    url: str, key: str, seconds: float, concurrency: int, spread: Counter[str] | None = None
) -> int:
    """Ensures of the warm thread from ``concurrency`` clients (a connection each) for
    ``seconds``; how many. ``spread`` counts them by the replica that answered."""
    done = 0
    stop = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {key}"}

    async def worker() -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while time.monotonic() < stop:
                h = {**headers, "Idempotency-Key": str(uuid.uuid4())}
                r = await client.post(NEGOTIATE, json=WARM, headers=h)
                assert r.status_code == 200, r.text
                done += 1
                if spread is not None:
                    spread[r.headers.get(REPLICA_HEADER, "?")] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def ms(samples: list[float]) -> str:
    return f"{pct(samples, 0.5) * 1000:.2f} | {pct(samples, 0.95) * 1000:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=600, help="samples per contender")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each load phase")
    ap.add_argument("--statements", action="store_true", help="list them per ensure")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sandlot-replicas-bench-"))
    config = CONFIG + "[policy]\nreaper_interval_seconds = 1.0\n"
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(postgres_cluster(PG_OPTIONS))
        pg = Postgres(url)
        ports = {name: free_port() for name in ("a", "b", "c")}
        lb = stack.enter_context(haproxy(free_port(), ports, sticky=True))
        lb_rr = stack.enter_context(haproxy(free_port(), ports))
        replicas = []
        pg_config = config + f'\n[server]\nstore_url = "{url}"\n'
        for name, port in ports.items():
            env = {"SANDLOT_PUBLIC_URL": lb, "SANDLOT_DATAPLANE_URL": f"{lb}/replicas/{name}"}
            srv = SandlotServer(tmp / name, config=pg_config, env=env)
            replicas.append(stack.enter_context(started(srv, port)))
        single = stack.enter_context(
            started(SandlotServer(tmp / "sqlite", config=config), free_port())
        )
        lb_key, sqlite_key = replicas[0].key("bench"), single.key("bench")
        lb_client = stack.enter_context(httpx.Client(base_url=lb, timeout=30))
        rr_client = stack.enter_context(httpx.Client(base_url=lb_rr, timeout=30))
        one_client = stack.enter_context(httpx.Client(base_url=replicas[0].url, timeout=30))
        sqlite_client = stack.enter_context(httpx.Client(base_url=single.url, timeout=30))

        def ensure(client: httpx.Client, key: str) -> Callable[[], None]:
            headers = {"Authorization": f"Bearer {key}"}

            def call() -> None:
                h = {**headers, "Idempotency-Key": str(uuid.uuid4())}
                r = client.post(NEGOTIATE, json=WARM, headers=h)
                assert r.status_code == 200, r.text

            return call

        def healthz(client: httpx.Client) -> Callable[[], None]:
            return lambda: client.get("/healthz").raise_for_status()

        lb_ensure, sqlite_ensure = ensure(lb_client, lb_key), ensure(sqlite_client, sqlite_key)
        rr_ensure, one_ensure = ensure(rr_client, lb_key), ensure(one_client, lb_key)
        # The binding exists (and its sandbox is up) before the first sample.
        for call in (lb_ensure, sqlite_ensure):
            call()
        time.sleep(3)
        for _ in range(30):
            lb_ensure()
            rr_ensure()
            one_ensure()
            sqlite_ensure()
        samples: dict[str, list[float]] = {
            k: [] for k in ("lb", "rr", "one", "sqlite", "lbfloor", "floor")
        }
        contenders: list[tuple[list[float], Callable[[], Any], int]] = [
            (samples["lb"], lb_ensure, 1),
            (samples["rr"], rr_ensure, 1),
            (samples["one"], one_ensure, 1),
            (samples["sqlite"], sqlite_ensure, 1),
            (samples["lbfloor"], healthz(lb_client), 1),
            (samples["floor"], healthz(sqlite_client), 1),
        ]
        interleave(contenders, args.n, random.Random(22))

        # What an ensure costs under load: CPU of the brokers and of PostgreSQL,
        # PostgreSQL's statements; the replicas' background work over an idle period of
        # the same length is taken off.
        broker_pids = [srv.proc.pid for srv in replicas if srv.proc is not None]
        before = (cpu_seconds(broker_pids), pg.cpu(), pg.statements())
        time.sleep(args.seconds)
        idle = (
            cpu_seconds(broker_pids) - before[0],
            pg.cpu() - before[1],
            pg.statements() - before[2] - 1,
        )
        before = (cpu_seconds(broker_pids), pg.cpu(), pg.statements())
        by_statement = pg.by_statement()
        spread: Counter[str] = Counter()
        done = asyncio.run(load(lb, lb_key, args.seconds, 16, spread))
        statements = pg.breakdown(by_statement, done)
        busy = (
            cpu_seconds(broker_pids) - before[0],
            pg.cpu() - before[1],
            pg.statements() - before[2] - 1,
        )
        assert single.proc is not None
        single_before = cpu_seconds([single.proc.pid])
        single_done = asyncio.run(load(single.url, sqlite_key, args.seconds, 16))
        single_cpu = cpu_seconds([single.proc.pid]) - single_before
    per = [(b - i) / done for b, i in zip(busy, idle, strict=True)]
    inner = per[2] + sum(calls for calls, _, q in statements if q.startswith("↳"))

    lb_p50, sqlite_p50 = pct(samples["lb"], 0.5), pct(samples["sqlite"], 0.5)
    ratio = lb_p50 / sqlite_p50
    print(
        "Ensure on an existing binding (a fresh `Idempotency-Key` each), httpx client, "
        f"{args.n} samples each, interleaved.\n\n"
        "| set-up | p50 ms | p95 ms | vs 1 replica on SQLite (p50) |\n|---|---|---|---|\n"
        f"| 1 `sandlot serve`, SQLite | {ms(samples['sqlite'])} | 1.00x |\n"
        f"| HAProxy → 3 replicas, PostgreSQL 15 | {ms(samples['lb'])} | {ratio:.2f}x |\n"
        f"| the same, balanced request by request | {ms(samples['rr'])} | "
        f"{pct(samples['rr'], 0.5) / sqlite_p50:.2f}x |\n"
        f"| one replica directly (no balancer), PostgreSQL 15 | {ms(samples['one'])} | "
        f"{pct(samples['one'], 0.5) / sqlite_p50:.2f}x |\n"
        f"| floor: `GET /healthz` direct | {ms(samples['floor'])} | |\n"
        f"| floor: `GET /healthz` through HAProxy | {ms(samples['lbfloor'])} | |\n\n"
        f"Under load (16 concurrent clients, {args.seconds:.0f} s each): through HAProxy to 3 "
        f"replicas {done / args.seconds:.0f} ensures/s (by replica: "
        f"{', '.join(f'{name} {n}' for name, n in sorted(spread.items()))}); 1 replica on SQLite "
        f"{single_done / args.seconds:.0f} ensures/s.\n\n"
        "Per ensure on an existing binding, 3 replicas on PostgreSQL (background work of "
        "an idle period taken off):\n\n"
        f"- broker CPU (the 3 replicas together): {per[0] * 1000:.2f} ms "
        f"(1 replica on SQLite: {single_cpu / single_done * 1000:.2f} ms, its store "
        "included);\n"
        f"- PostgreSQL CPU: {per[1] * 1000:.2f} ms;\n"
        f"- PostgreSQL round trips (statements sent, `BEGIN` and `COMMIT` included): "
        f"{per[2]:.1f}; statements run, those inside functions included: {inner:.1f}.\n\n"
        f"Idle (3 replicas, nothing asked, {args.seconds:.0f} s): {idle[2] / args.seconds:.0f} "
        f"PostgreSQL statements/s, brokers' CPU {idle[0] / args.seconds * 100:.1f}% of a core, "
        f"PostgreSQL's {idle[1] / args.seconds * 100:.1f}%.\n"
    )
    if args.statements:
        print("    calls per ensure, mean µs each (inside the function: nested in its caller's)")
        for calls, micros, query in statements[:25]:
            print(f"    {calls:5.2f}  {micros:8.1f}  {' '.join(query.split())[:140]}")
    report(
        "replicas",
        "ensure on an existing binding through the load balancer, 3 replicas on PostgreSQL "
        "vs 1 replica on SQLite ≤ 1.5x",
        f"{lb_p50 * 1000:.2f} ms vs {sqlite_p50 * 1000:.2f} ms p50: {ratio:.2f}x",
        ratio <= 1.5,
        f"HAProxy adds {(pct(samples['lbfloor'], 0.5) - pct(samples['floor'], 0.5)) * 1000:.2f}"
        " ms to a no-op request; PostgreSQL round trips per ensure: "
        f"{per[2]:.1f}",
    )


if __name__ == "__main__":
    main()

"""Two ``sandlot serve`` replicas on one PostgreSQL with the kubernetes provider share one
warm pool: one instance label (a row of the store), each other's pods re-adopted at start
and adopted when asked, every pool pod claimed once under concurrent ensures at both."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from sandlot.sdk import AsyncSandlot
from tests.k8scluster import Cluster
from tests.pg import postgres_cluster
from tests.providers.k8sharness import NAMESPACE, core_api
from tests.providers.test_kubernetes_pool import CLAIMED, POOL, pool_config
from tests.servers import SandlotServer, free_port

pytestmark = pytest.mark.timeout(900)

MIN_READY = 4
THREADS = 8
ENSURES = 200


def store_instance(url: str) -> str:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT value FROM identities WHERE name = 'kubernetes.instance'")
            ).first()
    finally:
        engine.dispose()
    assert row is not None
    return str(row.value)


def instance_pods(core: Any, instance: str) -> dict[str, Any]:
    found = core.list_namespaced_pod(NAMESPACE, label_selector=f"sandlot.instance={instance}")
    return {
        p.metadata.labels["sandlot.sandbox"]: p
        for p in found.items
        if p.metadata.deletion_timestamp is None
    }


async def pool_ready(url: str, headers: dict[str, str], want: int) -> None:
    async with httpx.AsyncClient(base_url=url, headers=headers) as http, asyncio.timeout(300):
        while (await http.get("/v1/pools/warm")).json()["ready"] < want:
            await asyncio.sleep(0.2)


def wait_pool(url: str, key: str, want: int) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 300
    with httpx.Client(base_url=url, headers=headers) as http:
        while http.get("/v1/pools/warm").json()["ready"] < want:
            assert time.monotonic() < deadline, "the pool was not filled"
            time.sleep(0.2)


@contextlib.contextmanager
def two_replicas(
    base: Path, cluster: Cluster, image: str
) -> Iterator[tuple[str, list[SandlotServer]]]:
    """Replica ``a``, its pool filled, then replica ``b`` (which re-adopts a's pods)."""
    with postgres_cluster() as url:
        config = pool_config(cluster, image) + f'\n[server]\nstore_url = "{url}"\n'
        ports = [free_port(), free_port()]
        issuer = f"http://127.0.0.1:{ports[0]}"
        servers: list[SandlotServer] = []
        core = core_api(cluster)
        try:
            for name, port in zip(("a", "b"), ports, strict=True):
                own = f"http://127.0.0.1:{port}"
                env = {"SANDLOT_PUBLIC_URL": issuer, "SANDLOT_DATAPLANE_URL": own}
                srv = SandlotServer(base / name, config=config, env=env)
                srv.port = port
                servers.append(srv.start())
                srv.url = own
                if name == "a":
                    wait_pool(own, srv.key("alice", "agent"), MIN_READY)
            yield url, servers
        finally:
            for srv in servers:
                srv.stop()
            with contextlib.suppress(AssertionError):
                for pod in instance_pods(core, store_instance(url)).values():
                    core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
            core.api_client.close()
            for srv in servers:
                srv.cleanup()


async def test_replicas_share_one_warm_pool(
    k8s_cluster: Cluster, k8s_image: str, tmp_path: Path
) -> None:
    core = core_api(k8s_cluster)
    with two_replicas(tmp_path, k8s_cluster, k8s_image) as (url, (a, b)):
        # One instance for both: the first replica's proposal, kept in the store.
        instance = store_instance(url)
        assert instance == hashlib.sha256(str(a.data_dir.absolute()).encode()).hexdigest()[:16]
        warm = {
            s: p for s, p in instance_pods(core, instance).items() if p.metadata.labels.get(POOL)
        }
        assert len(warm) >= MIN_READY

        key = a.key("alice", "agent")
        clients = [AsyncSandlot(srv.url, key, auto_refresh=False, timeout=300) for srv in (a, b)]
        threads = [f"thr_rep{i % THREADS}" for i in range(ENSURES)]
        random.Random(5).shuffle(threads)
        try:
            got = await asyncio.gather(*(clients[i % 2].ensure(t) for i, t in enumerate(threads)))
            by_thread: dict[str, set[str]] = {}
            for thread, sb in zip(threads, got, strict=True):
                by_thread.setdefault(thread, set()).add(sb.id)
            # One pod per thread, at both replicas alike.
            assert all(len(ids) == 1 for ids in by_thread.values()), by_thread
            mine = {next(iter(ids)) for ids in by_thread.values()}
            assert len(mine) == THREADS
            from_pool = mine & set(warm)
            assert from_pool, "no thread was served from the shared pool"

            # Each claimed pool pod is labelled claimed once, the same pod (uid) it was;
            # every pod of the pool that no thread got is back in the pool, but those
            # the replicas hold claimed ahead for their next ensure (one each at most).
            pods = instance_pods(core, instance)
            for sid in from_pool:
                labels = pods[sid].metadata.labels
                assert POOL not in labels and labels[CLAIMED] == "warm"
                assert pods[sid].metadata.uid == warm[sid].metadata.uid
            claimed = {s for s, p in pods.items() if p.metadata.labels.get(CLAIMED) == "warm"}
            ahead = claimed - from_pool
            assert len(ahead) <= 2 and not ahead & mine
            for sid in set(warm) - mine - ahead:
                assert pods[sid].metadata.labels[POOL] == "warm"

            # Every thread's pod answers through either replica's relay: at least the
            # threads that got no pool pod have one made after both replicas started,
            # which the other replica knows only from its watch (adopted when asked).
            for client in clients:
                for thread in sorted(by_thread):
                    sb = await client.ensure(thread)
                    assert sb.id in by_thread[thread]
                    assert (await sb.run("echo ok")).stdout == "ok\n"

            # New threads at either replica, one after another, are served from the
            # refilled pool, whichever replica made its pods (adopted when claimed).
            headers = {"Authorization": f"Bearer {key}"}
            for i in range(4):
                await pool_ready(b.url, headers, MIN_READY)
                ready = {
                    s
                    for s, p in instance_pods(core, instance).items()
                    if p.metadata.labels.get(POOL)
                    or (p.metadata.labels.get(CLAIMED) and s not in mine)
                }
                sb = await clients[i % 2].ensure(f"thr_rep_after{i}")
                assert sb.id in ready
                assert (await sb.run("echo ready")).stdout == "ready\n"
        finally:
            for client in clients:
                await client.aclose()
    core.api_client.close()

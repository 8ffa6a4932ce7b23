"""``ensure`` of a new thread served from a warm pool, through ``sandlot serve`` (a real
server subprocess, ``tests/servers.py``): what a user waits for when a pool is configured.

Each sample waits (untimed) until the pool is full again, then times the SDK's
``ensure`` of a thread never seen (it returns once the binding is active: the pool's
sandbox was ready before the call) and the first ``exec true`` through the relay right
after (ready must mean ready); the sandbox is then released and terminated, untimed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx

from sandlot.sdk import AsyncSandlot


def pool_config(name: str, template: str, min_ready: int) -> str:
    """The ``[pools.NAME]`` section (and limits a benchmark's bursts stay under)."""
    return f"""
[quotas]
max_live_sandboxes_per_user = 1000
negotiation_rate_per_second = 10000
negotiation_burst = 10000

[pools.{name}]
template = "{template}"
min_ready = {min_ready}
max_ready = {min_ready}
"""


@dataclass
class Pooled:
    #: ensure → the binding active, seconds.
    ensure: list[float] = field(default_factory=list)
    #: ensure → its first ``exec true`` answered, seconds.
    first_exec: list[float] = field(default_factory=list)
    #: Samples whose sandbox existed before the ``ensure`` (taken from the pool).
    from_pool: int = 0


async def pool_full(url: str, key: str, pool: str, want: int, timeout: float = 300) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers) as http,
        asyncio.timeout(timeout),
    ):
        while (await http.get(f"/v1/pools/{pool}")).json()["ready"] < want:  # noqa: ASYNC110
            await asyncio.sleep(0.1)


async def created_before(url: str, key: str, sandbox_id: str, wall: float) -> bool:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        snap = (await http.get(f"/v1/sandboxes/{sandbox_id}")).json()
    return datetime.fromisoformat(snap["created_at"]).timestamp() < wall


async def pooled_ensures(url: str, key: str, n: int, pool: str, min_ready: int) -> Pooled:
    out = Pooled()
    run = secrets.token_hex(3)
    client = AsyncSandlot(url, key, auto_refresh=False)
    try:
        for i in range(n + 1):  # the first warms the client's connections
            await pool_full(url, key, pool, min_ready)
            wall, t0 = time.time(), time.perf_counter()
            sb = await client.ensure(f"thr_pooled_{run}_{i}")
            t1 = time.perf_counter()
            await sb.run("true")
            t2 = time.perf_counter()
            if i:
                out.ensure.append(t1 - t0)
                out.first_exec.append(t2 - t0)
                out.from_pool += await created_before(url, key, sb.id, wall)
            assert sb.grant.session_id is not None
            await client.release(sb.grant.session_id, terminate=True)
    finally:
        await client.aclose()
    return out


__all__ = ["Pooled", "pool_config", "pool_full", "pooled_ensures"]

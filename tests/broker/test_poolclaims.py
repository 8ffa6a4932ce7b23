"""Pool claims recorded by the provider (``Provider.claims_pooled``, as the kubernetes
provider's labels): an ``ensure`` claims at the provider before its transaction, a
refused claim tries the next, an unused claim is given back, and a pool sandbox the
provider did not let it claim is never handed out."""

from __future__ import annotations

import asyncio
import random

import httpx

from sandlot.protocol.sessions import Pool
from tests.broker.conftest import MakeHarness
from tests.broker.fakes import ClaimingProvider


async def _pool(h, ready: int) -> list[str]:  # type: ignore[no-untyped-def]
    h.broker.pools.create(Pool(name="warm", template="default", min_ready=ready, max_ready=ready))
    report = await h.broker.reaper.run_once()
    await h.broker.sandboxes.drain()
    # A pool sandbox is ready once the provider's status reached the store (after drain).
    async with asyncio.timeout(10):
        while h.broker.pools.get("warm").ready < ready:
            await asyncio.sleep(0.01)
    assert h.broker.pools.get("warm").ready == ready
    return list(report.pool_created)


async def _ensure(client: httpx.AsyncClient, headers: dict[str, str], thread: str) -> str:
    r = await client.post(
        "/v1/sandbox/sessions", json={"thread_id": thread, "mode": "ensure"}, headers=headers
    )
    assert r.status_code == 200, r.text
    return str(r.json()["sandbox"]["id"])


async def test_concurrent_ensures_claim_each_pool_sandbox_once(make_harness: MakeHarness) -> None:
    provider = ClaimingProvider()
    h = await make_harness(provider=provider)
    pooled = await _pool(h, 4)
    k = h.key("alice")
    threads = [f"thr_{i % 8}" for i in range(80)]
    random.Random(5).shuffle(threads)
    # The engine answers a refused claim (its 409) only once some ensure has its answer, so
    # an ensure that holds a claim binds its thread before that thread's refused ensures
    # can bind it to a new sandbox. Otherwise every claimer may lose its thread's race and
    # give its claim back (as documented), and no thread is served from the pool.
    answered = asyncio.Event()
    claim = provider.claim_pooled

    async def refused_late(sandbox_id: str) -> bool:
        if await claim(sandbox_id):
            return True
        await answered.wait()
        return False

    provider.claim_pooled = refused_late  # type: ignore[method-assign]

    async def ensure(thread: str) -> str:
        try:
            return await _ensure(h.client, k, thread)
        finally:
            answered.set()

    async with asyncio.timeout(30):
        got = await asyncio.gather(*(ensure(t) for t in threads))
    by_thread: dict[str, set[str]] = {}
    for thread, sid in zip(threads, got, strict=True):
        by_thread.setdefault(thread, set()).add(sid)
    assert all(len(ids) == 1 for ids in by_thread.values())
    mine = {next(iter(ids)) for ids in by_thread.values()}
    assert len(mine) == 8
    # Every pool sandbox a thread got is claimed at the provider; every other claim was
    # given back (the thread was bound by another of its ensures first), the one claimed
    # ahead for the next ensure when the broker stops.
    await h.broker.sessions.pool_claims.close()
    held = {sid for sid, n in provider.claimed.items() if n}
    assert held == mine & set(pooled)
    assert held, "no thread was served from the pool"
    assert set(provider.released) <= set(pooled)
    assert h.broker.pools.get("warm").ready == len(set(pooled) - held)


async def test_a_refused_claim_tries_the_next_and_none_means_a_new_sandbox(
    make_harness: MakeHarness,
) -> None:
    provider = ClaimingProvider()
    h = await make_harness(provider=provider)
    pooled = await _pool(h, 3)
    k = h.key("alice")
    provider.taken_elsewhere = set(pooled[:2])
    assert await _ensure(h.client, k, "thr_a") == pooled[2]
    # Every pool sandbox claimed elsewhere: the store's pool rows are not handed out.
    fresh = await _ensure(h.client, k, "thr_b")
    assert fresh not in pooled
    assert h.broker.pools.get("warm").ready == 2


async def test_the_next_pool_sandbox_is_claimed_ahead_and_given_back_at_stop(
    make_harness: MakeHarness,
) -> None:
    provider = ClaimingProvider()
    h = await make_harness(provider=provider)
    pooled = await _pool(h, 4)
    k = h.key("alice")
    calls: list[str] = []
    claim = provider.claim_pooled

    async def counted(sandbox_id: str) -> bool:
        calls.append(sandbox_id)
        return await claim(sandbox_id)

    provider.claim_pooled = counted  # type: ignore[method-assign]
    first = await _ensure(h.client, k, "thr_a")
    assert first in pooled
    async with asyncio.timeout(10):  # the next one is claimed in the background
        while len([s for s, n in provider.claimed.items() if n]) < 2:
            await asyncio.sleep(0.01)
    ahead = next(s for s, n in provider.claimed.items() if n and s != first)
    before = len(calls)
    # The next ensure takes the one held: no claim on its path (one more ahead after).
    assert await _ensure(h.client, k, "thr_b") == ahead
    assert calls[before : before + 1] != [ahead]
    assert ahead not in calls[before:]
    # The store's pool sandboxes that no thread has are not handed out twice, and what is
    # held ahead goes back when the broker stops.
    await h.broker.sessions.pool_claims.close()
    claimed = {s for s, n in provider.claimed.items() if n}
    assert claimed == {first, ahead}
    assert h.broker.pools.get("warm").ready == 2

"""Claims of warm-pool sandboxes recorded by the provider on the sandboxes themselves.

A provider whose sandboxes are objects of a shared engine (``kubernetes``: pods) records
which pool sandboxes are taken where every broker sees it, and arbitrates there
(:meth:`Provider.claim_pooled`: a label update naming the pod's resourceVersion). An
``ensure`` that would create a sandbox first reserves one this way, outside the store's
transaction (a call to the engine never holds the store's write lock): the candidates
are the template's ready pool sandboxes, taken in random order so concurrent claimers
spread over them rather than all contend for the oldest; a refused claim tries the next.
The transaction then takes the reserved sandbox (a conditional update, as for any pool
sandbox). A reservation the negotiation did not use (another ``ensure`` of the same
thread bound first, or it failed) is given back to its pool. Providers that record no
claims (``local``, ``docker``) leave it to the store's conditional update alone.

**One claim ahead.** The claim is a round trip to the engine (a label update at the
Kubernetes API server, written to etcd before it answers): on the path of every pooled
``ensure`` it was most of its time. So once an ``ensure`` has its answer, the broker
claims the next sandbox of that template and provider in the background and holds it
(:meth:`PoolClaims.replenish`); the next ``ensure`` takes the held one, checked in the
same read that lists the candidates (still a ready pool sandbox of the store), with no
call to the engine. A broker holds at most one per template and provider, and only
while the pool has another ready sandbox (so other replicas are never left without one);
it gives it back when it stops, and one held by a broker that was killed goes back to
the pool when the provider re-adopts it (its labels made to agree with the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass, field, replace

import anyio
from sqlalchemy import select

from sandlot.broker.sandboxes import SandboxService
from sandlot.broker.store import Store
from sandlot.broker.store.schema import bindings, sandboxes
from sandlot.protocol.errors import SandlotError
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState

log = logging.getLogger("sandlot.broker.pools")

#: How many of a template's ready pool sandboxes one ``ensure`` tries at most.
CANDIDATES = 16


@dataclass(frozen=True)
class Reservation:
    sandbox_id: str
    pool: str
    #: What it was reserved for (the slot a claim ahead is held in).
    template: Template | None = field(default=None, compare=False)
    provider: str | None = field(default=None, compare=False)


class PoolClaims:
    def __init__(self, store: Store, sandboxes: SandboxService) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self._rng = random.Random()
        #: A claim made ahead per (template, provider), for the next ensure.
        self._held: dict[tuple[str, str | None], Reservation] = {}
        self._replenishing: dict[tuple[str, str | None], asyncio.Task[None]] = {}

    @property
    def enabled(self) -> bool:
        return self.sandboxes.provider.claims_pooled

    def candidates(self, key: str, template: Template, provider: str | None) -> list[Reservation]:
        """The template's ready pool sandboxes (up to ``4 * CANDIDATES``), shuffled; none if
        the scope is bound."""
        wanted = [sandboxes.c.provider == provider] if provider is not None else []
        with self.store.read() as conn:
            if conn.execute(select(bindings.c.id).where(bindings.c.live_scope == key)).first():
                return []
            rows = conn.execute(
                select(sandboxes.c.id, sandboxes.c.pool)
                .where(
                    sandboxes.c.pool.is_not(None),
                    sandboxes.c.template == template.name,
                    *wanted,
                    sandboxes.c.state == SandboxState.ACTIVE.value,
                )
                .order_by(sandboxes.c.created_at)
                .limit(CANDIDATES * 4)
            ).all()
        found = [Reservation(r.id, r.pool) for r in rows]
        self._rng.shuffle(found)
        return found

    async def reserve(
        self, key: str, template: Template, provider: str | None
    ) -> Reservation | None:
        """Claim one of the template's ready pool sandboxes at the provider, or None: the
        one held ahead if it is still ready in the store."""
        found = await anyio.to_thread.run_sync(self.candidates, key, template, provider)
        slot = (template.name, provider)
        held = self._held.get(slot)
        if held is not None and found:
            del self._held[slot]
            if held in found:
                return replace(held, template=template, provider=provider)
            # No longer a ready pool sandbox (deleted with its pool, failed): forgotten.
        ahead = {r.sandbox_id for r in self._held.values()}
        for candidate in [c for c in found if c.sandbox_id not in ahead][:CANDIDATES]:
            try:
                if await self.sandboxes.provider.claim_pooled(candidate.sandbox_id):
                    return replace(candidate, template=template, provider=provider)
            except SandlotError as exc:
                log.info("claiming %s failed: %s", candidate.sandbox_id, exc.message)
        return None

    def replenish(self, template: Template, provider: str | None) -> None:
        """Claim the next pool sandbox of ``template`` ahead, in the background, unless one
        is held or being claimed."""
        slot = (template.name, provider)
        if not self.enabled or slot in self._held or slot in self._replenishing:
            return
        task = asyncio.get_running_loop().create_task(self._claim_ahead(slot, template, provider))
        self._replenishing[slot] = task
        task.add_done_callback(lambda _t: self._replenishing.pop(slot, None))

    async def _claim_ahead(
        self, slot: tuple[str, str | None], template: Template, provider: str | None
    ) -> None:
        try:
            # "" is no scope: nothing is bound to it.
            found = await anyio.to_thread.run_sync(self.candidates, "", template, provider)
            ahead = {r.sandbox_id for r in self._held.values()}
            found = [c for c in found if c.sandbox_id not in ahead]
            if len(found) < 2:  # the last ready one stays for whoever asks first
                return
            for candidate in found[:CANDIDATES]:
                if await self.sandboxes.provider.claim_pooled(candidate.sandbox_id):
                    if slot in self._held:  # another took its place meanwhile
                        await self.release(candidate)
                    else:
                        self._held[slot] = candidate
                    return
        except SandlotError as exc:
            log.info("claiming a pool sandbox ahead failed: %s", exc.message)
        except Exception:
            log.exception("claiming a pool sandbox ahead failed")

    async def close(self) -> None:
        """Give back what is held ahead (the broker stops)."""
        for task in list(self._replenishing.values()):
            task.cancel()
        for task in list(self._replenishing.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        held, self._held = list(self._held.values()), {}
        for reservation in held:
            await self.release(reservation)

    async def release(self, reservation: Reservation) -> None:
        """Give an unused reservation back to its pool."""
        try:
            await self.sandboxes.provider.release_pooled(reservation.sandbox_id, reservation.pool)
        except SandlotError as exc:
            log.warning("giving %s back failed: %s", reservation.sandbox_id, exc.message)


__all__ = ["PoolClaims", "Reservation"]

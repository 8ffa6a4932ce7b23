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
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

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


class PoolClaims:
    def __init__(self, store: Store, sandboxes: SandboxService) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self._rng = random.Random()

    @property
    def enabled(self) -> bool:
        return self.sandboxes.provider.claims_pooled

    def candidates(self, key: str, template: Template, provider: str | None) -> list[Reservation]:
        """The template's ready pool sandboxes, shuffled; none if the scope is bound."""
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
        return found[:CANDIDATES]

    async def reserve(
        self, key: str, template: Template, provider: str | None
    ) -> Reservation | None:
        """Claim one of the template's ready pool sandboxes at the provider, or None."""
        found = await anyio.to_thread.run_sync(self.candidates, key, template, provider)
        for candidate in found:
            try:
                if await self.sandboxes.provider.claim_pooled(candidate.sandbox_id):
                    return candidate
            except SandlotError as exc:
                log.info("claiming %s failed: %s", candidate.sandbox_id, exc.message)
        return None

    async def release(self, reservation: Reservation) -> None:
        """Give an unused reservation back to its pool."""
        try:
            await self.sandboxes.provider.release_pooled(reservation.sandbox_id, reservation.pool)
        except SandlotError as exc:
            log.warning("giving %s back failed: %s", reservation.sandbox_id, exc.message)


__all__ = ["PoolClaims", "Reservation"]

"""Token revocations reach the dataplane whoever recorded them.

A token is revoked by marking its row in the store: a release or a teardown
(in any worker process), a revoked API key or user (possibly by ``sandlot
keys revoke``, a separate process). The process that serves the sandboxes
runs a :class:`RevocationWatcher`: it reads the rows revoked since its last
look every ``POLL_SECONDS`` and pushes them to the provider, which makes the
dataplane refuse the tokens and close their sockets (4401). The first look
after a start pushes every revoked token that has not expired, so a
restarted server refuses them as before.

Revocation times come from the clocks of several processes, and a
transaction may commit after a later one: each look starts ``OVERLAP_SECONDS``
before the newest revocation already seen, and tokens already pushed are
remembered so they are pushed once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anyio
from sqlalchemy import bindparam, select

from sandlot.broker.store import Store
from sandlot.broker.store.schema import tokens
from sandlot.protocol.tokens import TOKEN_LEEWAY_SECONDS
from sandlot.providers.base import Provider, RevokedToken

log = logging.getLogger("sandlot.broker.revocations")

_REVOKED_SINCE = select(
    tokens.c.jti, tokens.c.sandbox_id, tokens.c.expires_at, tokens.c.revoked_at
).where(
    tokens.c.revoked_at >= bindparam("since"),
    tokens.c.expires_at > bindparam("now"),
)


class RevocationWatcher:
    #: How often the store is read for new revocations (they must reach sockets within 1 s).
    POLL_SECONDS = 0.2
    #: How far before the newest revocation seen each look starts again.
    OVERLAP_SECONDS = 5.0

    def __init__(self, store: Store, provider: Provider, clock: Callable[[], float]) -> None:
        self.store = store
        self.provider = provider
        self.clock = clock
        self._since = 0.0
        #: jti → revocation time, of the tokens pushed (forgotten once before ``_since``).
        self._pushed: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def _fetch(self) -> list[Any]:
        with self.store.read() as conn:
            return list(
                conn.execute(
                    _REVOKED_SINCE,
                    {"since": self._since, "now": self.clock() - TOKEN_LEEWAY_SECONDS},
                ).all()
            )

    async def run_once(self) -> int:
        """Push the revocations not pushed yet; returns how many tokens were pushed."""
        rows = await anyio.to_thread.run_sync(self._fetch)
        fresh: dict[str, list[Any]] = {}
        for row in rows:
            if row.jti not in self._pushed:
                fresh.setdefault(row.sandbox_id, []).append(row)
        pushed = 0
        for sandbox_id, batch in fresh.items():
            try:
                await self.provider.revoke(
                    sandbox_id, [RevokedToken(r.jti, r.expires_at) for r in batch]
                )
            except Exception:
                # Tried again at the next look (the rows stay in its window).
                log.exception("revocation push failed for %s", sandbox_id)
                continue
            for r in batch:
                self._pushed[r.jti] = r.revoked_at
            pushed += len(batch)
        if rows:
            newest = max(r.revoked_at for r in rows)
            self._since = max(self._since, newest - self.OVERLAP_SECONDS)
            self._pushed = {j: t for j, t in self._pushed.items() if t >= self._since}
        return pushed

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:
                log.exception("reading revocations failed")
            await asyncio.sleep(self.POLL_SECONDS)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

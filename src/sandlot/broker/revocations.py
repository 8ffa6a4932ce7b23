"""Token revocations reach the dataplane whoever recorded them.

A token is revoked by marking its row in the store: a release or a teardown
(in any worker process), a revoked API key or user (possibly by ``sandlot
keys revoke``, a separate process). The process that serves the sandboxes
runs a :class:`RevocationWatcher`: it reads the rows revoked since its last
look every ``POLL_SECONDS`` and pushes them to the provider, which makes the
dataplane refuse the tokens and close their sockets (4401). The first look
after a start pushes every revoked token that has not expired, so a
restarted server refuses them as before.

An API key used on the dataplane itself (``X-Api-Key``, the LangSmith surface)
stands for a token whose id is :func:`api_key_jti` of the key: a revoked key is
pushed as that id, to every live sandbox, so the dataplane's cache of keys stops
honouring it and the sockets opened with it close too. A member removed from a
shared scope has his keys cut off the scope's sandboxes (``access_cuts``, see
``sandlot.broker.scopes``): each cut is pushed to its sandbox as that id
:func:`~sandlot.protocol.tokens.on_sandbox`, which closes the key's sockets there
and nowhere else.

Revocation times come from the clocks of several processes, and a
transaction may commit after a later one: each look starts ``OVERLAP_SECONDS``
before the newest revocation already seen, and tokens already pushed are
remembered so they are pushed once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy import bindparam, select

from sandlot.broker.store import Store
from sandlot.broker.store.schema import access_cuts, api_keys, sandboxes, tokens
from sandlot.protocol.tokens import TOKEN_LEEWAY_SECONDS, RevokedToken, on_sandbox
from sandlot.providers.base import Provider

log = logging.getLogger("sandlot.broker.revocations")

#: How long the dataplane remembers a revoked key (its own cache of keys lasts seconds).
KEY_REVOCATION_TTL = 3600.0


def api_key_jti(key_id: str) -> str:
    """The revocation id of API key ``key_id`` when it is used on the dataplane."""
    return f"key:{key_id}"


_KEYS_REVOKED_SINCE = select(api_keys.c.id, api_keys.c.revoked_at).where(
    api_keys.c.revoked_at >= bindparam("since")
)
_LIVE_SANDBOXES = select(sandboxes.c.id).where(sandboxes.c.state.not_in(("terminated", "failed")))

_REVOKED_SINCE = select(
    tokens.c.jti, tokens.c.sandbox_id, tokens.c.expires_at, tokens.c.revoked_at
).where(
    tokens.c.revoked_at >= bindparam("since"),
    tokens.c.expires_at > bindparam("now"),
)

_CUTS_SINCE = select(
    access_cuts.c.key_id, access_cuts.c.sandbox_id, access_cuts.c.expires_at, access_cuts.c.cut_at
).where(
    access_cuts.c.cut_at >= bindparam("since"),
    access_cuts.c.expires_at > bindparam("now"),
)


@dataclass(frozen=True)
class Revoked:
    """A revocation shaped as a token row: what an access cut is pushed as."""

    jti: str
    sandbox_id: str
    expires_at: float
    revoked_at: float


@dataclass(frozen=True)
class Revocations:
    """What one look found: revoked tokens (``jti``, ``sandbox_id``, ``expires_at``,
    ``revoked_at``), revoked API keys (``id``, ``revoked_at``) and, when there are keys,
    the live sandboxes they go to."""

    tokens: list[Any]
    keys: list[Any]
    live: list[str]


def read_revocations(
    store: Store, *, since: float, keys_since: float, now: float, host: str | None = None
) -> Revocations:
    """Tokens revoked since ``since`` (unexpired at ``now``) and keys revoked since
    ``keys_since``; ``host``: only the sandboxes of that host (a host that reads them
    through the brokers' API, :mod:`sandlot.broker.hostapi`)."""
    rows_q, cuts_q, live_q = _REVOKED_SINCE, _CUTS_SINCE, _LIVE_SANDBOXES
    if host is not None:
        rows_q = rows_q.join(sandboxes, sandboxes.c.id == tokens.c.sandbox_id).where(
            sandboxes.c.host == host
        )
        cuts_q = cuts_q.join(sandboxes, sandboxes.c.id == access_cuts.c.sandbox_id).where(
            sandboxes.c.host == host
        )
        live_q = live_q.where(sandboxes.c.host == host)
    with store.read() as conn:
        rows: list[Any] = list(conn.execute(rows_q, {"since": since, "now": now}).all())
        rows += [
            Revoked(on_sandbox(api_key_jti(c.key_id), c.sandbox_id), c.sandbox_id,
                    c.expires_at, c.cut_at)
            for c in conn.execute(cuts_q, {"since": since, "now": now})
        ]  # fmt: skip
        keys = list(conn.execute(_KEYS_REVOKED_SINCE, {"since": keys_since}).all())
        live = [r.id for r in conn.execute(live_q).all()] if keys else []
    return Revocations(rows, keys, live)


class RevocationWatcher:
    #: How often the store is read for new revocations (they must reach sockets within 1 s).
    POLL_SECONDS = 0.2
    #: How far before the newest revocation seen each look starts again.
    OVERLAP_SECONDS = 5.0

    def __init__(self, store: Store | None, provider: Provider, clock: Callable[[], float]) -> None:
        """``store``: None for a subclass that reads elsewhere (:meth:`fetch`)."""
        self.store = store
        self.provider = provider
        self.clock = clock
        self._since = 0.0
        #: The same for revoked API keys, by revocation time: a key revoked longer ago than
        #: the dataplane remembers is refused by the store anyway.
        self._keys_since = clock() - KEY_REVOCATION_TTL
        #: jti → revocation time, of the tokens pushed (forgotten once before ``_since``).
        self._pushed: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def fetch(self) -> Revocations:
        """The revocations since the last look (read from the store)."""
        store = self.store
        assert store is not None
        return await anyio.to_thread.run_sync(
            lambda: read_revocations(
                store,
                since=self._since,
                keys_since=self._keys_since,
                now=self.clock() - TOKEN_LEEWAY_SECONDS,
            )
        )

    async def _push_keys(self, keys: list[Any], live: list[str]) -> None:
        """Revoked keys go to every live sandbox (a key may be used on any it may reach)."""
        revoked = [RevokedToken(api_key_jti(k.id), k.revoked_at + KEY_REVOCATION_TTL) for k in keys]
        for sandbox_id in live:
            try:
                await self.provider.revoke(sandbox_id, revoked)
            except Exception:
                log.exception("key revocation push failed for %s", sandbox_id)
                return  # tried again at the next look
        for k in keys:
            self._pushed[api_key_jti(k.id)] = k.revoked_at
        newest = max(k.revoked_at for k in keys)
        self._keys_since = max(self._keys_since, newest - self.OVERLAP_SECONDS)

    async def run_once(self) -> int:
        """Push the revocations not pushed yet; returns how many tokens were pushed."""
        found = await self.fetch()
        rows, live = found.tokens, found.live
        # Pushed already: the same id revoked at the same time (a key may be cut off one
        # sandbox more than once).
        keys = [k for k in found.keys if self._pushed.get(api_key_jti(k.id)) != k.revoked_at]
        if keys:
            await self._push_keys(keys, live)
        fresh: dict[str, list[Any]] = {}
        for row in rows:
            if self._pushed.get(row.jti) != row.revoked_at:
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
            horizon = min(self._since, self._keys_since)
            self._pushed = {j: t for j, t in self._pushed.items() if t >= horizon}
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

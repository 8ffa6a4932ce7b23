"""Rate limits on negotiation: one token bucket per principal.

:class:`RateLimiter` keeps its buckets in this process: with several worker processes
each keeps its own, so the effective limit is at most ``workers *`` the configured one;
the limit protects the server from a runaway client, it is not a billing meter.

:class:`SharedRateLimiter` keeps them in the store, for replicas sharing PostgreSQL:
one bucket per principal whichever replica a request lands on, taken from in one
conditional upsert (the database serializes takers of one bucket). Its clock is the
replicas' wall clock, so clocks kept in step (NTP) keep the rate exact. A negotiation
takes its token in its own transaction, last (:meth:`SharedRateLimiter.take_in`): no
transaction of its own, and the bucket's row is locked only while that one commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
from sqlalchemy import Connection, Float, text

from sandlot.broker.store import Store
from sandlot.protocol.errors import RateLimited


def _refused(tokens: float, rate: float) -> RateLimited:
    retry = (1.0 - tokens) / rate
    return RateLimited(
        "too many session requests, slow down",
        retry_after=max(retry, 0.001),
        metadata={"retry_after_seconds": round(retry, 3)},
    )


class RateLimiter:
    MAX_BUCKETS = 100_000

    def __init__(self, rate_per_second: float, burst: int) -> None:
        self.rate = rate_per_second
        self.burst = float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    async def check(self, who: str) -> None:
        """Take one token of ``who``'s bucket, or raise ``RateLimited``."""
        self.take(who)

    def take(self, who: str) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(who, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens < 1.0:
                self._buckets[who] = (tokens, now)
                raise _refused(tokens, self.rate)
            self._buckets[who] = (tokens - 1.0, now)
            if len(self._buckets) > self.MAX_BUCKETS:
                self._buckets.clear()


#: Refill then take one token, only when one is there (else no row comes back).
TAKE = text(
    """
    INSERT INTO rate_buckets (who, tokens, stamp) VALUES (:who, :burst - 1, :now)
    ON CONFLICT (who) DO UPDATE SET
        tokens = LEAST(:burst, rate_buckets.tokens
                 + GREATEST(0, :now - rate_buckets.stamp) * :rate) - 1,
        stamp = GREATEST(:now, rate_buckets.stamp)
    WHERE LEAST(:burst, rate_buckets.tokens
          + GREATEST(0, :now - rate_buckets.stamp) * :rate) >= 1
    RETURNING tokens
    """
).columns(tokens=Float)
_READ = text("SELECT tokens, stamp FROM rate_buckets WHERE who = :who")


class SharedRateLimiter(RateLimiter):
    """The buckets of every replica sharing the store (PostgreSQL)."""

    def __init__(
        self,
        store: Store,
        rate_per_second: float,
        burst: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(rate_per_second, burst)
        self.store = store
        self.clock = clock

    async def check(self, who: str) -> None:
        if self.rate > 0:
            await anyio.to_thread.run_sync(self.take, who)

    def take(self, who: str) -> None:
        if self.rate <= 0:
            return
        with self.store.write() as conn:
            self.take_in(conn, who)

    def take_in(self, conn: Connection, who: str) -> None:
        """Take one token of ``who``'s bucket in ``conn``'s transaction, or raise
        ``RateLimited`` (the caller's transaction then rolls back with it)."""
        if self.rate <= 0:
            return
        params = self.take_params(who)
        if conn.execute(TAKE, params).first() is None:
            self.refuse(conn, params)

    def take_params(self, who: str) -> dict[str, Any]:
        """The parameters of :data:`TAKE` (for a statement that includes it)."""
        return {"who": who, "burst": self.burst, "rate": self.rate, "now": self.clock()}

    def refuse(self, conn: Connection, params: dict[str, Any]) -> NoReturn:
        """:data:`TAKE` with ``params`` returned no row: raise ``RateLimited``."""
        row = conn.execute(_READ, {"who": params["who"]}).first()
        now = params["now"]
        tokens = 0.0 if row is None else float(row.tokens) + max(0.0, now - row.stamp) * self.rate
        raise _refused(min(tokens, self.burst), self.rate)


@dataclass(frozen=True)
class Charge:
    """A negotiation's rate-limit token, taken in the negotiation's own transaction."""

    limiter: SharedRateLimiter
    who: str

    def take_in(self, conn: Connection) -> None:
        self.limiter.take_in(conn, self.who)

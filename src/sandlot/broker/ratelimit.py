"""Rate limits on negotiation: one token bucket per principal, in this process.

With several worker processes each keeps its own buckets, so the effective
limit is at most ``workers *`` the configured one; the limit protects the
server from a runaway client, it is not a billing meter.
"""

from __future__ import annotations

import threading
import time

from sandlot.protocol.errors import RateLimited


class RateLimiter:
    MAX_BUCKETS = 100_000

    def __init__(self, rate_per_second: float, burst: int) -> None:
        self.rate = rate_per_second
        self.burst = float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def check(self, who: str) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(who, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens < 1.0:
                self._buckets[who] = (tokens, now)
                retry = (1.0 - tokens) / self.rate
                raise RateLimited(
                    "too many session requests, slow down",
                    retry_after=max(retry, 0.001),
                    metadata={"retry_after_seconds": round(retry, 3)},
                )
            self._buckets[who] = (tokens - 1.0, now)
            if len(self._buckets) > self.MAX_BUCKETS:
                self._buckets.clear()

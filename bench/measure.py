"""Sampling and figures shared by the benchmarks: interleaved blocks, medians, tails, ratios.

A contender is one way of doing an operation (through the SDK, httpx, a raw
socket client, the stripped dataplane, directly, through a peer). Contenders
are sampled in blocks of :data:`BLOCK` in turn, in a new order every round, so
that drift on a shared machine hits every column alike and the background work
one leaves behind (a kernel's IOPub traffic, the watcher reporting a file just
written) lands on its own samples rather than on the next contender's.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

#: Samples a contender takes in a row before the next one's turn.
BLOCK = 10


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def checked(r: Any) -> Any:
    """An httpx response that must have succeeded (a failed call is never a sample)."""
    r.raise_for_status()
    return r


def stats(samples: Sequence[float]) -> tuple[float, float]:
    """(median, p99) in ms of samples in seconds."""
    s = sorted(samples)
    return statistics.median(s) * 1000, s[min(len(s) - 1, int(len(s) * 0.99))] * 1000


def pct(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of samples, in their unit."""
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(v: float) -> str:
    return f"{v:.3f} ms" if v < 10 else f"{v:.1f} ms"


def ratio(a: float, b: float) -> str:
    r = a / b
    return f"{r:.2f}\u00d7" if r < 10 else f"{r:.0f}\u00d7"


def interleave(
    contenders: Sequence[tuple[list[float], Callable[[], Any], int]],
    n: int,
    rng: random.Random,
    *,
    warm: int = 5,
    block: int = BLOCK,
) -> None:
    """Sample every contender ``(samples, operation, every)`` in blocks until each has
    about ``n``; one whose ``every`` is k > 1 is sampled only every k-th round (a slow
    peer, to bound the run time)."""
    for _, op, _ in contenders:
        for _ in range(warm):
            op()
    for i in range(0, n, block):
        k = min(block, n - i)
        round_ = [(s, op) for s, op, every in contenders if (i // block) % every == 0]
        rng.shuffle(round_)
        for samples, op in round_:
            samples.extend(timed(op) for _ in range(k))


async def ainterleave(
    contenders: Sequence[tuple[list[float], Callable[[], Awaitable[Any]], int]],
    n: int,
    rng: random.Random,
    *,
    warm: int = 5,
    block: int = BLOCK,
) -> None:
    """:func:`interleave` for coroutine operations, awaited one at a time on the running loop."""
    for _, op, _ in contenders:
        for _ in range(warm):
            await op()
    for i in range(0, n, block):
        k = min(block, n - i)
        round_ = [(s, op) for s, op, every in contenders if (i // block) % every == 0]
        rng.shuffle(round_)
        for samples, op in round_:
            for _ in range(k):
                t0 = time.perf_counter()
                await op()
                samples.append(time.perf_counter() - t0)


class Row:
    """One operation's samples (seconds), per contender."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: ``sandlot serve`` through the SDK: what a user's code gets.
        self.sandlot: list[float] = []
        #: ``sandlot serve`` through a stock httpx client (the client peers get).
        self.httpx: list[float] = []
        #: ``sandlot serve`` through a minimal raw-socket client: the server's own latency.
        self.raw: list[float] = []
        #: The stripped standalone dataplane through the SDK (see ``served.STRIPPED``).
        self.stripped: list[float] = []
        #: The same operation done directly on this host.
        self.direct: list[float] = []
        self.jupyter: list[float] = []
        #: jupyter_server with TCP_NODELAY forced (reported in the notes).
        self.jupyter_nodelay: list[float] = []

    @property
    def short(self) -> str:
        return self.name.split(" (")[0]

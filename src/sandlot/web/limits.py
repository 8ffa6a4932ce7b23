"""Limits on the browser's terminal and chat sockets and on the routes that walk the
workspace: token buckets and bounded queues.

Everything is kept in the process's memory, which is enough for one web server (several
processes each keep their own, so the limits then hold per process):

- **Connects**: every WebSocket connect or reattach to ``/ws/pty`` or
  ``/ws/claude-stream`` takes one token from its user's bucket and one from its
  address's bucket (:class:`SocketGate`); an empty bucket refuses the socket
  (``RATE_LIMITED``). A user also holds at most ``max_sockets_per_user`` such sockets at
  once.
- **Input**: each session (a shell, a chat) has a bucket of input bytes shared by every
  socket attached to it; a frame costs its size, at least :data:`MIN_FRAME_COST` (so a
  flood of tiny frames is limited too). A frame the bucket cannot pay for is dropped and
  the browser told so; later frames pass again once the bucket has refilled.
- **Queues**: frames wait in a :class:`FrameQueue` bounded in frames and bytes, one per
  direction of each socket. When one is full, queued ``resize`` frames are dropped first
  (only the latest size matters), and if that is not enough the queue overflows
  (:class:`QueueOverflow`): the route then closes the socket in a controlled way, with an
  ``error`` frame. Nothing is lost for good: a terminal reattaches from its offset and
  the dataplane replays what the browser had not received.

- **Walks**: ``GET /api/tree`` takes one token from its user's tree bucket, and
  ``GET /api/search`` and ``GET /api/v1/grep`` one from the user's search bucket (they
  share it: both walk the workspace's files) (:class:`RouteGate`); an empty bucket
  refuses the request (``RATE_LIMITED``, 429, ``Retry-After`` the time until a token).

A :class:`TokenBucket` holds ``burst`` tokens and gains ``rate`` per second up to
``burst``; a cost it cannot pay leaves it unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Callable, Hashable, Iterator, Sized
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from sandlot.protocol.errors import RateLimited

MiB = 1024 * 1024
#: Buckets remembered per budget (users, addresses, sessions) unless said otherwise.
MAX_BUCKETS = 10_000
#: The least an input frame costs in the input bucket, whatever its size.
MIN_FRAME_COST = 64


@dataclass(frozen=True)
class SocketLimits:
    """The limits of the terminal and chat sockets (defaults suit one person's browser
    tabs, and stop a script hammering the server)."""

    #: WebSocket connects (reattaches included) per user: at once, then per second.
    user_connect_burst: float = 30
    user_connects_per_second: float = 1.0
    #: The same per client address.
    ip_connect_burst: float = 60
    ip_connects_per_second: float = 2.0
    #: Terminal and chat sockets one user holds open at once.
    max_sockets_per_user: int = 64
    #: Input bytes one session accepts at once, then per second (shared by its sockets).
    input_burst_bytes: int = 8 * MiB
    input_bytes_per_second: int = 1 * MiB
    #: The largest frame a terminal may send (a paste; bigger ones are refused, and said).
    max_input_frame_bytes: int = 1 * MiB
    #: The largest message a chat may send (images travel inside messages).
    max_chat_frame_bytes: int = 8 * MiB
    #: Frames waiting to be sent to the browser.
    output_queue_frames: int = 1024
    output_queue_bytes: int = 8 * MiB
    #: Frames waiting to be sent to the dataplane.
    input_queue_frames: int = 256
    input_queue_bytes: int = 16 * MiB
    #: Buckets remembered (users, addresses, sessions); the least recently used go first.
    max_buckets: int = MAX_BUCKETS
    #: Seconds a controlled close may wait for the browser to take its last frames.
    close_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive")


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second up to ``burst``."""

    def __init__(self, burst: float, rate: float, now: float) -> None:
        self.burst = burst
        self.rate = rate
        self.tokens = burst
        self.updated = now

    def take(self, cost: float, now: float) -> bool:
        """Pay ``cost`` if the bucket holds it (then ``True``); otherwise change nothing."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if cost > self.tokens:
            return False
        self.tokens -= cost
        return True

    def wait(self, cost: float, now: float) -> float:
        """Seconds until the bucket holds ``cost`` (0 if it does now)."""
        tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        return max(0.0, (cost - tokens) / self.rate)


class Buckets:
    """Token buckets by key, the least recently used forgotten beyond ``max_buckets``
    (a forgotten key starts again full, which only ever errs on the generous side)."""

    def __init__(
        self,
        burst: float,
        rate: float,
        *,
        max_buckets: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.rate = rate
        self.max_buckets = max_buckets
        self._clock = clock
        self._buckets: collections.OrderedDict[Hashable, TokenBucket] = collections.OrderedDict()

    def take(self, key: Hashable, cost: float = 1.0) -> bool:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.burst, self.rate, now)
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(cost, now)

    def wait(self, key: Hashable, cost: float = 1.0) -> float:
        """Seconds until ``key``'s bucket holds ``cost`` (0 if it does now)."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.wait(cost, self._clock())


class SocketGate:
    """Admits terminal and chat sockets: connect rates per user and per address, sockets
    held per user, and each session's input bucket."""

    def __init__(
        self, limits: SocketLimits | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits = limits or SocketLimits()
        cap = limits.max_buckets
        self._users = Buckets(
            limits.user_connect_burst, limits.user_connects_per_second, max_buckets=cap, clock=clock
        )
        self._addresses = Buckets(
            limits.ip_connect_burst, limits.ip_connects_per_second, max_buckets=cap, clock=clock
        )
        self._input = Buckets(
            limits.input_burst_bytes, limits.input_bytes_per_second, max_buckets=cap, clock=clock
        )
        self._open: collections.Counter[str] = collections.Counter()
        #: How many sockets were closed because a queue overflowed (for tests and metrics).
        self.overflows = 0

    @contextmanager
    def admit(self, user: str, address: str | None) -> Iterator[None]:
        """Hold one socket of ``user`` from ``address`` while the block runs; raises
        :class:`~sandlot.protocol.errors.RateLimited` when a limit refuses it."""
        if self._open[user] >= self.limits.max_sockets_per_user:
            raise RateLimited(
                f"at most {self.limits.max_sockets_per_user} terminal and chat sockets at once"
            )
        if not self._users.take(("user", user)):
            raise RateLimited("too many connections: try again in a moment")
        if address is not None and not self._addresses.take(("ip", address)):
            raise RateLimited("too many connections from this address: try again in a moment")
        self._open[user] += 1
        try:
            yield
        finally:
            self._open[user] -= 1
            if self._open[user] <= 0:
                del self._open[user]

    def input_allowed(self, session: Hashable, size: int) -> bool:
        """Whether ``session`` may take an input frame of ``size`` bytes now."""
        return self._input.take(("input", session), max(size, MIN_FRAME_COST))


@dataclass(frozen=True)
class RouteLimits:
    """Each user's budget of the routes that walk the workspace (enough for a page
    expanding folders and searching as one types; not for a script hammering them)."""

    #: ``GET /api/tree``: at once, then per second.
    tree_burst: float = 20
    tree_per_second: float = 5.0
    #: ``GET /api/search`` and ``GET /api/v1/grep`` together: at once, then per second.
    search_burst: float = 20
    search_per_second: float = 2.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive")


class Walk(enum.StrEnum):
    """The budgets of :class:`RouteLimits`: what a limited route spends."""

    TREE = "tree"
    SEARCH = "search"


class RouteGate:
    """Admits the requests of the routes that walk the workspace, per user and budget."""

    def __init__(
        self,
        limits: RouteLimits | None = None,
        *,
        max_buckets: int = MAX_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits = limits or RouteLimits()
        self._buckets = {
            Walk.TREE: Buckets(
                limits.tree_burst, limits.tree_per_second, max_buckets=max_buckets, clock=clock
            ),
            Walk.SEARCH: Buckets(
                limits.search_burst, limits.search_per_second, max_buckets=max_buckets, clock=clock
            ),
        }

    def admit(self, walk: Walk, user: str) -> None:
        """Spend one of ``user``'s ``walk`` tokens; :class:`~sandlot.protocol.errors.RateLimited`
        (with the seconds until the next token) when there is none."""
        buckets = self._buckets[walk]
        if not buckets.take(user):
            raise RateLimited(
                f"too many {'tree listings' if walk is Walk.TREE else 'searches'}: "
                "try again in a moment",
                retry_after=buckets.wait(user),
            )


class QueueOverflow(Exception):
    """A :class:`FrameQueue` is full even after dropping the resizes it held."""


#: What a :class:`FrameQueue` holds: text, bytes, or anything with a size.
F = TypeVar("F", bound=Sized)


class FrameQueue(Generic[F]):
    """Frames waiting for one side of a socket, bounded in frames and bytes (a frame's
    ``len``).

    When a frame does not fit, the queued ``resize`` frames are dropped first (the
    latest size, the frame being added if it is one, is all a terminal needs); if it
    still does not fit, :meth:`put` raises :class:`QueueOverflow` and keeps nothing of it.
    """

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self._frames: collections.deque[tuple[str, F]] = collections.deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        #: Resize frames dropped so far.
        self.dropped_resizes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, frame: F, *, kind: str = "") -> None:
        size = len(frame)
        if not self._fits(size):
            self._drop_resizes(keep_last=kind != "resize")
        if not self._fits(size):
            raise QueueOverflow(f"more than {self.max_frames} frames or {self.max_bytes} bytes")
        self._frames.append((kind, frame))
        self._bytes += size
        self._ready.set()

    async def get(self) -> F:
        while not self._frames:
            self._ready.clear()
            await self._ready.wait()
        _, frame = self._frames.popleft()
        self._bytes -= len(frame)
        return frame

    def take(self, kind: str) -> F | None:
        """The first frame, without waiting, if there is one and it is of ``kind``."""
        if not self._frames or self._frames[0][0] != kind:
            return None
        _, frame = self._frames.popleft()
        self._bytes -= len(frame)
        return frame

    def clear(self) -> None:
        self._frames.clear()
        self._bytes = 0

    def _fits(self, size: int) -> bool:
        return len(self._frames) < self.max_frames and self._bytes + size <= self.max_bytes

    def _drop_resizes(self, *, keep_last: bool) -> None:
        resizes = [i for i, (kind, _) in enumerate(self._frames) if kind == "resize"]
        if keep_last and resizes:
            resizes.pop()
        for i in reversed(resizes):
            _, frame = self._frames[i]
            del self._frames[i]
            self._bytes -= len(frame)
            self.dropped_resizes += 1

"""A TCP proxy that misbehaves on purpose: latency, resets, blackholes.

It sits between a client and a real server on loopback and forwards bytes
unchanged, except that, according to its :class:`Faults`:

- **latency**: every forwarded chunk is held for a random delay (order kept: a
  chunk never overtakes the one before it);
- **resets**: a connection is torn down with RST (``SO_LINGER`` 0 on both
  sockets) after a random time (exponential) once it carries output (its
  first kilobyte back); whatever is in flight then (in the proxy, in socket
  buffers not yet read) is lost, cut at any byte. A share of connections is
  cut earlier, at a random byte of the opening exchange (the upgrade request
  or answer, the first frames: a ``start`` the server may or may not have
  seen). Time rather than a byte count decides the later resets: on loopback
  the proxy reads a replay in one burst, and a byte mark would almost always
  fire right behind it, discarding it unread at the client — a pattern no
  real network produces at every reconnection;
- **blackholes**: for a few seconds nothing is forwarded at all. The
  connections open when it starts are never served again (a flow lost by a
  middlebox: the sockets stay open and silent, so only the client's own
  timeouts or keepalive pings can notice); connections opened during it are
  held, like SYNs retransmitted until the path is back, and served after.
- **outages** (:meth:`FaultProxy.outage`): for a few seconds every connection
  is reset, the open ones at once and new ones as they arrive (a server
  restarting, a route flapping): each reconnection fails fast.

Every decision comes from a ``random.Random`` seeded with the proxy's seed and
the connection's number, so a failing run is replayed with the same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Bytes read from a socket at once.
CHUNK = 65536
#: Bytes back from the server after which a connection counts as carrying output.
STREAMING = 1024


@dataclass(frozen=True)
class Faults:
    """What the proxy does to the traffic (the default: nothing)."""

    #: Per-chunk delay range in seconds (uniform), or None.
    latency: tuple[float, float] | None = None
    #: Mean seconds a connection carries output before it is reset (exponential), or None.
    reset_after: float | None = None
    #: With resets: share of connections also cut during the opening exchange.
    reset_early_share: float = 0.2
    #: Seconds between the end of one blackhole and the start of the next (uniform), or None.
    blackhole_every: tuple[float, float] | None = None
    #: Length of a blackhole in seconds (uniform).
    blackhole_for: tuple[float, float] = (2.0, 3.0)


@dataclass
class Stats:
    connections: int = 0
    resets: int = 0
    blackholes: list[float] = field(default_factory=list)
    lost_flows: int = 0
    held_connections: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


def _linger_zero(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: FaultProxy, number: int) -> None:
        self.proxy = proxy
        self.rng = random.Random(f"{proxy.seed}:{number}")
        self.writers: list[asyncio.StreamWriter] = []
        self.lost = False
        self.closed = False
        self.tasks: list[asyncio.Task[None]] = []
        faults = proxy.faults
        self.reset_at: dict[str, int] = {}
        self.lifetime: float | None = None
        if faults.reset_after:
            self.lifetime = self.rng.expovariate(1 / faults.reset_after)
            if self.rng.random() < faults.reset_early_share:
                # Within the upgrade request and the start or attach frame (~1-2 KB),
                # or within the upgrade answer and the ready frame (~300 bytes).
                if self.rng.random() < 0.5:
                    self.reset_at["up"] = self.rng.randrange(0, 1800)
                else:
                    self.reset_at["down"] = self.rng.randrange(0, 300)
        self.crossed = {"up": 0, "down": 0}
        self.streaming = asyncio.Event()

    def reset(self) -> None:
        """Tear both connections down with RST."""
        if self.closed:
            return
        self.closed = True
        self.proxy.stats.resets += 1
        for w in self.writers:
            _linger_zero(w)
            w.transport.abort()

    async def reset_later(self, delay: float) -> None:
        await self.streaming.wait()
        await asyncio.sleep(delay)
        if not self.lost:  # a lost flow stays silent
            self.reset()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self.writers:
            w.transport.abort()

    async def pump(
        self, direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        """Read from one side and deliver, delayed, to the other (FIFO)."""
        line: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(maxsize=64)
        deliver = asyncio.ensure_future(self._deliver(direction, line, dst))
        last = 0.0
        try:
            while not self.closed:
                data = await src.read(CHUNK)
                if self.lost:
                    await asyncio.Event().wait()  # a lost flow is never served again
                latency = self.proxy.faults.latency
                delay = self.rng.uniform(*latency) if latency else 0.0
                last = max(last, time.monotonic() + delay)
                mark = self.reset_at.get(direction)
                before = self.crossed[direction]
                self.crossed[direction] += len(data)
                if direction == "down" and self.crossed["down"] >= STREAMING:
                    self.streaming.set()
                if mark is not None and self.crossed[direction] > mark:
                    # Deliver up to the mark (mid-frame, mid-line), then reset.
                    if mark > before:
                        await line.put((last, data[: mark - before]))
                    await line.put((last, None))
                    await deliver
                    return
                await line.put((last, data))
                if not data:
                    await deliver
                    return
        except (ConnectionError, OSError):
            self.close()
        finally:
            if not deliver.done():
                deliver.cancel()

    async def _deliver(
        self,
        direction: str,
        line: asyncio.Queue[tuple[float, bytes | None]],
        dst: asyncio.StreamWriter,
    ) -> None:
        """Write what the pump read once its time has come; b"" is EOF, None a reset."""
        stats = self.proxy.stats
        try:
            while True:
                at, data = await line.get()
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.lost:
                    await asyncio.Event().wait()
                if self.closed:
                    return
                if data is None:
                    self.reset()
                    return
                if not data:
                    with contextlib.suppress(OSError):
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
                if direction == "down":
                    stats.bytes_down += len(data)
                else:
                    stats.bytes_up += len(data)
        except (ConnectionError, OSError):
            self.close()


class FaultProxy:
    """``async with FaultProxy(seed) as proxy``: listens on ``proxy.url``; set
    ``proxy.upstream`` (host, port) before the first connection, and
    ``proxy.faults`` to what should go wrong (it applies to new connections,
    and at once for latency and blackholes)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.upstream: tuple[str, int] | None = None
        self.faults = Faults()
        self.stats = Stats()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._open: asyncio.Event | None = None
        self._count = 0
        self._blackholes: asyncio.Task[None] | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refuse_until = 0.0
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FaultProxy:
        self._loop = asyncio.get_running_loop()
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._blackholes = asyncio.ensure_future(self._blackhole_loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        if self._blackholes is not None:
            self._blackholes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._blackholes
        assert self._server is not None
        self._server.close()
        # Connections still being opened (upstream connects in flight) end here too.
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for link in list(self._links):
            link.close()
            for task in link.tasks:
                task.cancel()
        for link in list(self._links):
            for task in link.tasks:
                with contextlib.suppress(BaseException):
                    await task
        await self._server.wait_closed()

    def set_faults(self, faults: Faults) -> None:
        """Apply ``faults`` from now on and start counting afresh."""
        self.faults = faults
        self.stats = Stats()

    def outage(self, seconds: float) -> None:
        """Reset every connection for ``seconds`` from now (callable from any thread)."""
        self._refuse_until = time.monotonic() + seconds
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._reset_all)

    def _reset_all(self) -> None:
        for link in list(self._links):
            link.reset()

    async def _blackhole_loop(self) -> None:
        rng = random.Random(f"{self.seed}:blackholes")
        assert self._open is not None
        while True:
            every = self.faults.blackhole_every
            if every is None:
                await asyncio.sleep(0.1)
                continue
            await asyncio.sleep(rng.uniform(*every))
            if self.faults.blackhole_every is None:
                continue
            length = rng.uniform(*self.faults.blackhole_for)
            self._open.clear()
            for link in self._links:
                if not link.closed and not link.lost:
                    link.lost = True
                    self.stats.lost_flows += 1
            self.stats.blackholes.append(length)
            try:
                await asyncio.sleep(length)
            finally:
                self._open.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()  # the proxy is closing
            raise
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        self._count += 1
        self.stats.connections += 1
        if not self._open.is_set():
            self.stats.held_connections += 1
            await self._open.wait()
        if self._closing:
            writer.transport.abort()
            return
        if time.monotonic() < self._refuse_until:
            self.stats.resets += 1
            _linger_zero(writer)
            writer.transport.abort()
            return
        link = _Link(self, self._count)
        link.writers.append(writer)
        self._links.add(link)
        try:
            assert self.upstream is not None, "set proxy.upstream first"
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                link.close()
                return
            link.writers.append(up_writer)
            if link.closed:  # reset while the upstream connection was being opened
                _linger_zero(up_writer)
                up_writer.transport.abort()
                return
            link.tasks = [
                asyncio.ensure_future(link.pump("up", reader, up_writer)),
                asyncio.ensure_future(link.pump("down", up_reader, writer)),
            ]
            timer = None
            if link.lifetime is not None:
                timer = asyncio.ensure_future(link.reset_later(link.lifetime))
            try:
                await asyncio.gather(*link.tasks, return_exceptions=True)
            finally:
                if timer is not None:
                    timer.cancel()
        finally:
            if not link.lost:
                link.close()
                self._links.discard(link)


@contextlib.contextmanager
def serving(seed: int) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` run by its own event loop in a thread (so that it keeps
    forwarding while the test blocks, and its timing does not depend on the client's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fault-proxy", daemon=True)
    thread.start()
    proxy = FaultProxy(seed)
    try:
        asyncio.run_coroutine_threadsafe(proxy.__aenter__(), loop).result(10)
        yield proxy
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(proxy.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

"""Command output through a misbehaving network: the SDK's streaming exec, against a
real server, through a TCP proxy that adds latency, resets connections and
blackholes them (:mod:`tests.faultproxy`). The server's public URL is the proxy's,
so the grants point there and every byte the SDK exchanges crosses it.

A command prints numbered, checksummed lines (and a line on stderr every 1,000);
whatever the proxy does, the client must receive exactly those bytes, with
contiguous offsets, then the exit code, and the command must have run once.

The faults come from a seeded RNG; the seed is printed (and is part of every
figure and failure message), and ``SANDLOT_FAULT_SEED=<seed>`` replays the same
decisions (when they strike still depends on timing). ``SANDLOT_RELIABILITY_FULL=1``
runs the larger variant.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
import uuid
from collections.abc import Iterator

import pytest

from sandlot.sdk import AsyncSandlot
from tests.faultproxy import FaultProxy, Faults, serving
from tests.figures import FULL, RecordProperty, report
from tests.servers import SandlotServer, free_port

#: Lines printed, lines per batch, seconds between batches: ~150 KB/s, so that a client
#: cut off for a while (a blackhole, then a reconnection reset in its opening exchange,
#: backoff: up to ~6 s) stays within the server's 1 MiB replay buffer. Beyond it the
#: protocol reports a gap, which this test counts as a failure.
LINES, BATCH, PAUSE = (150_000, 200, 0.1) if FULL else (30_000, 200, 0.1)
EXIT_CODE = 3
#: Seconds between the client's pings: a blackholed socket is given up after about 3 s.
KEEPALIVE = 1.0

#: A line: seven digits, a space, the SHA-256 of the number, a newline (74 bytes).
PRODUCER = """
import hashlib, sys, time
n, batch, pause, code = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
for start in range(1, n + 1, batch):
    out = []
    for i in range(start, min(start + batch, n + 1)):
        out.append(f"{i:07d} {hashlib.sha256(str(i).encode()).hexdigest()}\\n")
        if i % 1000 == 0:
            sys.stdout.write("".join(out))
            out = []
            sys.stdout.flush()
            sys.stderr.write(f"err {i:07d}\\n")
            sys.stderr.flush()
    sys.stdout.write("".join(out))
    sys.stdout.flush()
    time.sleep(pause)
sys.exit(int(code))
"""


def expected(n: int) -> tuple[bytes, bytes]:
    out = b"".join(
        f"{i:07d} {hashlib.sha256(str(i).encode()).hexdigest()}\n".encode() for i in range(1, n + 1)
    )
    err = b"".join(f"err {i:07d}\n".encode() for i in range(1000, n + 1, 1000))
    return out, err


RESETS = Faults(reset_after=0.25)
BLACKHOLES = Faults(blackhole_every=(2.0, 4.0), blackhole_for=(2.0, 3.0))
LATENCY = Faults(latency=(0.005, 0.05))
KINDS = {
    "latency": LATENCY,
    "resets": RESETS,
    "blackholes": BLACKHOLES,
    "mixed": Faults(
        latency=LATENCY.latency,
        reset_after=RESETS.reset_after,
        blackhole_every=(4.0, 7.0),
        blackhole_for=BLACKHOLES.blackhole_for,
    ),
}


@pytest.fixture(scope="module")
def seed() -> int:
    value = int(os.environ.get("SANDLOT_FAULT_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"fault proxy seed: {value} (replay with SANDLOT_FAULT_SEED={value})")
    return value


@pytest.fixture(scope="module")
def proxy(seed: int) -> Iterator[FaultProxy]:
    with serving(seed) as p:
        yield p


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, proxy: FaultProxy) -> Iterator[SandlotServer]:
    # The server announces the proxy as its public URL, so grants name it as the
    # dataplane; its own port is chosen first, for the proxy to forward to it.
    srv = SandlotServer(
        tmp_path_factory.mktemp("faults") / "data", env={"SANDLOT_PUBLIC_URL": proxy.url}
    )
    srv.port = free_port()
    proxy.upstream = ("127.0.0.1", srv.port)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        srv.cleanup()


@pytest.fixture(scope="module")
def key(server: SandlotServer) -> str:
    return server.key("alice", "human")


@pytest.fixture(scope="module")
def thread_id() -> str:
    return f"thr_faults_{uuid.uuid4().hex[:8]}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@pytest.mark.reliability
@pytest.mark.timeout(600 if FULL else 120)
@pytest.mark.parametrize("kind", list(KINDS))
async def test_stream_through_faults_loses_and_repeats_nothing(
    kind: str,
    proxy: FaultProxy,
    server: SandlotServer,
    key: str,
    thread_id: str,
    seed: int,
    record_property: RecordProperty,
) -> None:
    assert server.url == proxy.url
    want = dict(zip(("stdout", "stderr"), expected(LINES), strict=True))
    command_id = f"faults-{kind}-{uuid.uuid4().hex[:8]}"
    command = (
        f"mkdir -p runs && echo start >> runs/{command_id} && "
        f'exec python3 -c "$PRODUCER" {LINES} {BATCH} {PAUSE} {EXIT_CODE}'
    )

    async with AsyncSandlot(proxy.url, key, keepalive=KEEPALIVE) as client:
        sandbox = await client.ensure(thread_id)
        proxy.set_faults(KINDS[kind])
        started = time.monotonic()
        got = {"stdout": bytearray(), "stderr": bytearray()}
        ends = {"stdout": 0, "stderr": 0}
        skipped = gaps = duplicated = 0
        stall, last = 0.0, started
        cmd = await sandbox.stream(command, env={"PRODUCER": PRODUCER}, command_id=command_id)
        try:
            async with asyncio.timeout(400 if FULL else 80):
                async for chunk in cmd:
                    now = time.monotonic()
                    stall, last = max(stall, now - last), now
                    end = ends[chunk.stream]
                    if chunk.offset < end:
                        duplicated += end - chunk.offset
                    elif chunk.offset > end:
                        skipped += chunk.offset - end
                    gaps += chunk.lost
                    ends[chunk.stream] = max(end, chunk.end)
                    got[chunk.stream] += chunk.data.encode()
        finally:
            took = time.monotonic() - started
            stats = proxy.stats
            proxy.set_faults(Faults())
            await cmd.aclose()
        print(f"seed {seed}, {kind}: {stats}, {cmd.reconnects} reconnects, {took:.1f} s")

    # Checked with a fresh client: pooled connections may be flows a blackhole swallowed.
    async with AsyncSandlot(proxy.url, key) as client:
        sandbox = await client.ensure(thread_id)
        runs = await sandbox.read_text(f"runs/{command_id}")
        execs = [e for e in await sandbox.list_execs() if e.command_id == command_id]

    faults = KINDS[kind]
    # The faults did happen (the test cannot pass by the proxy doing nothing)...
    if faults.reset_after:
        assert stats.resets > 0 and cmd.reconnects > 0, stats
    if faults.blackhole_every:
        assert stats.blackholes and stats.lost_flows > 0 and cmd.reconnects > 0, stats
    # ... and changed nothing in what the client got.
    assert skipped == 0, f"seed {seed}: {skipped} bytes silently skipped"
    assert duplicated == 0, f"seed {seed}: {duplicated} bytes duplicated"
    assert gaps == 0, (
        f"seed {seed}: gaps of {gaps} bytes reported: the client fell further behind than "
        "the server's replay buffer holds (the faults are too heavy for this output rate)"
    )
    for stream in ("stdout", "stderr"):
        if bytes(got[stream]) != want[stream]:
            n = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(got[stream], want[stream], strict=False))
                    if a != b
                ),
                min(len(got[stream]), len(want[stream])),
            )
            raise AssertionError(
                f"seed {seed}: {stream} differs from byte {n} "
                f"(got {len(got[stream])} bytes, want {len(want[stream])})"
            )
    assert cmd.exit_code == EXIT_CODE
    assert runs == "start\n", f"seed {seed}: the command ran {runs.count('start')} times"
    assert len(execs) == 1 and execs[0].state == "exited", execs
    assert execs[0].stdout_offset == len(want["stdout"])

    size = len(want["stdout"]) + len(want["stderr"])
    parts = []
    if faults.latency:
        lo, hi = faults.latency
        parts.append(f"{lo * 1000:.0f}-{hi * 1000:.0f} ms latency per chunk")
    if faults.reset_after:
        parts.append(f"{stats.resets} resets")
    if faults.blackhole_every:
        mean = sum(stats.blackholes) / len(stats.blackholes)
        parts.append(f"{len(stats.blackholes)} blackholes of {mean:.1f} s")
    report(
        record_property,
        f"Command output through a fault proxy, {kind} (seed {seed}): {', '.join(parts)}; "
        f"{_mib(size)} over {took:.0f} s, {cmd.reconnects} reattaches, longest wait for "
        f"output {stall:.1f} s: {skipped + gaps} bytes lost, {duplicated} duplicated, exit code "
        "received, 1 run",
    )


@pytest.mark.reliability
@pytest.mark.timeout(120)
async def test_a_running_command_outlives_an_outage(
    proxy: FaultProxy, server: SandlotServer, key: str, thread_id: str
) -> None:
    """Every reconnection refused for 8 s: many more failures in a row than the attempt
    budget, but within the window a running command is given; nothing lost or repeated."""
    async with AsyncSandlot(proxy.url, key, keepalive=KEEPALIVE) as client:
        sandbox = await client.ensure(thread_id)
        proxy.set_faults(Faults())
        cmd = await sandbox.stream(
            "for i in $(seq 1 40); do echo line $i; sleep 0.25; done; exit 7",
            command_id=f"outage-{uuid.uuid4().hex[:8]}",
        )
        out = []
        async with asyncio.timeout(90):
            async for chunk in cmd:
                out.append(chunk.data)
                if "line 3\n" in chunk.data:
                    proxy.outage(8.0)
        assert "".join(out) == "".join(f"line {i}\n" for i in range(1, 41))
        assert cmd.exit_code == 7
        assert proxy.stats.resets > 6, proxy.stats  # more than the attempts alone allow
        # Only one run of the command: nothing re-ran it on a reconnection.
        assert cmd.reconnects >= 1

"""kill -9 of the server while a command streams: the work and every byte survive.

A real ``sandlot serve`` (isolated sandboxes where the machine allows, as in CI)
runs a command that prints checksummed output as fast as the client takes it;
the server is killed with SIGKILL in the middle and started again on the same
port. The SDK's stream reconnects by itself (it rides out outages) and must
receive every byte exactly once, then the exit code; the command must have run
once, and the restarted server must still know it by its exec id and its
``command_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.sdk.types import Event
from tests.figures import FULL, RecordProperty, report
from tests.servers import SandlotServer

#: Bytes the command prints (100 MB at full size, as the reliability figure asks).
TOTAL = 100_000_000 if FULL else 16_000_000

#: Lines of the SHA-256 of their number, written in 64 KiB batches; the run is counted in
#: a file of the workspace first, so a second run would show.
PRODUCER = """
import hashlib, sys
total = int(sys.argv[1])
with open("/workspace/runs.log", "a") as f:
    f.write("run\\n")
out = sys.stdout.buffer
written, i, batch = 0, 0, []
while written < total:
    line = b"%09d %s\\n" % (i, hashlib.sha256(b"%d" % i).hexdigest().encode())
    line = line[: total - written]
    batch.append(line)
    written += len(line)
    i += 1
    if len(batch) == 800:
        out.write(b"".join(batch))
        batch = []
out.write(b"".join(batch))
out.flush()
sys.stderr.write("done\\n")
sys.exit(5)
"""


def expected_digest(total: int) -> str:
    h = hashlib.sha256()
    written, i = 0, 0
    while written < total:
        line = b"%09d %s\n" % (i, hashlib.sha256(b"%d" % i).hexdigest().encode())
        line = line[: total - written]
        h.update(line)
        written += len(line)
        i += 1
    return h.hexdigest()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SandlotServer]:
    srv = SandlotServer(tmp_path / "data").start()
    try:
        yield srv
    finally:
        srv.stop()
        srv.cleanup()


@pytest.mark.reliability
@pytest.mark.timeout(300)
async def test_kill9_mid_stream_loses_and_repeats_nothing(
    server: SandlotServer, record_property: RecordProperty
) -> None:
    key = server.key("alice", "agent")
    thread = f"thr_crash_{uuid.uuid4().hex[:6]}"
    command_id = f"crash-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    received = 0
    restarted = threading.Event()
    restart_error: list[BaseException] = []

    def crash_and_restart() -> None:
        try:
            server.kill9()
            server.start()
        except BaseException as exc:  # reported by the test below
            restart_error.append(exc)
        finally:
            restarted.set()

    async with AsyncSandlot(server.url, key) as client:
        sandbox = await client.ensure(thread)
        cmd = await sandbox.stream(["python3", "-c", PRODUCER, str(TOTAL)], command_id=command_id)
        crash: threading.Thread | None = None
        started = time.monotonic()
        async with asyncio.timeout(240):
            async for chunk in cmd:
                if chunk.stream != "stdout":
                    continue
                assert chunk.offset == received, (chunk.offset, received)
                data = chunk.data.encode()
                digest.update(data)
                received += len(data)
                if crash is None and received >= TOTAL // 3:
                    crash = threading.Thread(target=crash_and_restart)
                    crash.start()
        elapsed = time.monotonic() - started
        assert crash is not None
        await asyncio.to_thread(restarted.wait, 60)
        assert not restart_error, restart_error
        assert cmd.exit_code == 5
        assert received == TOTAL
        assert digest.hexdigest() == expected_digest(TOTAL)

        # The restarted server knows the command by its id and by its command_id.
        exec_id = cmd.exec_id
        assert exec_id is not None
        snap = await sandbox.get_exec(exec_id)
        assert snap.state == "exited" and snap.exit_code == 5
        assert snap.stdout_offset == TOTAL
        again = await sandbox.exec(["python3", "-c", PRODUCER, str(TOTAL)], command_id=command_id)
        assert again.exec_id == exec_id and again.exit_code == 5
        runs = await sandbox.read_text("/workspace/runs.log")
        assert runs == "run\n", runs
    report(
        record_property,
        f"kill -9 of the server after {TOTAL // 3:,} of {TOTAL:,} bytes, restart: "
        f"{received:,} bytes received in {elapsed:.1f} s with {cmd.reconnects} reconnects, "
        "identical SHA-256, 0 bytes lost, 0 duplicated, exit code received, same exec id, "
        "command ran once",
    )


def test_graceful_restart_keeps_running_commands(server: SandlotServer) -> None:
    """SIGTERM (an upgrade, say) does not end the commands of sandboxes that survive it."""
    headers = server.headers("alice", "agent")
    grant = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"thread_id": f"thr_{uuid.uuid4().hex[:6]}", "mode": "ensure"},
        headers=headers,
        timeout=30,
    ).json()
    dp = grant["dataplane"]["http_base_url"]
    auth = {"Authorization": f"Bearer {grant['token']}"}
    # A long command through the one-shot route; its caller loses the answer in the restart.

    def call() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{dp}/exec",
                json={"command": "echo before; sleep 4; echo after", "command_id": "slow-1"},
                headers=auth,
                timeout=30,
            )

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        execs = httpx.get(f"{dp}/execs", headers=auth, timeout=10).json()["execs"]
        if any(e["command_id"] == "slow-1" for e in execs):
            break
        time.sleep(0.05)
    server.restart()
    t.join(30)
    # The retry with the same command_id answers with the one run's output.
    r = httpx.post(
        f"{dp}/exec",
        json={"command": "echo before; sleep 4; echo after", "command_id": "slow-1"},
        headers=auth,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stdout"] == "before\nafter\n" and body["exit_code"] == 0
    runs = [e for e in httpx.get(f"{dp}/execs", headers=auth, timeout=10).json()["execs"]]
    assert [e["command_id"] for e in runs].count("slow-1") == 1


@pytest.mark.reliability
@pytest.mark.timeout(120)
async def test_kill9_with_a_shell_attached_keeps_the_shell(
    server: SandlotServer, record_property: RecordProperty
) -> None:
    """The same bash (its variables), its name, session id and offsets after the restart;
    what it printed while the server was down is in the history, nothing twice."""
    key = server.key("alice", "human")
    thread = f"thr_shell_{uuid.uuid4().hex[:6]}"
    async with AsyncSandlot(server.url, key) as client:
        sandbox = await client.ensure(thread)
        shell = await sandbox.shell("work")
        session_id = shell.session_id
        await shell.send("export KEPT=42; echo ready-$((40+2))\n")
        await shell.read_until("ready-42")
        await shell.send(
            "for i in $(seq 1 30); do echo tick-$i; sleep 0.1; done; echo ticks-done\n"
        )
        received = b""
        base = shell.offset
        while b"tick-3\r\n" not in received:
            chunk = await shell.read(10)
            assert chunk is not None
            assert chunk.offset == base + len(received)
            received += chunk.data.encode()
        await asyncio.to_thread(server.kill9)
        await asyncio.to_thread(server.start)

        again = await sandbox.shell("work", create=False)
        assert again.session_id == session_id
        history = again.history.encode()
        hist_start = again.offset - len(history)
        assert hist_start <= base + len(received), (hist_start, base, len(received))
        # Everything after what the first client had, from the history, then live.
        rest = history[base + len(received) - hist_start :]
        while b"ticks-done\r\n" not in rest:
            chunk = await again.read(20)
            assert chunk is not None
            rest += chunk.data.encode()
        text = (received + rest).decode()
        ticks = re.findall(r"tick-(\d+)\r\n", text)
        assert ticks == [str(i) for i in range(1, 31)], text
        await again.send("echo kept=$KEPT\n")
        await again.read_until("kept=42")
        shells = await sandbox.list_shells()
        assert [s.name for s in shells] == ["work"]
        await again.aclose()
        await shell.aclose()
    report(
        record_property,
        "kill -9 of the server with a shell attached and printing, restart: same shell "
        "(session id, environment), 30 lines printed across the crash each received once",
    )


async def _events_until(
    sandbox: AsyncSandbox, after: int, done: Callable[[Event], bool]
) -> list[Event]:
    seen: list[Event] = []
    try:
        async with asyncio.timeout(20):
            async for event in sandbox.events(after=after):
                seen.append(event)
                if done(event):
                    return seen
    except TimeoutError:
        pass
    raise AssertionError(f"not the events awaited: {[(e.sequence, e.event_type) for e in seen]}")


@pytest.mark.timeout(120)
async def test_kill9_keeps_the_event_log_and_its_sequence(server: SandlotServer) -> None:
    """A cursor taken before the crash stays valid: the same events under the same
    sequences, and what happens after the restart follows them (never from 1 again)."""
    key = server.key("alice", "agent")
    async with AsyncSandlot(server.url, key) as client:
        sandbox = await client.ensure(f"thr_ev_{uuid.uuid4().hex[:6]}")
        await sandbox.run("echo before > /workspace/before.txt")
        before = await _events_until(sandbox, 0, lambda e: e.event_type == "exec.exited")
        last = before[-1].sequence
        await asyncio.to_thread(server.kill9)
        await asyncio.to_thread(server.start)

        replay = await _events_until(sandbox, 0, lambda e: e.sequence == last)
        assert [(e.sequence, e.event_type, e.raw["event_id"]) for e in replay] == [
            (e.sequence, e.event_type, e.raw["event_id"]) for e in before
        ]
        await sandbox.run("true")
        after = await _events_until(sandbox, last, lambda e: e.event_type == "exec.exited")
        assert after[0].sequence == last + 1
        assert [e.sequence for e in after] == list(range(last + 1, last + 1 + len(after)))

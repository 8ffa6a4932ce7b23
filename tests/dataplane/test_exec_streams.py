"""Streaming exec over real WebSockets: reattach without loss, gaps, several clients."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import socket
import time
from typing import Any

import httpx
import pytest
import websockets

from tests.dataplane.conftest import Server
from tests.figures import FULL, RecordProperty, report


async def _recv(ws: Any) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 10))


@pytest.mark.engine
def test_exec_options(server: Server, client: httpx.Client) -> None:
    r = client.post(server.url("/exec"), json={"command": "sleep 5", "timeout": 0.3})
    assert r.json()["exit_code"] == 124 and r.json()["timed_out"] is True
    r = client.post(server.url("/exec"), json={"command": ["cat"], "stdin": "piped"})
    assert r.json()["stdout"] == "piped"
    r = client.post(
        server.url("/exec"), json={"command": "pwd; echo $FOO", "cwd": "sub", "env": {"FOO": "bar"}}
    )
    assert r.status_code == 400  # cwd missing
    (server.workspace / "sub").mkdir()
    r = client.post(
        server.url("/exec"), json={"command": "pwd; echo $FOO", "cwd": "sub", "env": {"FOO": "bar"}}
    )
    assert r.json()["stdout"].endswith("sub\nbar\n")
    big = client.post(
        server.url("/exec"), json={"command": "head -c 3000000 /dev/zero | tr '\\0' a"}
    )
    assert big.json()["truncated"] is False and len(big.json()["stdout"]) == 3_000_000
    r1 = client.post(server.url("/exec"), json={"command": "echo $RANDOM", "command_id": "once"})
    r2 = client.post(server.url("/exec"), json={"command": "echo $RANDOM", "command_id": "once"})
    assert r1.json() == r2.json()
    snap = client.get(server.url(f"/execs/{r1.json()['exec_id']}")).json()
    assert snap["state"] == "exited" and snap["last_event_sequence"] >= 1
    assert any(
        e["exec_id"] == snap["exec_id"] for e in client.get(server.url("/execs")).json()["execs"]
    )
    assert client.get(server.url("/execs/ex_nope")).status_code == 404
    bad = client.post(server.url("/exec"), json={"command": ""})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "INVALID_REQUEST"
    assert client.post(server.url("/exec"), content=b"{nope").status_code == 400


def test_output_cap_truncates(tmp_path: Any) -> None:
    from tests.dataplane.conftest import start_server

    gen = start_server(tmp_path, max_output_bytes=1000)
    srv = next(gen)
    try:
        r = httpx.post(srv.url("/exec"), headers=srv.headers(), json={"command": "seq 1 10000"})
        assert r.json()["truncated"] is True and len(r.json()["stdout"]) <= 1000
    finally:
        gen.close()


def test_running_commands_keep_a_bounded_output_together(tmp_path: Any) -> None:
    # Each running POST /exec kept up to 10 MiB per stream for its answer, and a
    # sandbox may run 1,000: some 20 GB of the server's memory for one sandbox.
    from tests.dataplane.conftest import start_server

    gen = start_server(tmp_path, max_output_bytes=1000, max_collecting_bytes=2500)
    srv = next(gen)
    try:
        loud = "head -c 3000 /dev/zero | tr '\\0' a; sleep 2"

        async def together() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(headers=srv.headers(), timeout=60) as c:
                answers = await asyncio.gather(
                    *(c.post(srv.url("/exec"), json={"command": loud}) for _ in range(3))
                )
            return [a.json() for a in answers]

        answers = asyncio.run(together())
        assert all(a["exit_code"] == 0 and a["truncated"] for a in answers), answers
        assert sum(len(a["stdout"]) for a in answers) <= 2500
        # Ended, they give their share back: one alone keeps its whole 1000 again.
        r = httpx.post(srv.url("/exec"), headers=srv.headers(), json={"command": loud})
        assert len(r.json()["stdout"]) == 1000 and r.json()["truncated"] is True
    finally:
        gen.close()


PRODUCER = (
    'python3 -c "import hashlib,sys,time\n'
    "for i in range({n}):\n"
    "  line='%06d %s\\n'%(i,hashlib.sha1(str(i).encode()).hexdigest()+'é✓')\n"
    "  sys.stdout.write(line); sys.stdout.flush()\n"
    '  if i%5==0: time.sleep(0.003)"'
)


def _expected(n: int) -> bytes:
    return b"".join(
        (f"{i:06d} " + hashlib.sha1(str(i).encode()).hexdigest() + "é✓\n").encode()
        for i in range(n)
    )


async def _reattach_run(server: Server, n: int, drops: int) -> tuple[int, int]:
    hdr = server.headers()
    got = bytearray()
    exec_id = None
    rng = random.Random(7)
    reattaches = 0
    stdin_closed = False
    while True:
        async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as ws:
            if exec_id is None:
                await ws.send(json.dumps({"type": "start", "command": PRODUCER.format(n=n)}))
            else:
                await ws.send(
                    json.dumps(
                        {
                            "type": "attach",
                            "exec_id": exec_id,
                            "stdout_offset": len(got),
                            "stderr_offset": 0,
                        }
                    )
                )
                reattaches += 1
            ready = await _recv(ws)
            assert ready["type"] == "ready", ready
            exec_id = ready["exec_id"]
            if not stdin_closed:
                await ws.send(json.dumps({"type": "close_stdin"}))
                stdin_closed = True
            budget = rng.randint(1, 2) if reattaches < drops else 10**9
            while True:
                frame = await _recv(ws)
                if frame["type"] == "stdout":
                    assert frame["offset"] == len(got), (frame["offset"], len(got))
                    got += frame["data"].encode()
                    budget -= 1
                    if budget <= 0:
                        break  # drop the connection at a random point
                elif frame["type"] == "exit":
                    assert frame["exit_code"] == 0
                    assert reattaches >= drops
                    assert (
                        hashlib.sha256(got).hexdigest() == hashlib.sha256(_expected(n)).hexdigest()
                    )
                    return reattaches, len(got)
                elif frame["type"] == "gap":
                    raise AssertionError(f"unexpected gap {frame}")


@pytest.mark.reliability
@pytest.mark.timeout(600)
@pytest.mark.local_only(
    "its 220 drops race the command's output: with the relay's extra hop the command ends "
    "first on a loaded machine (reattaching through the relay: tests/providers)"
)
def test_reattach_hundreds_of_times_loses_nothing(
    server: Server, record_property: RecordProperty
) -> None:
    lines, drops = (30_000, 2_000) if FULL else (3000, 220)
    reattaches, size = asyncio.run(_reattach_run(server, lines, drops))
    report(
        record_property,
        f"{reattaches} reattaches at random points over {size:,} bytes: identical SHA-256, "
        "0 bytes lost, 0 duplicated",
    )


async def _gap_run(server: Server) -> None:
    hdr = server.headers()
    async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as ws:
        await ws.send(
            json.dumps(
                {"type": "start", "command": "head -c 300000 /dev/zero | tr '\\0' x; echo done >&2"}
            )
        )
        ready = await _recv(ws)
    exec_id = ready["exec_id"]
    await asyncio.sleep(0.5)
    async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as ws:
        await ws.send(
            json.dumps(
                {"type": "attach", "exec_id": exec_id, "stdout_offset": 0, "stderr_offset": 0}
            )
        )
        assert (await _recv(ws))["type"] == "ready"
        frames = []
        while True:
            f = await _recv(ws)
            frames.append(f)
            if f["type"] == "exit":
                break
    gaps = [f for f in frames if f["type"] == "gap"]
    assert gaps and gaps[0]["stream"] == "stdout" and gaps[0]["from"] == 0
    lost = gaps[0]["to"]
    data = "".join(f["data"] for f in frames if f["type"] == "stdout")
    assert lost + len(data) == 300000
    assert "".join(f["data"] for f in frames if f["type"] == "stderr") == "done\n"


def test_gap_beyond_buffer(tmp_path: Any) -> None:
    from tests.dataplane.conftest import start_server

    gen = start_server(tmp_path, stream_buffer_bytes=100_000)
    srv = next(gen)
    try:
        asyncio.run(_gap_run(srv))
    finally:
        gen.close()


async def _two_clients(server: Server) -> None:
    hdr = server.headers()
    async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as a:
        await a.send(
            json.dumps(
                {"type": "start", "command": "read x; seq 1 20000; echo $x", "command_id": "shared"}
            )
        )
        ready = await _recv(a)
        async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as b:
            await b.send(json.dumps({"type": "attach", "command_id": "shared"}))
            assert (await _recv(b))["exec_id"] == ready["exec_id"]
            await b.send(json.dumps({"type": "ping"}))
            await a.send(json.dumps({"type": "stdin", "data": "hello\n"}))

            async def collect(ws: Any) -> str:
                out = []
                while True:
                    f = await _recv(ws)
                    if f["type"] == "stdout":
                        out.append(f["data"])
                    if f["type"] == "exit":
                        return "".join(out)

            ra, rb = await asyncio.gather(collect(a), collect(b))
    assert ra == rb and ra.endswith("20000\nhello\n")


def test_two_clients_identical(server: Server) -> None:
    asyncio.run(_two_clients(server))


async def _pty_and_signal(server: Server) -> None:
    hdr = server.headers()
    async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "start",
                    "command": "stty size; tty >/dev/null && echo TTY; sleep 30",
                    "pty": True,
                    "cols": 100,
                    "rows": 40,
                }
            )
        )
        assert (await _recv(ws))["type"] == "ready"
        out = ""
        while "TTY" not in out:
            f = await _recv(ws)
            out += f.get("data", "")
        assert "40 100" in out
        await ws.send(json.dumps({"type": "resize", "cols": 90, "rows": 30}))
        await ws.send(json.dumps({"type": "signal", "signal": "SIGTERM"}))
        while True:
            f = await _recv(ws)
            if f["type"] == "exit":
                assert f["signal"] == "SIGTERM" or f["exit_code"] == 143
                break


@pytest.mark.engine
def test_pty_mode_resize_signal(server: Server) -> None:
    asyncio.run(_pty_and_signal(server))


@pytest.mark.engine
def test_signal_endpoint(server: Server, client: httpx.Client) -> None:
    async def run() -> None:
        async with websockets.connect(
            server.ws_url("/exec/ws"), additional_headers=server.headers()
        ) as ws:
            await ws.send(json.dumps({"type": "start", "command": "sleep 30"}))
            ready = await _recv(ws)
            r = await asyncio.to_thread(
                client.post,
                server.url(f"/execs/{ready['exec_id']}/signal"),
                json={"signal": "SIGKILL"},
            )
            assert r.status_code == 200
            while (f := await _recv(ws))["type"] != "exit":
                pass
            assert f["exit_code"] == 137

    asyncio.run(run())


def test_langsmith_execute_ws_reconnect(server: Server) -> None:
    async def run() -> None:
        hdr = {"X-Api-Key": server.token()}
        async with websockets.connect(server.ws_url("/execute/ws"), additional_headers=hdr) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "execute",
                        "command": "echo one; sleep 0.3; echo two",
                        "command_id": "ls1",
                    }
                )
            )
            started = await _recv(ws)
            assert started["type"] == "started" and started["command_id"] == "ls1"
            first = await _recv(ws)
            assert first == {"type": "stdout", "data": "one\n", "offset": 0}
        async with websockets.connect(server.ws_url("/execute/ws"), additional_headers=hdr) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "reconnect",
                        "command_id": "ls1",
                        "stdout_offset": 4,
                        "stderr_offset": 0,
                    }
                )
            )
            assert (await _recv(ws))["type"] == "started"
            f = await _recv(ws)
            assert f["type"] == "stdout" and f["offset"] == 4 and f["data"] == "two\n"
            assert (await _recv(ws))["type"] == "exit"

    asyncio.run(run())
    r = httpx.post(
        server.url("/execute"),
        headers={"X-Api-Key": server.token()},
        json={"command": "echo ls", "timeout": 5},
    )
    assert r.json()["stdout"] == "ls\n" and r.json()["exit_code"] == 0


def test_slow_client_gets_gap_and_never_stalls_fast_one(tmp_path: Any) -> None:
    """A client that stops reading falls behind the buffer, not the others."""
    from tests.dataplane.conftest import start_server

    gen = start_server(tmp_path, stream_buffer_bytes=256 * 1024)
    server = next(gen)
    total = 12_000_000

    async def run() -> None:
        hdr = server.headers()
        url = server.ws_url("/exec/ws")
        async with websockets.connect(url, additional_headers=hdr) as fast:
            await fast.send(
                json.dumps(
                    {
                        "type": "start",
                        "command": f"read go; head -c {total} /dev/zero | tr '\\0' y",
                        "command_id": "flood",
                    }
                )
            )
            await _recv(fast)
            # A small receive buffer: otherwise the client's kernel (autotuned up to
            # tcp_rmem's 32 MiB here) absorbs the whole flood for it.
            sk = socket.socket()
            sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            sk.connect(("127.0.0.1", int(server.base.rsplit(":", 1)[1])))
            # No permessage-deflate either: a flood of "y" would compress to nothing.
            slow = await websockets.connect(
                url, additional_headers=hdr, max_queue=1, sock=sk, compression=None
            )
            await slow.send(json.dumps({"type": "attach", "command_id": "flood"}))
            assert (await _recv(slow))["type"] == "ready"
            slow.transport.pause_reading()
            await fast.send(json.dumps({"type": "stdin", "data": "go\n"}))
            got = 0
            while True:
                f = await _recv(fast)
                if f["type"] == "stdout":
                    assert f["offset"] == got
                    got += len(f["data"])
                elif f["type"] == "exit":
                    break
                else:
                    raise AssertionError(f)
            assert got == total
            slow.transport.resume_reading()
            gaps, received = [], 0
            while True:
                f = await _recv(slow)
                if f["type"] == "gap":
                    gaps.append(f)
                elif f["type"] == "stdout":
                    received += len(f["data"])
                elif f["type"] == "exit":
                    break
            assert gaps, "the slow client must be told what it lost"
            assert received + sum(g["to"] - g["from"] for g in gaps) == total
            slow.transport.abort()

    try:
        asyncio.run(run())
    finally:
        gen.close()


def test_attach_beyond_the_end_is_refused(server: Server, client: httpx.Client) -> None:
    done = client.post(server.url("/exec"), json={"command": "echo hi", "command_id": "short"})
    exec_id = done.json()["exec_id"]

    async def run() -> None:
        async with websockets.connect(
            server.ws_url("/exec/ws"), additional_headers=server.headers()
        ) as ws:
            await ws.send(json.dumps({"type": "attach", "exec_id": exec_id, "stdout_offset": 99}))
            err = await _recv(ws)
            assert err["type"] == "error" and err["code"] == "INVALID_REQUEST"
        async with websockets.connect(
            server.ws_url("/exec/ws"), additional_headers=server.headers()
        ) as ws:
            # Attaching to a finished command replays it, then exits.
            await ws.send(json.dumps({"type": "attach", "exec_id": exec_id, "stdout_offset": 1}))
            assert (await _recv(ws))["type"] == "ready"
            assert await _recv(ws) == {"type": "stdout", "data": "i\n", "offset": 1}
            assert (await _recv(ws))["type"] == "exit"

    asyncio.run(run())


def test_input_a_command_leaves_unread_does_not_lose_its_result(
    server: Server, client: httpx.Client
) -> None:
    # Past the pipe's 64 KiB, the rest of the input met a command that no longer read it:
    # the answer was 409 "stdin is closed" and the command's result was lost.
    r = client.post(server.url("/exec"), json={"command": "head -c 5", "stdin": "y" * 200_000})
    assert r.status_code == 200, r.text
    assert (r.json()["stdout"], r.json()["exit_code"]) == ("yyyyy", 0)
    r = client.post(
        server.url("/exec"),
        json={"command": "sleep 30", "stdin": "z" * (1 << 20), "timeout": 0.5},
    )
    assert r.status_code == 200, r.text
    assert (r.json()["exit_code"], r.json()["timed_out"]) == (124, True)

    async def over_a_socket() -> None:
        async with websockets.connect(
            server.ws_url("/exec/ws"), additional_headers=server.headers()
        ) as ws:
            await ws.send(
                json.dumps({"type": "start", "command": "head -c 3", "stdin": "w" * 200_000})
            )
            assert (await _recv(ws))["type"] == "ready"
            out = ""
            while (frame := await _recv(ws))["type"] != "exit":
                out += frame.get("data", "")
            assert (out, frame["exit_code"]) == ("www", 0)

    asyncio.run(over_a_socket())


def test_a_refused_attach_is_not_a_client_leaving(server: Server, client: httpx.Client) -> None:
    # Refused for its offset, an attach counted as a client leaving: a command ended on
    # its client's disconnect was killed under the client still attached.
    async def run() -> str:
        url = server.ws_url("/exec/ws")
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "start",
                        "command": "for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.3; done",
                        "kill_on_disconnect": True,
                    }
                )
            )
            exec_id = (await _recv(ws))["exec_id"]
            async with websockets.connect(url, additional_headers=server.headers()) as other:
                await other.send(
                    json.dumps({"type": "attach", "exec_id": exec_id, "stdout_offset": 10**9})
                )
                err = await _recv(other)
                assert err["type"] == "error" and err["code"] == "INVALID_REQUEST"
            out = ""
            while (frame := await _recv(ws))["type"] != "exit":
                out += frame.get("data", "")
            assert "tick6" in out and frame["exit_code"] == 0, frame
            return exec_id

    exec_id = asyncio.run(run())
    assert client.get(server.url(f"/execs/{exec_id}")).json()["state"] == "exited"


@pytest.mark.engine
def test_ping_close_and_kill_on_disconnect(server: Server, client: httpx.Client) -> None:
    async def run() -> tuple[str, str]:
        url = server.ws_url("/exec/ws")
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(json.dumps({"type": "ping"}))
            assert (await _recv(ws))["type"] == "pong"
            await ws.send(
                json.dumps({"type": "start", "command": "sleep 30", "kill_on_disconnect": True})
            )
            killed = (await _recv(ws))["exec_id"]
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(json.dumps({"type": "start", "command": "sleep 30"}))
            kept = (await _recv(ws))["exec_id"]
            await ws.send(json.dumps({"type": "close"}))  # detach: the command keeps running
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    await _recv(ws)
        return killed, kept

    killed, kept = asyncio.run(run())
    deadline = time.time() + 5
    while client.get(server.url(f"/execs/{killed}")).json()["state"] == "running":
        assert time.time() < deadline
        time.sleep(0.05)
    assert client.get(server.url(f"/execs/{killed}")).json()["state"] == "killed"
    assert client.get(server.url(f"/execs/{kept}")).json()["state"] == "running"
    client.post(server.url(f"/execs/{kept}/signal"), json={"signal": "KILL"})


async def _lone_surrogate(server: Server) -> None:
    hdr = server.headers()
    async with websockets.connect(server.ws_url("/exec/ws"), additional_headers=hdr) as ws:
        await ws.send(json.dumps({"type": "start", "command": "read x; echo got-$x"}))
        assert (await _recv(ws))["type"] == "ready"
        # JSON's "\ud800" is text with no UTF-8 form: refused as a frame, the socket kept.
        await ws.send('{"type": "stdin", "data": "a\\ud800b\\n"}')
        refused = await _recv(ws)
        assert refused["type"] == "error" and refused["code"] == "INVALID_REQUEST"
        await ws.send(json.dumps({"type": "stdin", "data": "fine\n"}))
        out = ""
        while True:
            frame = await _recv(ws)
            if frame["type"] == "stdout":
                out += frame["data"]
            if frame["type"] == "exit":
                break
        assert out == "got-fine\n"


async def _lone_surrogate_in_a_shell(server: Server) -> None:
    url = server.ws_url("/shell/ws?session=surrogate")
    async with websockets.connect(url, additional_headers=server.headers()) as ws:
        assert (await _recv(ws))["type"] == "session"
        await ws.send('{"type": "stdin", "data": "echo a\\ud800b\\n"}')
        while (frame := await _recv(ws))["type"] != "error":
            pass
        assert frame["code"] == "INVALID_REQUEST"
        await ws.send(json.dumps({"type": "stdin", "data": "echo still-$((40+2))\n"}))
        out = ""
        while "still-42" not in out:
            frame = await _recv(ws)
            if frame["type"] in ("stdout", "history"):
                out += frame["data"]


def test_a_lone_surrogate_in_stdin_is_refused_and_the_socket_lives(server: Server) -> None:
    asyncio.run(_lone_surrogate(server))
    asyncio.run(_lone_surrogate_in_a_shell(server))

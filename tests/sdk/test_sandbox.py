"""The async dataplane client against a real server: commands, streams that survive
dropped connections, shells, files, filesystem operations, events, bootstrap grants."""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from sandlot.protocol.errors import (
    CommandExitError,
    FileNotFound,
    InvalidRequest,
    PreconditionFailed,
    RequestTimeout,
    SandboxStarting,
    SandlotError,
)
from sandlot.sdk import (
    ArchiveResult,
    AsyncSandbox,
    AsyncSandlot,
    EditResult,
    ExecSnapshot,
    FileEntry,
    FileStat,
    Grant,
    ShellSnapshot,
    UploadResult,
)
from sandlot.sdk.transport import Deadline
from sandlot.sdk.types import Actor
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def pair(
    server: SandlotServer, human_key: str
) -> AsyncIterator[tuple[AsyncSandlot, AsyncSandbox]]:
    async with AsyncSandlot(server.url, human_key) as client:
        yield client, await client.ensure(f"thr_{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def sandbox(pair: tuple[AsyncSandlot, AsyncSandbox]) -> AsyncSandbox:
    return pair[1]


async def test_exec_and_run(sandbox: AsyncSandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    with pytest.raises(CommandExitError) as info:
        await sandbox.run("echo partial; exit 2")
    assert info.value.result.exit_code == 2
    assert info.value.result.stdout == "partial\n"
    ok = await sandbox.run(["printf", "%s", "a b"], cwd="/tmp", env={"X": "1"})
    assert ok.stdout == "a b"
    timed = await sandbox.exec("sleep 5", timeout_seconds=0.3)
    assert timed.timed_out and timed.exit_code == 124
    # A repeated command_id returns the first run's result instead of running again.
    cid = f"c-{uuid.uuid4().hex}"
    first = await sandbox.exec("echo $RANDOM$RANDOM >> /tmp/runs; cat /tmp/runs", command_id=cid)
    second = await sandbox.exec("echo $RANDOM$RANDOM >> /tmp/runs; cat /tmp/runs", command_id=cid)
    assert first.stdout == second.stdout and len(first.stdout.splitlines()) == 1


async def test_run_without_waiting(sandbox: AsyncSandbox) -> None:
    cmd = await sandbox.run("sleep 0.2; echo later", wait=False)
    assert not isinstance(cmd, type(None))
    result = await cmd.wait()  # type: ignore[union-attr]
    assert result.stdout == "later\n" and result.exit_code == 0


async def test_stream_survives_dropped_connections(sandbox: AsyncSandbox) -> None:
    # Checksummed numbered lines; the socket is torn down under the client three times.
    script = (
        "for i in $(seq 1 400); do echo line-$i; echo err-$i >&2; "
        "if [ $((i % 100)) = 0 ]; then sleep 0.2; fi; done; "
        "echo run >> /tmp/stream-runs"
    )
    cmd = await sandbox.stream(script)
    out: list[str] = []
    err: list[str] = []
    drops = 0
    async for chunk in cmd:
        assert chunk.lost == 0
        (out if chunk.stream == "stdout" else err).append(chunk.data)
        if drops < 3 and sum(map(len, out)) > (drops + 1) * 1000:
            drops += 1
            cmd._ws.transport.abort()  # the network fails under the client
    assert cmd.exit_code == 0
    assert cmd.reconnects >= 3
    assert cmd._ws is None  # read to its end, the stream let go of its socket
    expected_out = "".join(f"line-{i}\n" for i in range(1, 401))
    expected_err = "".join(f"err-{i}\n" for i in range(1, 401))
    assert (
        hashlib.sha256("".join(out).encode()).hexdigest()
        == hashlib.sha256(expected_out.encode()).hexdigest()
    )
    assert "".join(err) == expected_err
    # Never re-run: the command appended exactly once.
    assert (await sandbox.exec("cat /tmp/stream-runs")).stdout == "run\n"


async def test_stream_deadline_raises_timeout_error(sandbox: AsyncSandbox) -> None:
    # The command's deadline is not a broken connection: no reconnection attempts.
    cmd = await sandbox.stream("sleep 30", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await cmd.wait()
    assert time.monotonic() - started < 2.0
    assert cmd.reconnects == 0


async def test_stream_stdin_and_attach(sandbox: AsyncSandbox) -> None:
    cmd = await sandbox.stream("read line; echo got-$line; sleep 0.3; echo bye")
    await cmd.send_stdin("hello\n")
    first = await cmd.__anext__()
    assert first.data.startswith("got-hello")
    exec_id = cmd.exec_id
    assert exec_id
    await cmd.aclose()  # detach; the command keeps running
    again = await sandbox.attach(exec_id, stdout_offset=first.end)
    result = await again.wait()
    assert result.stdout.strip().endswith("bye")
    assert "got-hello" not in result.stdout
    snap = await sandbox.get_exec(exec_id)
    assert isinstance(snap, ExecSnapshot) and snap.exec_id == exec_id
    assert (snap.state, snap.exit_code, snap.running) == ("exited", 0, False)
    assert snap.command == "read line; echo got-$line; sleep 0.3; echo bye"
    assert isinstance(snap.actor, Actor) and snap.actor.type == "human"
    assert snap.stdout_offset == first.end + len(result.stdout.encode())
    assert snap.stderr_offset == 0 and snap.started_at and snap.ended_at
    assert snap.last_event_sequence >= 1 and not snap.pty and snap.signal is None
    assert snap.to_dict()["exec_id"] == exec_id  # the body as sent
    assert exec_id in {e.exec_id for e in await sandbox.list_execs()}


async def test_signal_returns_the_snapshot(sandbox: AsyncSandbox) -> None:
    argv = ["sh", "-c", "echo up; exec sleep 30"]
    cmd = await sandbox.stream(argv)
    assert (await cmd.__anext__()).data == "up\n"
    assert cmd.exec_id
    sent = await sandbox.signal_exec(cmd.exec_id, "SIGTERM")
    assert isinstance(sent, ExecSnapshot) and sent.exec_id == cmd.exec_id
    assert sent.command == argv
    await cmd.wait()
    ended = await sandbox.get_exec(cmd.exec_id)
    assert not ended.running and ended.signal == "SIGTERM"


async def test_shells_driver_and_observer(pair: tuple[AsyncSandlot, AsyncSandbox]) -> None:
    _, sandbox = pair
    name = f"sh{uuid.uuid4().hex[:6]}"
    async with (
        await sandbox.shell(name) as driver,
        await sandbox.shell(name, role="observer") as observer,
    ):
        await driver.resize(100, 30)
        await driver.send("echo shared-$((6*7))\n")
        assert "shared-42" in await driver.read_until("shared-42")
        assert "shared-42" in await observer.read_until("shared-42")
        listed = {s.name: s for s in await sandbox.list_shells()}
        shell = listed[name]
        assert isinstance(shell, ShellSnapshot)
        assert (shell.clients, shell.state, shell.profile) == (2, "running", "default")
        assert shell.offset > 0 and shell.session_id and shell.created_at.endswith("Z")
    await sandbox.delete_shell(name)
    assert name not in {s.name for s in await sandbox.list_shells()}


async def test_files(sandbox: AsyncSandbox, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, binary
    local = tmp_path / "blob.bin"
    local.write_bytes(payload)
    stored = await sandbox.upload("/workspace/in/blob.bin", local)
    assert stored == UploadResult(path="/workspace/in/blob.bin", size=len(payload))
    assert await sandbox.download("/workspace/in/blob.bin") == payload
    assert (await sandbox.upload("raw.txt", b"raw bytes")).path == "/workspace/raw.txt"
    assert await sandbox.download_to("raw.txt", str(tmp_path / "raw.txt")) == 9
    with pytest.raises(FileNotFound):
        await sandbox.download("missing.txt")

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("A")
    (tree / "sub" / "b.txt").write_text("B")
    await sandbox.write("/workspace/sync/stale.txt", "old")
    synced = await sandbox.upload_archive("/workspace/sync", tree, delete_missing=True)
    assert isinstance(synced, ArchiveResult)
    assert (synced.path, synced.files, synced.deleted, synced.bytes) == ("/workspace/sync", 2, 1, 2)
    assert synced.directories >= 1
    names = {e.path for e in await sandbox.ls("/workspace/sync", depth=2)}
    assert names == {"/workspace/sync/a.txt", "/workspace/sync/sub", "/workspace/sync/sub/b.txt"}
    with tarfile.open(fileobj=io.BytesIO(await sandbox.download_archive("/workspace/sync"))) as tar:
        assert {"a.txt", "sub/b.txt"} <= {m.name.removeprefix("./") for m in tar.getmembers()}


async def test_archive_transfers_end_when_idle_not_at_a_deadline(sandbox: AsyncSandbox) -> None:
    """A transfer slower than a deadline goes on while bytes move (``idle_timeout``)."""
    await sandbox.run("mkdir -p /workspace/idle && head -c 4000000 /dev/urandom > idle/f")

    async def slowly(**kw: float) -> int:
        got = 0
        async for chunk in sandbox.download_archive_stream("/workspace/idle", **kw):
            got += len(chunk)
            await asyncio.sleep(0.2)  # a slow reader: some 16 pieces, over 3 s
        return got

    with pytest.raises(RequestTimeout):
        await slowly(timeout=1.0)
    assert await slowly(idle_timeout=2.0) > 4000000

    async def trickle() -> AsyncIterator[bytes]:
        with io.BytesIO() as buf:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                info = tarfile.TarInfo("slow.bin")
                info.size = 100000
                tar.addfile(info, io.BytesIO(bytes(100000)))
            data = buf.getvalue()
        for i in range(0, len(data), len(data) // 10 + 1):
            yield data[i : i + len(data) // 10 + 1]
            await asyncio.sleep(0.2)

    with pytest.raises(RequestTimeout):
        await sandbox.upload_archive("/workspace/idle", trickle(), timeout=1.0)
    done = await sandbox.upload_archive("/workspace/idle", trickle(), idle_timeout=2.0)
    assert done.files == 1 and done.bytes == 100000


async def test_fs_operations_with_etags(sandbox: AsyncSandbox) -> None:
    etag = await sandbox.write("src/app.py", "x = 1\ny = 2\n")
    read = await sandbox.read("/workspace/src/app.py", offset=1, limit=1)
    assert (read.content, read.total_lines, read.start_line) == ("y = 2\n", 2, 1)
    full = await sandbox.read("src/app.py")
    assert full.etag == etag
    assert (full.path, full.size) == ("/workspace/src/app.py", len("x = 1\ny = 2\n"))
    edited = await sandbox.edit("src/app.py", "x = 1", "x = 10", if_match=etag)
    assert isinstance(edited, EditResult)
    assert (edited.path, edited.occurrences) == ("/workspace/src/app.py", 1)
    assert edited.etag == (await sandbox.read("src/app.py")).etag != etag
    with pytest.raises(PreconditionFailed):
        await sandbox.write("src/app.py", "clobber", if_match=etag)  # the other party's change
    with pytest.raises(PreconditionFailed):
        await sandbox.write("src/app.py", "x", if_none_match="*")
    assert [e.path for e in await sandbox.glob("**/*.py")] == ["/workspace/src/app.py"]
    hits = await sandbox.grep("x = 10")
    assert [(m.path, m.line) for m in hits] == [("/workspace/src/app.py", 1)]
    raw = await sandbox.grep_raw("x = 10")
    assert raw == {
        "matches": [{"path": "/workspace/src/app.py", "line": 1, "text": hits[0].text}],
        "truncated": False,
    }
    stat = await sandbox.stat("src/app.py")
    assert isinstance(stat, FileStat) and stat.is_file and not stat.is_dir
    assert (stat.path, stat.type, stat.size) == ("/workspace/src/app.py", "file", 13)
    assert stat.etag == edited.etag and stat.mode & 0o600 == 0o600 and stat.modified_at
    folder = await sandbox.stat("/workspace/src")
    assert folder.is_dir and folder.type == "directory" and folder.etag is None
    await sandbox.run("ln -s app.py src/link.py")
    listed = {e.path: e for e in await sandbox.ls("src")}
    assert listed["/workspace/src/link.py"].is_symlink
    entry = listed["/workspace/src/app.py"]
    assert isinstance(entry, FileEntry) and entry.modified_at
    assert (entry.is_dir, entry.size, entry.is_symlink) == (False, 13, False)
    await sandbox.mkdir("docs/deep")
    await sandbox.move("src/app.py", "docs/deep/app.py")
    assert await sandbox.exists("docs/deep/app.py")
    assert not await sandbox.exists("src/app.py")
    await sandbox.delete("docs", recursive=True)
    assert not await sandbox.exists("docs")
    with pytest.raises(SandlotError):
        await sandbox.edit("missing.py", "a", "b")


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_events(sandbox: AsyncSandbox, transport: str) -> None:
    await sandbox.write("ev.txt", "1")
    await sandbox.exec("true")
    seen = []
    async with sandbox.events(after=0, transport=transport, timeout=10) as events:
        async for event in events:
            seen.append(event)
            if event.kind == "exec" and event.event_type == "exec.exited":
                break
    assert [e.sequence for e in seen] == sorted({e.sequence for e in seen})
    fs = [e for e in seen if e.kind == "fs"]
    assert any(e.details["fs"]["path"] == "/workspace/ev.txt" for e in fs)
    assert all(e.actor and e.actor["type"] == "human" for e in seen if e.kind == "exec")
    # Resume strictly after a cursor.
    cursor = seen[-2].sequence
    async with sandbox.events(after=cursor, transport=transport, timeout=10) as events:
        nxt = await events.__anext__()
    assert nxt.sequence == seen[-1].sequence


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_event_stream_deadline_raises_timeout_error(
    sandbox: AsyncSandbox, transport: str
) -> None:
    # Nothing new after the cursor: the deadline ends the stream, no reconnection loop.
    async with sandbox.events(after=10**12, transport=transport, timeout=1.0) as events:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await events.__anext__()
    assert time.monotonic() - started < 2.5


async def test_bootstrap_grant(
    pair: tuple[AsyncSandlot, AsyncSandbox], server: SandlotServer, agent_key: str
) -> None:
    # What an agent finds in config["configurable"]["sandbox"]: the 2.1 answer itself.
    async with httpx.AsyncClient() as raw:
        resp = await raw.post(
            f"{server.url}/v1/sandbox/sessions",
            json={"thread_id": f"thr_{uuid.uuid4().hex[:8]}", "mode": "ensure"},
            headers={"Authorization": f"Bearer {agent_key}"},
        )
    resp.raise_for_status()
    config = {"configurable": {"sandbox": resp.json()}}
    async with AsyncSandbox.from_config(config) as boot:
        assert (await boot.run("echo boot")).stdout == "boot\n"
        assert boot.grant.capabilities and "exec" in boot.grant.capabilities
    grant = Grant.from_response(resp.json())
    assert grant.session_id == resp.json()["session_id"]
    # The 2.9 alias shape works too.
    alias = {"sandbox_id": grant.sandbox_id, "token": grant.token, "http_url": grant.http_base_url}
    async with AsyncSandbox(alias) as boot:
        assert (await boot.exec("echo alias")).stdout == "alias\n"


async def test_starting_sandbox_is_awaited_on_events(
    pair: tuple[AsyncSandlot, AsyncSandbox],
) -> None:
    # A suspended sandbox answers 423 SANDBOX_STARTING; the call waits on the event log
    # for the next activation (here: a resume a moment later) and then succeeds.
    client, sandbox = pair
    await sandbox.write("before.txt", "x")
    await client.suspend_sandbox(sandbox.id)
    with pytest.raises(SandboxStarting):
        await sandbox._http.json("GET", "/fs/stat", deadline=Deadline(5), params={"path": "."})

    async def resume_later() -> None:
        await asyncio.sleep(0.5)
        await client.resume_sandbox(sandbox.id)

    resumer = asyncio.create_task(resume_later())
    started = time.monotonic()
    result = await sandbox.exec("cat before.txt", timeout=20)
    await resumer
    assert result.stdout == "x"
    assert time.monotonic() - started >= 0.4


async def test_event_socket_drop_resumes_without_loss(
    sandbox: AsyncSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandlot.sdk import _aio

    sockets = []
    real_connect = _aio.ws_connect

    async def recording_connect(*args, **kwargs):  # type: ignore[no-untyped-def]
        ws = await real_connect(*args, **kwargs)
        sockets.append(ws)
        return ws

    monkeypatch.setattr(_aio, "ws_connect", recording_connect)
    for i in range(5):
        await sandbox.write(f"drop/{i}.txt", str(i))
    seen = []
    async with sandbox.events(after=0, transport="ws", timeout=10) as events:
        async for event in events:
            seen.append(event.sequence)
            if len(seen) == 2:
                sockets[-1].transport.abort()  # the network fails under the client
                for i in range(5, 8):
                    await sandbox.write(f"drop/{i}.txt", str(i))
            if event.kind == "fs" and event.details["fs"]["path"].endswith("drop/7.txt"):
                break
    assert len(sockets) >= 2
    assert seen == list(range(1, len(seen) + 1))  # contiguous: nothing lost or repeated


def test_a_grant_that_is_not_one_says_what_is_expected() -> None:
    with pytest.raises(TypeError, match="not str"):
        Grant.from_response("thr_1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a sandbox grant"):
        Grant.from_response({"token": "t"})


async def test_text_utf8_cannot_carry_is_an_invalid_request(sandbox: AsyncSandbox) -> None:
    # A lone surrogate (valid in a model's JSON) in a path or an id raised
    # UnicodeEncodeError out of the call: an MCP tool answered an internal error.
    lone = "/workspace/\ud800.txt"
    for call in (sandbox.read(lone), sandbox.ls(lone), sandbox.download(lone)):
        with pytest.raises(InvalidRequest, match="not valid UTF-8"):
            await call
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        await sandbox.get_exec("ex_\ud800")

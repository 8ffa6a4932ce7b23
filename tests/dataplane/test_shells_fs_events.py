"""Shared shells, filesystem operations, transfers and the event log."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import socket
import tarfile
import time
from typing import Any

import httpx
import pytest
import websockets

from tests.dataplane.conftest import Server


async def _recv(ws: Any, timeout: float = 10) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def _until(ws: Any, needle: str) -> str:
    out = ""
    while needle not in out:
        f = await _recv(ws)
        if f["type"] in ("stdout", "history"):
            out += f["data"]
    return out


@pytest.mark.engine
def test_driver_and_observer_see_identical_bytes(server: Server) -> None:
    async def run() -> None:
        drv_tok = server.token(caps=["shell"])
        obs_tok = server.token(caps=["shell_observe"], act={"type": "human", "id": "h"})
        url = server.ws_url("/shell/ws?session=main&cols=100&rows=30")
        async with websockets.connect(
            url, additional_headers={"Authorization": f"Bearer {drv_tok}"}
        ) as drv:
            s = await _recv(drv)
            assert s["type"] == "session" and s["name"] == "main"
            assert (await _recv(drv))["type"] == "history"
            async with websockets.connect(
                url + "&role=observer", additional_headers={"Authorization": f"Bearer {obs_tok}"}
            ) as obs:
                assert (await _recv(obs))["type"] == "session"
                hist = await _recv(obs)
                start = hist["offset"] + len(hist["data"].encode())
                await drv.send(
                    json.dumps({"type": "stdin", "data": "echo MARK$((6*7)); stty size\n"})
                )
                # Observers cannot type.
                await obs.send(json.dumps({"type": "stdin", "data": "echo nope\n"}))
                frames_d: list[dict[str, Any]] = []
                frames_o: list[dict[str, Any]] = []

                async def collect(ws: Any, sink: list[dict[str, Any]], refused: bool) -> None:
                    # Until the output is whole (and, for the observer, its stdin refused:
                    # the refusal may come after the driver's output, the two sockets'
                    # messages being handled in no set order).
                    text = ""
                    while "30 100" not in text or (
                        refused and not any(f["type"] == "error" for f in sink)
                    ):
                        f = await _recv(ws)
                        sink.append(f)
                        if f["type"] == "stdout":
                            text += f["data"]

                await asyncio.gather(collect(drv, frames_d, False), collect(obs, frames_o, True))
                errors = [f for f in frames_o if f["type"] == "error"]
                assert errors and errors[0]["code"] == "CAPABILITY_DENIED"

                def stream(frames: list[dict[str, Any]]) -> bytes:
                    out = b""
                    for f in frames:
                        if f["type"] == "stdout" and f["offset"] + len(f["data"].encode()) > start:
                            out += f["data"].encode()[max(0, start - f["offset"]) :]
                    return out

                a, b = stream(frames_d), stream(frames_o)
                n = min(len(a), len(b))
                assert n > 0 and a[:n] == b[:n] and b"MARK42" in a
                # Reattach by offset replays the same bytes.
                await obs.send(json.dumps({"type": "attach", "offset": start}))
                replay = await _until(obs, "30 100")
                assert "MARK42" in replay

    asyncio.run(run())
    r = httpx.get(server.url("/shells"), headers=server.headers())
    assert [s["name"] for s in r.json()["shells"]] == ["main"]
    assert httpx.delete(server.url("/shells/main"), headers=server.headers()).status_code == 204
    assert httpx.delete(server.url("/shells/main"), headers=server.headers()).status_code == 404


def test_slow_reader_does_not_stall_fast_one(tmp_path: Any) -> None:
    from tests.dataplane.conftest import start_server

    gen = start_server(tmp_path, shell_buffer_bytes=64 * 1024)
    server = next(gen)

    async def run() -> None:
        hdr = server.headers()
        url = server.ws_url("/shell/ws?session=flood&profile=sh")
        # Small receive buffer, no compression: the slow client's kernel must not
        # absorb the flood on its behalf.
        sk = socket.socket()
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sk.connect(("127.0.0.1", int(server.base.rsplit(":", 1)[1])))
        slow = await websockets.connect(
            url, additional_headers=hdr, max_queue=1, sock=sk, compression=None
        )
        await _recv(slow)
        await _recv(slow)
        slow.transport.pause_reading()
        async with websockets.connect(url, additional_headers=hdr) as fast:
            await _recv(fast)
            await _recv(fast)
            t0 = time.monotonic()
            await fast.send(
                json.dumps(
                    {
                        "type": "stdin",
                        "data": "head -c 6000000 /dev/zero | tr '\\0' y; echo; echo FLOO''DED\n",
                    }
                )
            )
            await _until(fast, "FLOODED\r\n")
            assert time.monotonic() - t0 < 15
        # The slow client resumes with an explicit gap; the server kept no queue for it.
        slow.transport.resume_reading()
        gaps: list[dict[str, Any]] = []
        text = ""
        while "FLOODED" not in text:
            f = await _recv(slow)
            if f["type"] == "gap":
                gaps.append(f)
            elif f["type"] == "stdout":
                text += f["data"]
        assert gaps and gaps[0]["stream"] == "stdout"
        slow.transport.abort()

    try:
        asyncio.run(run())
    finally:
        gen.close()


@pytest.mark.engine
def test_fs_operations(server: Server, client: httpx.Client) -> None:
    u = server.url
    w = client.put(u("/fs/write"), json={"path": "src/a.py", "content": "x = 1\ny = 2\nx = 3\n"})
    etag = w.json()["etag"]
    r = client.get(u("/fs/read"), params={"path": "src/a.py", "offset": 1, "limit": 1}).json()
    assert (
        r["content"] == "y = 2\n"
        and r["total_lines"] == 3
        and r["next_offset"] == 2
        and r["etag"] == etag
    )
    assert (
        client.put(
            u("/fs/write"), json={"path": "src/a.py", "content": "z", "if_none_match": "*"}
        ).status_code
        == 409
    )
    assert (
        client.put(
            u("/fs/write"), json={"path": "src/a.py", "content": "z", "if_match": "stale"}
        ).status_code
        == 409
    )
    e = client.post(
        u("/fs/edit"), json={"path": "src/a.py", "old_string": "x =", "new_string": "X ="}
    )
    assert e.status_code == 400 and e.json()["error"]["metadata"]["occurrences"] == 2
    e = client.post(
        u("/fs/edit"),
        json={
            "path": "src/a.py",
            "old_string": "x =",
            "new_string": "X =",
            "replace_all": True,
            "if_match": etag,
        },
    )
    assert e.json()["occurrences"] == 2
    assert (server.workspace / "src/a.py").read_text() == "X = 1\ny = 2\nX = 3\n"
    client.put(
        u("/fs/write"), json={"path": "bin.dat", "content": "AAEC/w==", "encoding": "base64"}
    )
    assert client.get(u("/fs/read"), params={"path": "bin.dat"}).json()["encoding"] == "base64"
    client.put(u("/fs/write"), json={"path": "src/deep/b.py", "content": "needle here\n"})
    client.put(u("/fs/write"), json={"path": ".hidden/c.py", "content": "needle\n"})
    client.put(u("/fs/write"), json={"path": "src/.d.py", "content": "needle\n"})
    g = client.post(u("/fs/glob"), json={"pattern": "*.py"}).json()
    assert [m["path"] for m in g["matches"]] == ["/workspace/src/a.py", "/workspace/src/deep/b.py"]
    g = client.post(u("/fs/glob"), json={"pattern": "src/*.py", "path": "/workspace"}).json()
    assert [m["path"] for m in g["matches"]] == ["/workspace/src/a.py"]
    g = client.post(u("/fs/glob"), json={"pattern": "/workspace/**/.*.py"}).json()
    assert [m["path"] for m in g["matches"]] == ["/workspace/src/.d.py"]
    gr = client.post(u("/fs/grep"), json={"pattern": "needle", "path": "/workspace/src"}).json()
    assert {(m["path"], m["line"]) for m in gr["matches"]} == {
        ("/workspace/src/deep/b.py", 1),
        ("/workspace/src/.d.py", 1),
    }
    gr = client.post(u("/fs/grep"), json={"pattern": "ne.dle", "path": "/workspace"}).json()
    assert gr["matches"] == []
    gr = client.post(
        u("/grep"),
        json={"pattern": "ne.dle", "regex": True, "glob": "*.py", "path": "/workspace/src/deep"},
    ).json()
    assert gr["matches"] == [{"path": "/workspace/src/deep/b.py", "line": 1, "text": "needle here"}]
    assert (
        client.post(u("/glob"), json={"pattern": "**/b.py"}).json()["matches"][0]["path"]
        == "/workspace/src/deep/b.py"
    )
    lst = client.get(u("/fs/list"), params={"path": "src"}).json()["entries"]
    assert {e["path"] for e in lst} == {
        "/workspace/src/a.py",
        "/workspace/src/deep",
        "/workspace/src/.d.py",
    }
    deep = client.get(u("/fs/list"), params={"path": "src", "depth": 3}).json()["entries"]
    assert "/workspace/src/deep/b.py" in {e["path"] for e in deep}
    st = client.get(u("/fs/stat"), params={"path": "src"}).json()
    assert st["type"] == "directory"
    assert client.post(u("/fs/mkdir"), json={"path": "new/dir"}).status_code == 201
    assert (
        client.post(u("/fs/move"), json={"src": "src/a.py", "dst": "new/dir/a.py"}).status_code
        == 200
    )
    assert (
        client.post(
            u("/fs/move"), json={"src": "bin.dat", "dst": "new/dir/a.py", "overwrite": False}
        ).status_code
        == 409
    )
    assert client.delete(u("/fs"), params={"path": "new"}).status_code == 200
    assert not (server.workspace / "new").exists()
    assert client.get(u("/fs/read"), params={"path": "nope"}).status_code == 404
    assert client.get(u("/fs/read"), params={"path": "/tmp/../etc/x"}).status_code == 404


@pytest.mark.engine
def test_transfers(server: Server, client: httpx.Client) -> None:
    u = server.url
    data = bytes(range(256)) * 4096
    r = client.post(u("/files/upload"), params={"path": "up/blob.bin"}, content=data)
    assert r.status_code == 201 and r.json()["size"] == len(data)
    r = client.post(u("/upload"), params={"path": "up/m.txt"}, files={"file": ("m.txt", b"multi")})
    assert r.status_code == 201 and (server.workspace / "up/m.txt").read_bytes() == b"multi"
    d = client.get(u("/files/download"), params={"path": "up/blob.bin"})
    assert d.content == data
    d = client.get(u("/download"), params={"path": "up/blob.bin"}, headers={"Range": "bytes=10-19"})
    assert (
        d.status_code == 206
        and d.content == data[10:20]
        and d.headers["content-range"] == f"bytes 10-19/{len(data)}"
    )
    h = client.head(u("/files/download"), params={"path": "up/blob.bin"})
    assert h.status_code == 200 and int(h.headers["content-length"]) == len(data)
    assert (
        client.get(
            u("/files/download"),
            params={"path": "up/blob.bin"},
            headers={"Range": "bytes=99999999-"},
        ).status_code
        == 416
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in (("a.txt", b"A"), ("d/b.txt", b"B")):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    (server.workspace / "sync").mkdir()
    (server.workspace / "sync/stale.txt").write_text("old")
    r = client.post(
        u("/files/archive"),
        params={"path": "sync", "delete_missing": "true"},
        content=buf.getvalue(),
    )
    assert r.status_code == 200, r.text
    assert r.json()["files"] == 2 and r.json()["deleted"] == 1
    assert (server.workspace / "sync/d/b.txt").read_bytes() == b"B"
    out = client.get(u("/files/archive"), params={"path": "sync"})
    with tarfile.open(fileobj=io.BytesIO(out.content)) as tar:
        names = tar.getnames()
    assert sorted(names) == ["a.txt", "d", "d/b.txt"]
    assert (
        client.post(u("/files/archive"), params={"path": "x"}, content=b"not a tar").status_code
        == 400
    )


@pytest.mark.engine
def test_events_sse_ws_and_retention(server: Server, client: httpx.Client) -> None:
    u = server.url
    client.put(u("/fs/write"), json={"path": "ev.txt", "content": "1"})
    client.post(u("/exec"), json={"command": "echo made-by-command > cmd.txt"})
    deadline = time.time() + 5
    events: list[dict[str, Any]] = []
    while time.time() < deadline:
        with client.stream("GET", u("/events"), params={"after": 0}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if events and events[-1]["sequence"] == server.last_sequence():
                    break
        if any(e["details"].get("fs", {}).get("path") == "/workspace/cmd.txt" for e in events):
            break
        time.sleep(0.1)
    kinds = [next(iter(e["details"])) for e in events]
    assert "fs" in kinds and "exec" in kinds
    api = [e for e in events if e["details"].get("fs", {}).get("path") == "/workspace/ev.txt"]
    assert len(api) == 1 and api[0]["actor"]["type"] == "agent"
    assert any(
        e["details"].get("fs", {}).get("path") == "/workspace/cmd.txt" and e["actor"] is None
        for e in events
    )
    seqs = [e["sequence"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    async def ws_run() -> None:
        async with websockets.connect(
            server.ws_url(f"/events/ws?after={seqs[-1]}"), additional_headers=server.headers()
        ) as ws:
            await asyncio.to_thread(client.post, u("/fs/mkdir"), json={"path": "evdir"})
            # Every event after the last one read, in order and without a gap, until the
            # directory's (the watcher may still report the command's file: its close
            # after writing is a modification of its own).
            expected = seqs[-1] + 1
            while True:
                e = await _recv(ws)
                assert e["sequence"] == expected, (e, expected)
                expected += 1
                if e["details"].get("fs", {}).get("path") == "/workspace/evdir":
                    break
            assert e["details"]["fs"]["op"] == "created"

    asyncio.run(ws_run())
    # Resuming with Last-Event-ID (what EventSource sends) skips what was seen.
    with client.stream("GET", u("/events"), headers={"Last-Event-ID": str(seqs[-1])}) as r:
        for line in r.iter_lines():
            if line.startswith("id: "):
                assert int(line[4:]) == seqs[-1] + 1
                break


def test_events_sse_says_when_its_backlog_is_through(server: Server, client: httpx.Client) -> None:
    """``: live`` follows what the log held when the stream opened, once, before the events
    that come after it; a stream with nothing to catch up says it at once."""
    u = server.url
    for i in range(3):
        client.put(u("/fs/write"), json={"path": f"held-{i}.txt", "content": "1"})
    head = server.last_sequence()
    seen: list[str] = []
    with client.stream("GET", u("/events"), params={"after": head - 2}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("id: ") or line == ": live":
                seen.append(line)
            if line == ": live":
                client.put(u("/fs/write"), json={"path": "after-live.txt", "content": "1"})
            elif seen.count(": live") and line.startswith("id: "):
                break
    # Everything the log held at the start, in order without a gap (and whatever the
    # workspace's watcher added while the stream caught up), then ": live" once, then
    # the next event.
    assert seen.count(": live") == 1, seen
    before, after = seen[: seen.index(": live")], seen[seen.index(": live") + 1 :]
    ids = [int(line[4:]) for line in before]
    assert ids[:2] == [head - 1, head] and ids == list(range(head - 1, head - 1 + len(ids))), seen
    assert after and int(after[0][4:]) == ids[-1] + 1, seen
    now = server.last_sequence()
    with client.stream("GET", u("/events"), params={"after": now}) as r:
        lines = r.iter_lines()
        assert [next(lines), next(lines), next(lines)] == [": connected", "", ": live"]


def test_sequence_expired(tmp_path: Any) -> None:
    from tests.dataplane.conftest import start_server

    gen = start_server(tmp_path, event_retention=3, watch_fs=False)
    server = next(gen)
    try:
        with httpx.Client(headers=server.headers()) as c:
            for i in range(6):
                c.post(server.url("/fs/mkdir"), json={"path": f"d{i}"})
            r = c.get(server.url("/events"), params={"after": 0})
            assert r.status_code == 410 and r.json()["error"]["code"] == "SEQUENCE_EXPIRED"
            # Where the client can carry on from.
            assert r.json()["error"]["metadata"] == {"oldest_sequence": 4}
            # The latest ``tail`` are what is kept when fewer are (it was a 410).
            with c.stream("GET", server.url("/events"), params={"tail": 100}) as stream:
                assert stream.status_code == 200
                ids = []
                for line in stream.iter_lines():
                    if line.startswith("id: "):
                        ids.append(int(line[4:]))
                    if line == ": live":
                        break
            assert ids == [4, 5, 6]
    finally:
        gen.close()


@pytest.mark.local_only("counts the in-process event loop's tasks")
def test_dropped_event_streams_leave_no_task_behind(
    server: Server, client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that leaves an idle SSE stream ends the stream's waits too (they leaked, and
    their collection logged an error each: enough of them filled a piped stderr)."""

    def waits() -> list[str]:
        tasks = server.call(asyncio.all_tasks)
        return [repr(t) for t in tasks if "Event.wait" in repr(t.get_coro())]

    before = len(waits())
    for _ in range(5):
        after = server.call(lambda: server.host.status(server.sandbox_id)[1])
        with client.stream("GET", server.url("/events"), params={"after": after}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # ": connected", then the stream waits for events
    deadline = time.monotonic() + 10
    while server.call(lambda: len(server.host.entry(server.sandbox_id).connections)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert len(waits()) == before, waits()
    gc.collect()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


def _fs_events(server: Server, client: httpx.Client, after: int, until: Any) -> list[Any]:
    """The ``fs`` events after ``after``, read until ``until(events)`` holds (at most 10 s)."""
    deadline = time.time() + 10
    events: list[dict[str, Any]] = []
    while time.time() < deadline:
        head = server.last_sequence()
        events = []
        if head > after:
            with client.stream("GET", server.url("/events"), params={"after": after}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        if events[-1]["sequence"] >= head:
                            break
        fs = [e["details"]["fs"] for e in events if "fs" in e["details"]]
        if until(fs):
            return fs
        time.sleep(0.1)
    return fs


def test_archive_is_one_event_and_its_new_directories_are_watched(
    server: Server, client: httpx.Client
) -> None:
    u = server.url
    start = server.last_sequence()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(300):
            info = tarfile.TarInfo(f"d{i % 7}/f{i}.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    r = client.post(u("/files/archive"), params={"path": "arch"}, content=buf.getvalue())
    assert r.status_code == 200, r.text
    # Past the window in which the archive hides the watcher's reports under it.
    time.sleep(3.5)
    client.post(u("/exec"), json={"command": "echo later > arch/d3/by-command.txt"})
    fs = _fs_events(
        server, client, start, lambda fs: any(f["path"].endswith("by-command.txt") for f in fs)
    )
    under = [f for f in fs if f["path"].startswith("/workspace/arch")]
    # The archive itself is one event from the API; the only report of the watcher under
    # it is the command's file, in a directory the archive created.
    assert [f["source"] for f in under] == ["api", "watch"], under
    assert under[1]["path"] == "/workspace/arch/d3/by-command.txt"

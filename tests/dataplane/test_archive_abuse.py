"""Archives and tree walks against a client that holds a valid token and means harm:
long names, deep trees, links, FIFOs swapped in mid-walk, stalled uploads."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import resource
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.dataplane.services.fsops import FileOps
from sandlot.dataplane.services.treewalk import remove_tree
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from tests.dataplane.conftest import RootedRuntime, Server, start_server

#: An operation that must complete gets this long (a hang fails it, nothing else is timed).
DEADLINE = 30.0


def tar_of(*members: tuple[str, str, bytes | str]) -> bytes:
    """``(name, kind, data or link target)`` members as a PAX tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "link":
                info.type = tarfile.SYMTYPE
                info.linkname = str(payload)
                tar.addfile(info)
            else:
                data = payload if isinstance(payload, bytes) else payload.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def run(client: httpx.Client, server: Server, command: str) -> None:
    r = client.post(
        server.url("/exec"), json={"command": command, "cwd": "/workspace"}, timeout=DEADLINE
    )
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text


def members(body: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        return {m.name: m for m in tar.getmembers()}


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Server]:
    gen = start_server(tmp_path)
    try:
        yield next(gen)
    finally:
        gen.close()


# --- names --------------------------------------------------------------------------


def test_member_names_are_held_to_the_path_rules(server: Server, client: httpx.Client) -> None:
    for name, why in (
        ("a/" * 2100 + "f", "too long"),  # 4,201 bytes
        ("d/" + "n" * 256, "too long"),
    ):
        r = client.post(
            server.url("/files/archive"), params={"path": "names"}, content=tar_of((name, "f", "x"))
        )
        assert r.status_code == 400, r.text
        assert why in r.json()["error"]["message"]
    # The longest names allowed still go in.
    name = "/".join(["n" * 255] * 15 + ["f" * 200])
    r = client.post(
        server.url("/files/archive"), params={"path": "names"}, content=tar_of((name, "f", "ok"))
    )
    assert r.status_code == 200, r.text


@pytest.mark.local_only
def test_a_long_member_name_costs_no_memory(local: Server) -> None:
    # Every ancestor of a member's name was recorded before its length was checked: a
    # 32 KiB name of one-letter directories took 256 MiB (a 1 MiB one, all of memory).
    name = "a/" * (16 * 1024) + "f"
    body = tar_of((name, "f", "x"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with httpx.Client(headers=local.headers(), timeout=DEADLINE) as c:
        r = c.post(local.url("/files/archive"), params={"path": "x"}, content=body)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.status_code == 400 and "too long" in r.json()["error"]["message"], r.text
    assert grown_mib < 64, f"the server grew by {grown_mib:.0f} MiB for one name"


# --- links --------------------------------------------------------------------------


def test_chained_links_put_nothing_outside_the_tree(server: Server, client: httpx.Client) -> None:
    # d/up -> .. is the target itself, and d/up/z -> .. looks one level down by its name:
    # it lands in the target and points above it, so d/up/z/evil.txt went there.
    body = tar_of(
        ("d", "dir", ""),
        ("d/up", "link", ".."),
        ("d/up/z", "link", ".."),
        ("d/up/z/evil.txt", "f", "pwned"),
    )
    r = client.post(server.url("/files/archive"), params={"path": "x"}, content=body)
    assert r.status_code == 400, r.text
    assert not (server.workspace / "evil.txt").exists()
    assert not (server.workspace / "x" / "z").is_symlink()
    # The same through a link that was there before the archive.
    run(client, server, "mkdir -p y/d && ln -s .. y/d/up")
    body = tar_of(("d/up/evil2.txt", "f", "pwned"))
    r = client.post(server.url("/files/archive"), params={"path": "y"}, content=body)
    assert r.status_code == 400, r.text
    assert not (server.workspace / "y" / "evil2.txt").exists()
    # A link's target may not climb out through another link either.
    body = tar_of(("d", "dir", ""), ("d/up", "link", ".."), ("e", "link", "d/up/.."))
    r = client.post(server.url("/files/archive"), params={"path": "w"}, content=body)
    assert r.status_code == 400, r.text
    # Links inside the tree are kept, and the base may itself be reached through one.
    run(client, server, "mkdir real && ln -s real via")
    body = tar_of(("d", "dir", ""), ("d/f", "f", "1"), ("d/l", "link", "../d/f"))
    r = client.post(server.url("/files/archive"), params={"path": "via"}, content=body)
    assert r.status_code == 200, r.text
    assert os.readlink(server.workspace / "real" / "d" / "l") == "../d/f"


def test_archive_download_keeps_links_as_links(server: Server, client: httpx.Client) -> None:
    # A link to a directory that exists only in the server's view of the files came out
    # as a directory (telling which host directories exist); now every link is a link.
    run(
        client,
        server,
        "mkdir t && ln -s /etc t/etc && ln -s /no/such/dir t/nowhere && ln -s /workspace t/ws",
    )
    r = client.get(server.url("/files/archive"), params={"path": "t"}, timeout=DEADLINE)
    assert r.status_code == 200
    found = members(r.content)
    for name, target in (("etc", "/etc"), ("nowhere", "/no/such/dir"), ("ws", "/workspace")):
        assert found[name].issym() and found[name].linkname == target, name


def test_delete_missing_removes_a_link_to_a_directory(server: Server, client: httpx.Client) -> None:
    run(client, server, "mkdir -p d/real/in && ln -s real d/link && touch d/real/in/f")
    body = tar_of(("real", "dir", ""), ("real/g", "f", "1"))
    r = client.post(
        server.url("/files/archive"),
        params={"path": "d", "delete_missing": "true"},
        content=body,
    )
    assert r.status_code == 200, r.text
    assert sorted(os.listdir(server.workspace / "d")) == ["real"]
    assert sorted(os.listdir(server.workspace / "d" / "real")) == ["g"]
    assert r.json()["deleted"] == 2


# --- walks --------------------------------------------------------------------------


def test_a_directory_swapped_for_a_fifo_does_not_hang_a_download(
    server: Server, client: httpx.Client
) -> None:
    # The walk opened a subdirectory it had listed with a plain open(): a FIFO put in its
    # place meanwhile held the download, and its thread, for good.
    run(client, server, "mkdir -p t/sub && head -c 40000000 /dev/zero > t/big")
    timeout = httpx.Timeout(DEADLINE)
    with (
        httpx.Client(headers=server.headers(), timeout=timeout) as c,
        c.stream("GET", server.url("/files/archive"), params={"path": "t"}) as resp,
    ):
        chunks = resp.iter_raw(65536)
        got = [next(chunks)]  # the writer now waits for this client, mid-walk
        run(client, server, "mv t/sub t/sub.old && mkfifo t/sub")
        got.extend(chunks)
    # Whole, with sub as whatever it was when the walk came to it.
    assert members(b"".join(got))["big"].size == 40_000_000
    # Nothing of the sandbox is held up afterwards.
    r = client.put(server.url("/fs/write"), json={"path": "w.txt", "content": "x"})
    assert r.status_code in (200, 201)
    r = client.delete(server.url("/fs"), params={"path": "t", "recursive": "true"})
    assert r.status_code == 200, r.text


DEEP = 1500
MAKE_DEEP = (
    "python3 -c \"import os\nos.mkdir('{0}'); os.chdir('{0}')\n"
    "for _ in range({1}): os.mkdir('d'); os.chdir('d')\nopen('f', 'w').write('end')\""
)


@pytest.fixture
def deep_trees(server: Server) -> Iterator[None]:
    yield
    # Left behind by a failure, such a tree would fail pytest's own clean-up (it recurses).
    for name in ("deep", "deep2"):
        with contextlib.suppress(OSError):
            remove_tree(os.open(server.workspace, os.O_RDONLY), name)


@pytest.mark.usefixtures("deep_trees")
def test_deep_trees_are_walked_whole(server: Server, client: httpx.Client) -> None:
    # Deeper than Python's recursion limit: shutil.rmtree and os.fwalk failed there
    # (500s, and a 200 whose tar stopped short).
    # Both made at once: the workspace watcher's work for a deep tree made, then removed,
    # held a second command's answer in the container past the deadline.
    run(client, server, f"{MAKE_DEEP.format('deep', DEEP)} && {MAKE_DEEP.format('deep2', DEEP)}")
    r = client.get(server.url("/files/archive"), params={"path": "deep"}, timeout=DEADLINE)
    assert r.status_code == 200
    found = members(r.content)
    assert len(found) == DEEP + 1
    assert found["d/" * DEEP + "f"].size == 3
    r = client.post(
        server.url("/files/archive"),
        params={"path": "deep", "delete_missing": "true"},
        content=tar_of(("x", "f", "1")),
        timeout=DEADLINE,
    )
    assert r.status_code == 200, r.text
    assert r.json()["deleted"] == 1
    assert os.listdir(server.workspace / "deep") == ["x"]
    r = client.delete(
        server.url("/fs"), params={"path": "deep2", "recursive": "true"}, timeout=DEADLINE
    )
    assert r.status_code == 200, r.text
    assert not (server.workspace / "deep2").exists()


@pytest.mark.local_only
def test_a_failed_walk_ends_the_download_as_an_error(
    local: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tar cut short must not look like a whole one: the body ends without its end.
    (local.workspace / "t" / "sub").mkdir(parents=True)
    (local.workspace / "t" / "f").write_bytes(b"x" * 1000)
    (local.workspace / "t" / "sub" / "g").write_bytes(b"y" * 1000)
    listings = []
    scandir = os.scandir

    def failing(path: Any = ".") -> Any:
        # The archive's walk only (in its pool's threads), not the workspace watcher's.
        walking = threading.current_thread().name.startswith("sandlot-archive")
        if isinstance(path, int) and walking:
            listings.append(path)
            if len(listings) > 1:
                raise OSError(5, "Input/output error")
        return scandir(path)

    monkeypatch.setattr(os, "scandir", failing)
    with (
        httpx.Client(headers=local.headers(), timeout=DEADLINE) as c,
        pytest.raises(httpx.RemoteProtocolError),
    ):
        c.get(local.url("/files/archive"), params={"path": "t"})


# --- stalled uploads ----------------------------------------------------------------


def _stalled_uploads(srv: Server, n: int) -> list[socket.socket]:
    host, port = srv.base.split("//")[1].split(":")
    part = tar_of(("big", "f", b"x" * 100_000))[:2048]
    socks = []
    for i in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(
            (
                f"POST /{srv.sandbox_id}/v1/files/archive?path=/workspace/s{i} HTTP/1.1\r\n"
                f"Host: x\r\nAuthorization: Bearer {srv.token()}\r\n"
                "Content-Type: application/x-tar\r\nContent-Length: 10000000\r\n\r\n"
            ).encode()
            + part
        )
        socks.append(s)
    return socks


@pytest.mark.local_only
def test_stalled_uploads_of_one_sandbox_leave_others_alone(local: Server) -> None:
    # Archive transfers ran on the process's default pool (as many threads as cores + 4):
    # that many uploads that stop sending held every one, for every sandbox.
    root2 = local.root.parent / "root2"
    (root2 / "workspace").mkdir(parents=True)
    (root2 / "tmp").mkdir()
    (root2 / "workspace" / "f").write_text("other")
    template = Template(name="default", image="host", shells={"default": ["/bin/sh"]})
    runtime = RootedRuntime("sb_two", 1, template, root2 / "workspace", tmp=root2 / "tmp")
    local.call(local.host.register, "sb_two", 1, SandboxState.ACTIVE, runtime)
    socks = _stalled_uploads(local, min(32, (os.cpu_count() or 1) + 4) + 2)
    try:
        other = {"Authorization": "Bearer " + local.keys.token("sb_two")}
        with httpx.Client(headers=other, timeout=DEADLINE) as c:
            r = c.get(local.url("/files/archive", "sb_two"), params={"path": "/workspace"})
            assert r.status_code == 200 and "f" in members(r.content)
            r = c.post(
                local.url("/files/archive", "sb_two"),
                params={"path": "/workspace/o"},
                content=tar_of(("g", "f", "1")),
            )
            assert r.status_code == 200, r.text
        # The stalled sandbox itself is told to come back later, at once.
        with httpx.Client(headers=local.headers(), timeout=DEADLINE) as c:
            r = c.get(local.url("/files/archive"), params={"path": "/workspace"})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "RATE_LIMITED" and r.headers["Retry-After"]
            # Other file operations of that sandbox go on.
            r = c.put(local.url("/fs/write"), json={"path": "w.txt", "content": "x"})
            assert r.status_code == 201, r.text
    finally:
        for s in socks:
            s.close()
    # The uploads' workers end with their requests: the sandbox's places come back.
    with httpx.Client(headers=local.headers(), timeout=DEADLINE) as c:
        for _ in range(int(DEADLINE * 10)):
            r = c.get(local.url("/files/archive"), params={"path": "/workspace"})
            if r.status_code != 429:
                break
            threading.Event().wait(0.1)
        assert r.status_code == 200, r.text


# --- reads --------------------------------------------------------------------------


@pytest.mark.local_only
def test_a_large_json_read_runs_off_the_event_loop(
    local: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    (local.workspace / "big.bin").write_bytes(os.urandom(4 << 20))
    (local.workspace / "small.txt").write_text("hello\n")
    loop_thread = local.call(threading.get_ident)
    threads: dict[str, int] = {}
    read = FileOps.read

    def spy(self: FileOps, path: str, offset: int, limit: int) -> Any:
        threads[path] = threading.get_ident()
        return read(self, path, offset, limit)

    monkeypatch.setattr(FileOps, "read", spy)
    with httpx.Client(headers=local.headers(), timeout=DEADLINE) as c:
        for name in ("big.bin", "small.txt"):
            r = c.get(local.url("/fs/read"), params={"path": name})
            assert r.status_code == 200, r.text
    assert threads["big.bin"] != loop_thread
    assert threads["small.txt"] == loop_thread  # a small read stays inline


# --- ranges -------------------------------------------------------------------------


def test_ranges_are_read_strictly(server: Server, client: httpx.Client) -> None:
    (server.workspace / "empty").write_bytes(b"")
    (server.workspace / "ten").write_bytes(b"0123456789")
    u = server.url("/files/download")
    r = client.get(u, params={"path": "empty"}, headers={"Range": "bytes=-1"})
    assert r.status_code == 416 and r.headers["content-range"] == "bytes */0"
    r = client.head(u, params={"path": "empty"}, headers={"Range": "bytes=-1"})
    assert r.status_code == 416
    for bad in ("bytes=1_0-", "bytes=+1-2", "bytes=1-_2", "bytes=-_3"):
        r = client.get(u, params={"path": "ten"}, headers={"Range": bad})
        assert r.status_code == 400, (bad, r.status_code)
    r = client.get(u, params={"path": "ten"}, headers={"Range": "bytes=-3"})
    assert r.status_code == 206 and r.content == b"789"
    r = client.get(u, params={"path": "ten"}, headers={"Range": "bytes=8-"})
    assert r.status_code == 206 and r.content == b"89"


# --- an archive that ends early deletes nothing ---------------------------------------------


def _unmarked(body: bytes) -> bytes:
    """``body`` (an uncompressed tar) cut right after its last member: whole members, no
    end-of-archive marker."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        last = tar.getmembers()[-1]
    return body[: last.offset_data + -(-last.size // 512) * 512]


def test_an_archive_without_its_end_marker_deletes_nothing(
    server: Server, client: httpx.Client
) -> None:
    run(client, server, "mkdir -p dm && echo keep > dm/kept && echo old > dm/a")
    body = tar_of(("a", "f", b"new"), ("b", "f", b"b"))
    cut = _unmarked(body)
    assert list(members(cut)) == ["a", "b"]
    url = server.url("/files/archive")
    r = client.post(url, params={"path": "/workspace/dm", "delete_missing": "true"}, content=cut)
    assert r.status_code == 400 and "end-of-archive" in r.json()["error"]["message"], r.text
    assert (server.workspace / "dm" / "kept").read_text() == "keep\n"
    # Without deletions, whole members are all an extraction needs.
    r = client.post(url, params={"path": "/workspace/dm"}, content=cut)
    assert r.status_code == 200, r.text
    assert (server.workspace / "dm" / "a").read_text() == "new"
    r = client.post(url, params={"path": "/workspace/dm", "delete_missing": "true"}, content=body)
    assert r.status_code == 200 and r.json()["deleted"] == 1, r.text
    assert not (server.workspace / "dm" / "kept").exists()


def test_an_upload_cut_off_deletes_nothing(server: Server, client: httpx.Client) -> None:
    """A client that leaves mid-upload, at a member boundary: the archive's request ended,
    which the extraction never takes for the archive's end."""
    run(client, server, "mkdir -p cut && echo keep > cut/kept")
    body = _unmarked(tar_of(*((f"f{i}", "f", b"x" * 600) for i in range(64))))
    url = httpx.URL(server.url("/files/archive"))
    head = (
        f"POST {url.raw_path.decode()}?path=/workspace/cut&delete_missing=true "
        f"HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token()}\r\n"
        "Content-Type: application/x-tar\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port or 80)) as s:
        s.sendall(head + b"%x\r\n%s\r\n" % (len(body), body))
        deadline = time.monotonic() + DEADLINE
        while not (server.workspace / "cut" / "f63").exists():  # every member written
            assert time.monotonic() < deadline, "the members never arrived"
            time.sleep(0.05)
    # The connection is gone without the body's last chunk. The upload ends as an error;
    # a later one is served (the transfer's place freed), and nothing was deleted.
    deadline = time.monotonic() + DEADLINE
    while True:
        r = client.post(
            server.url("/files/archive"),
            params={"path": "/workspace/other"},
            content=tar_of(("x", "f", b"x")),
        )
        if r.status_code == 200:
            break
        assert r.status_code == 429 and time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert (server.workspace / "cut" / "kept").read_text() == "keep\n"


def test_a_refused_target_path_leaves_no_extraction_behind(
    server: Server, client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    # Refused once the extraction had started: its error was never read ("Future
    # exception was never retrieved" in the log).
    for _ in range(3):
        r = client.post(
            server.url("/files/archive"), params={"path": "a\x00b"}, content=tar_of(("f", "f", "x"))
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST", r.text
    gc.collect()
    assert "never retrieved" not in caplog.text

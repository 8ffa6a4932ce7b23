"""``/fs/grep`` reports each file under its own name, whichever search answers (in
process or ripgrep): a newline in a name, bytes that are not UTF-8. A directory the
sandbox user cannot enter is refused alike by both searches, as any file operation
refuses it (403)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.dataplane.services import grep as grep_mod
from sandlot.runtime.tools import host_ripgrep
from sandlot.sdk import Sandlot
from tests.dataplane.conftest import Server, start_server
from tests.servers import SandlotServer, isolation_mode

NOBODY = (65534, 65534)

#: The file that holds the secret, its name read up to the newline, and one not UTF-8.
NEWLINE = b"notes\nXconfig.py"
DECOY = b"config.py"
LATIN1 = b"caf\xe9.py"

#: A literal search (in process), a regex and a case-insensitive one (both by ripgrep).
SEARCHES = [
    {"pattern": "API_KEY"},
    {"pattern": "API_KEY", "regex": True},
    {"pattern": "api_key", "ignore_case": True},
]


def _make(workspace: Path, files: dict[bytes, bytes]) -> None:
    """``files`` in the workspace's ``gn`` directory, by their names as bytes."""
    top = os.path.join(os.fsencode(workspace), b"gn")
    os.makedirs(top, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(top, name), "wb") as f:
            f.write(data)


def _grep(server: Server, client: httpx.Client, **body: Any) -> list[tuple[str, int, str]]:
    resp = client.post(server.url("/fs/grep"), json=body)
    assert resp.status_code == 200, resp.text
    return sorted((m["path"], m["line"], m["text"]) for m in resp.json()["matches"])


@pytest.mark.parametrize("search", SEARCHES, ids=["literal", "regex", "ignore_case"])
def test_names_with_a_newline_or_not_utf8_are_reported_exactly(
    server: Server, client: httpx.Client, search: dict[str, Any]
) -> None:
    _make(
        server.workspace,
        {DECOY: b"harmless\n", NEWLINE: b'API_KEY = "secret"\n', LATIN1: b"API_KEY = 2\n"},
    )
    listed = client.get(server.url("/fs/list"), params={"path": "/workspace/gn"}).json()
    names = {e["path"] for e in listed["entries"]}
    # Named as /fs/list names them: the newline kept, a byte not UTF-8 as \udcXX.
    secret, latin1 = "/workspace/gn/notes\nXconfig.py", "/workspace/gn/caf\udce9.py"
    assert {secret, latin1} <= names
    found = _grep(server, client, path="/workspace/gn", **search)
    assert found == [
        (latin1, 1, "API_KEY = 2"),
        (secret, 1, 'API_KEY = "secret"'),
    ]
    # The file searched by its own name.
    alone = _grep(server, client, path=secret, **search)
    assert alone == [(secret, 1, 'API_KEY = "secret"')]


def test_a_binary_note_does_not_swallow_the_next_name(server: Server, client: httpx.Client) -> None:
    """ripgrep notes, without a NUL, that it stopped reading a binary file after a match:
    the note is not read as the start of the next file's name."""
    late = b"API_KEY first\n" + b"y" * 200_000 + b"\n\x00API_KEY after\n"
    files = {b"late.bin": late, NEWLINE: b"API_KEY\n"}
    files |= {f"n{i}\n{i}.py".encode(): b"API_KEY\n" for i in range(20)}
    _make(server.workspace, files)
    found = _grep(server, client, pattern="API_KEY", regex=True, path="/workspace/gn")
    expected = [("/workspace/gn/late.bin", 1, "API_KEY first")]
    expected += [
        (f"/workspace/gn/{os.fsdecode(n)}", 1, "API_KEY") for n in files if n != b"late.bin"
    ]
    assert found == sorted(expected)


@pytest.mark.local_only("runs the host's ripgrep directly")
def test_output_cut_anywhere_parses_the_same(tmp_path: Path) -> None:
    """ripgrep's output read a byte at a time gives the same matches as read at once."""
    rg = host_ripgrep()
    assert rg is not None
    _make(tmp_path, {NEWLINE: b"API_KEY\n", LATIN1: b"x\nAPI_KEY\n", b"late.bin": b"API_KEY\n"})
    late = b"API_KEY\n" + b"y" * 200_000 + b"\n\x00"
    (tmp_path / "gn" / "late.bin").write_bytes(late)
    out = subprocess.run(
        [rg, *grep_mod._RG_OPTIONS, "-e", "API_KEY", "--", "."],
        cwd=tmp_path / "gn",
        capture_output=True,
        check=True,
    ).stdout
    assert b"WARNING" in out  # the note is there to be skipped

    def parse(chunks: Iterator[bytes]) -> list[dict[str, Any]]:
        target = grep_mod._Target(-1, "/workspace/gn", ".", "/workspace/gn", True)
        parsed = grep_mod._Output(target, 100)
        for chunk in chunks:
            parsed.feed(chunk)
        assert not parsed.truncated
        return sorted(parsed.matches, key=lambda m: m["path"])

    whole = parse(iter([out]))
    assert [m["path"] for m in whole] == [
        "/workspace/gn/caf\udce9.py",
        "/workspace/gn/late.bin",
        "/workspace/gn/notes\nXconfig.py",
    ]
    assert parse(out[i : i + 1] for i in range(len(out))) == whole


LOCKED = {"pattern": "needle", "path": "/workspace/locked"}


def _refusal(resp: httpx.Response) -> tuple[int, str | None, bool | None]:
    """Status, error code and whether it is retryable."""
    error = resp.json().get("error") or {}
    return resp.status_code, error.get("code"), error.get("retryable")


@pytest.fixture
def confined(tmp_path: Path) -> Iterator[Server]:
    """A dataplane whose file operations and ripgrep act as ``nobody``."""
    if os.geteuid() != 0:
        pytest.skip("acting as another uid needs root (CI runs as root)")
    gen = start_server(tmp_path, fs_ids=NOBODY)
    try:
        yield next(gen)
    finally:
        gen.close()


@pytest.mark.parametrize("mode", [0o444, 0o000], ids=["0444", "0000"])
def test_a_directory_the_user_cannot_enter_is_a_403_for_both_searches(
    confined: Server, mode: int
) -> None:
    locked = confined.workspace / "locked"
    locked.mkdir()
    (locked / "a").write_text("needle\n")
    os.chown(locked, *NOBODY)
    locked.chmod(mode)
    with httpx.Client(headers=confined.headers(), timeout=20) as client:
        answers = [
            _refusal(client.post(confined.url("/fs/grep"), json={**search, **LOCKED}))
            for search in SEARCHES
        ]
    assert answers == [(403, "PERMISSION_DENIED", False)] * len(SEARCHES)


@pytest.mark.timeout(180)
@pytest.mark.skipif(isolation_mode() != "isolated", reason="needs an isolated sandbox (root)")
def test_an_isolated_sandbox_refuses_a_directory_it_cannot_enter(tmp_path: Path) -> None:
    """ripgrep starts in the sandbox as its user: it cannot start in such a directory,
    which is the user's 403, not the provider's 503."""
    server = SandlotServer(tmp_path / "d").start()
    try:
        with Sandlot(server.url, server.key("alice"), timeout=60) as sdk:
            sandbox = sdk.ensure(f"thr_{uuid.uuid4().hex[:10]}")
            sandbox.run("mkdir -p locked && echo needle > locked/a && chmod 0444 locked")
            url = f"{sandbox.grant.http_base_url}/fs/grep"
            headers = {"Authorization": f"Bearer {sandbox.grant.token}"}
            answers = [
                _refusal(httpx.post(url, json={**search, **LOCKED}, headers=headers, timeout=30))
                for search in SEARCHES
            ]
        assert answers == [(403, "PERMISSION_DENIED", False)] * len(SEARCHES)
    finally:
        server.stop()
        server.cleanup()

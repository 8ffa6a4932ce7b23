"""``sandlot pull`` and ``sandlot sync`` against a real server, with a sandbox whose
contents an agent wrote to harm the human's machine, and local trees that are awkward."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import SandlotServer, running

SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]
THREAD = "thr_hostile"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("clisync") / "d") as srv:
        yield srv


def sandlot(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SANDLOT, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def agent(env: dict[str, str], script: str) -> str:
    """Run ``script`` in the sandbox (as the agent would); its stdout."""
    r = sandlot(env, "exec", THREAD, "--", script)
    assert r.returncode == 0, r.stderr
    return r.stdout


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_pull_writes_nothing_inside_git_nor_the_manifest(
    env: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "repo"
    local.mkdir()
    subprocess.run(["git", "init", "-q", str(local)], check=True)
    pwned = tmp_path / "PWNED"
    agent(
        env,
        "set -e; cd /workspace && mkdir -p g && cd g"
        " && mkdir -p .git/evil/objects .git/evil/refs sub/.git .GIT"
        " && echo 'ref: refs/heads/main' > .git/evil/HEAD"
        f" && printf '[core]\\n\\tfsmonitor = \"touch {pwned}; false\"\\n' > .git/evil/config"
        " && echo evil > .git/commondir && cp .git/evil/config sub/.git/config"
        " && cp .git/evil/config .GIT/config && echo '{\"files\": {}}' > .sandlot-sync.json"
        " && echo ok > ok.txt",
    )
    r = sandlot(env, "pull", f"{THREAD}:/workspace/g", str(local))
    assert r.returncode == 0, r.stderr
    assert (local / "ok.txt").read_text() == "ok\n"
    for rel in (".git/evil", ".git/commondir", "sub/.git", ".GIT"):
        assert not (local / rel).exists(), rel
    # The first five names the archive held (in the sandbox's directory order), then a count.
    said = " ".join(r.stderr.split())
    assert "skipped 6 files" in said and "and 1 more" in said, said
    skipped = {".sandlot-sync.json", ".GIT/config", "sub/.git/config", ".git/evil/config",
               ".git/evil/HEAD", ".git/commondir"}  # fmt: skip
    assert sum(name in said for name in skipped) == 5, said
    manifest = json.loads((local / ".sandlot-sync.json").read_text())
    assert set(manifest["files"]) == {"ok.txt"}
    subprocess.run(["git", "-C", str(local), "status"], capture_output=True, timeout=30)
    assert not pwned.exists()


def test_pull_follows_no_local_symlink(env: dict[str, str], tmp_path: Path) -> None:
    local, outside = tmp_path / "local", tmp_path / "outside"
    local.mkdir()
    outside.mkdir()
    (outside / "target").write_text("orig\n")
    (local / "data").symlink_to(outside)
    (local / "c.txt").write_text("local\n")
    (local / "c.txt.sandlot-remote").symlink_to(outside / "target")
    agent(
        env,
        "set -e; mkdir -p /workspace/s/data && cd /workspace/s"
        " && echo key > data/authorized_keys && echo remote > c.txt",
    )
    r = sandlot(env, "pull", f"{THREAD}:/workspace/s", str(local))
    assert r.returncode == 1 and "conflict" in r.stderr, r.stderr
    assert sorted(os.listdir(outside)) == ["target"]
    assert (outside / "target").read_text() == "orig\n"
    side = local / "c.txt.sandlot-remote"
    assert not side.is_symlink() and side.read_text() == "remote\n"
    assert (local / "c.txt").read_text() == "local\n"
    assert "data/authorized_keys" in r.stderr and "symlink" in r.stderr, r.stderr


def test_pull_streams_and_stops_at_max_bytes_leaving_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "a.txt").write_text("keep\n")
    agent(
        env,
        "set -e; mkdir -p /workspace/big/d && cd /workspace/big"
        " && echo small > a0.txt && echo small > d/b.txt && truncate -s 300M d/sparse",
    )
    r = sandlot(env, "pull", "--max-bytes", "100000000", f"{THREAD}:/workspace/big", str(local))
    assert r.returncode == 1 and "--max-bytes" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert listing(local) == {"a.txt"}
    # Whole, the pull holds no copy of the archive: its memory stays far below the file.
    measure = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True);"
        " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    r = subprocess.run(
        [sys.executable, "-c", measure, *SANDLOT, "pull", f"{THREAD}:/workspace/big", str(local)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) < 200 * 1024, f"{r.stdout} KiB"  # the file is 300 MiB
    assert (local / "d" / "sparse").stat().st_size == 300 << 20
    assert listing(local) == {"a.txt", "a0.txt", "d", "d/b.txt", "d/sparse", ".sandlot-sync.json"}


def test_a_cut_archive_applies_nothing(env: dict[str, str], tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    agent(
        env,
        "set -e; mkdir -p /workspace/cut && cd /workspace/cut"
        " && for f in a b c d e f; do head -c 100000 /dev/urandom > $f.bin; done"
        " && echo one > one.txt",
    )
    r = sandlot(env, "pull", f"{THREAD}:/workspace/cut", str(local))
    assert r.returncode == 0, r.stderr
    before = {p: p.read_bytes() for p in local.rglob("*")}
    agent(
        env,
        "cd /workspace/cut && for f in a b c d e f; do echo new > $f.bin; done"
        " && echo two > one.txt && echo x > z.txt && chmod 000 c.bin",
    )
    r = sandlot(env, "pull", f"{THREAD}:/workspace/cut", str(local))
    assert r.returncode == 1 and "cut short" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert {p: p.read_bytes() for p in local.rglob("*")} == before


def test_pull_keeps_local_modes_and_masks_new_ones(env: dict[str, str], tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / ".env").write_text("A=1\n")
    (local / ".env").chmod(0o600)
    (local / "run.sh").write_text("echo 1\n")
    (local / "run.sh").chmod(0o755)
    r = sandlot(env, "sync", str(local), f"{THREAD}:/workspace/modes")
    assert r.returncode == 0, r.stderr
    agent(
        env,
        "set -e; cd /workspace/modes && echo A=2 > .env && chmod 644 .env"
        " && echo 'echo 2' > run.sh && chmod 644 run.sh"
        " && echo new > new.sh && chmod 4775 new.sh"
        " && echo plain > plain.txt && chmod 666 plain.txt",
    )
    umask = os.umask(0o022)
    os.umask(umask)
    r = sandlot(env, "pull", f"{THREAD}:/workspace/modes", str(local))
    assert r.returncode == 0, r.stderr

    def mode(name: str) -> int:
        return stat.S_IMODE((local / name).stat().st_mode)

    assert (local / ".env").read_text() == "A=2\n" and mode(".env") == 0o600
    assert (local / "run.sh").read_text() == "echo 2\n" and mode("run.sh") == 0o755
    assert mode("new.sh") == 0o775 & ~umask
    assert mode("plain.txt") == 0o666 & ~umask


def test_names_are_printed_as_they_are_and_local_errors_are_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "local"
    agent(
        env,
        "mkdir -p /workspace/names/.git && cd /workspace/names"
        " && touch \".git/a[bold]b$(printf '\\033')[31mc\"",
    )
    r = sandlot(env, "pull", f"{THREAD}:/workspace/names", str(local))
    assert r.returncode == 0, r.stderr
    assert "a[bold]b\\x1b[31mc" in r.stderr and "\x1b" not in r.stderr, r.stderr
    (tmp_path / "p12").write_text("a file\n")
    r = sandlot(env, "pull", f"{THREAD}:/workspace/names", str(tmp_path / "p12" / "bar" / "x"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "p12" in r.stderr and "connection" not in r.stderr, r.stderr


def _remote_listing(env: dict[str, str], remote: str) -> set[str]:
    out = agent(env, f"cd {remote} && find . -mindepth 1 | sort")
    return {line.removeprefix("./") for line in out.splitlines()}


def test_sync_skips_links_pointing_out(env: dict[str, str], tmp_path: Path) -> None:
    local = tmp_path / "local"
    (local / ".venv" / "bin").mkdir(parents=True)
    (local / ".venv" / "bin" / "python3.11").symlink_to("/usr/bin/python3")
    (local / "up").symlink_to("../../etc")
    (local / "inner").symlink_to("a.txt")
    (local / "a.txt").write_text("a\n")
    r = sandlot(env, "sync", str(local), f"{THREAD}:/workspace/links")
    assert r.returncode == 0, r.stderr
    assert "skipped 2 links" in r.stderr and ".venv/bin/python3.11" in r.stderr, r.stderr
    assert _remote_listing(env, "/workspace/links") == {".venv", ".venv/bin", "a.txt", "inner"}


#: Root reads what it likes: the command runs without that privilege, as a user would.
AS_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def test_sync_delete_removes_nothing_when_part_of_the_tree_cannot_be_read(
    env: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "a.txt").write_text("a\n")
    (local / "locked").mkdir()
    (local / "locked" / "b.txt").write_text("b\n")
    (local / "c.txt").write_text("c\n")
    agent(env, "mkdir -p /workspace/del && echo old > /workspace/del/gone.txt")
    r = sandlot(env, "sync", str(local), f"{THREAD}:/workspace/del")
    assert r.returncode == 0, r.stderr
    (local / "locked").chmod(0)
    (local / "c.txt").chmod(0)
    try:
        r = subprocess.run(
            [*AS_USER, *SANDLOT, "sync", "--delete", str(local), f"{THREAD}:/workspace/del"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        (local / "locked").chmod(0o755)
        (local / "c.txt").chmod(0o644)
    assert r.returncode == 1 and "nothing removed" in r.stderr, r.stderr
    assert "locked" in r.stderr and "c.txt" in r.stderr, r.stderr
    remote = _remote_listing(env, "/workspace/del")
    assert {"a.txt", "locked/b.txt", "c.txt", "gone.txt"} <= remote
    # With the whole tree readable, --delete removes as before.
    r = sandlot(env, "sync", "--delete", str(local), f"{THREAD}:/workspace/del")
    assert r.returncode == 0, r.stderr
    assert _remote_listing(env, "/workspace/del") == {"a.txt", "c.txt", "locked", "locked/b.txt"}


def test_watch_removes_only_what_is_gone_and_outlives_an_error(
    env: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "w"
    local.mkdir()
    for name in ("a.txt", "b.txt", "x"):
        (local / name).write_text(f"{name}\n")
    proc = subprocess.Popen(
        [*SANDLOT, "sync", str(local), f"{THREAD}:/workspace/watch", "--watch"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "watching" not in (proc.stderr.readline() if proc.stderr else ""):
            assert time.monotonic() < deadline and proc.poll() is None
        (local / ".gitignore").write_text("b.txt\n")  # b.txt is ignored now, not gone
        (local / "x").unlink()
        (local / "x").mkdir()  # a file replaced by a directory of the same name
        (local / "x" / "y.txt").write_text("y\n")
        deadline = time.monotonic() + 60
        while True:
            files = _remote_listing(env, "/workspace/watch")
            if {".gitignore", "x/y.txt"} <= files:
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, files
            time.sleep(0.3)
        assert "b.txt" in files and "a.txt" in files
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()

"""The ``sandlot`` command end to end against a real server: exec, shell (through a real
pseudo-terminal), sync/pull, watch, resources, and clear errors."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pexpect
import pytest

from sandlot.sdk import AsyncSandlot
from tests.servers import SandlotServer, free_port, running

SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("cli") / "d", config='admins = ["root"]\n') as srv:
        yield srv


def sandlot(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SANDLOT, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_exec_streams_output_and_exits_with_the_code(env: dict[str, str]) -> None:
    r = sandlot(env, "exec", "thr_cli", "--", "echo out; echo err >&2; exit 7")
    assert r.returncode == 7
    assert r.stdout == "out\n" and r.stderr == "err\n"
    r = sandlot(
        env, "exec", "thr_cli", "--", "python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"
    )
    assert r.returncode == 0 and r.stdout == "['a b', 'c']\n"
    r = sandlot(env, "exec", "thr_cli", "--timeout", "0.5", "--", "sleep 30")
    assert r.returncode == 124
    r = sandlot(
        env,
        "exec",
        "thr_cli",
        "--env",
        "GREETING=hi there",
        "--cwd",
        "/tmp",
        "--",
        "echo $GREETING; pwd",
    )
    assert r.stdout == "hi there\n/tmp\n"


def test_clear_errors_without_tracebacks(env: dict[str, str]) -> None:
    down = {**env, "SANDLOT_URL": "http://127.0.0.1:9"}
    r = sandlot(down, "exec", "thr_cli", "--", "true")
    assert r.returncode == 1 and "cannot reach the server" in r.stderr
    assert "Traceback" not in r.stderr
    r = sandlot({**env, "SANDLOT_API_KEY": ""}, "sandbox", "list")
    assert r.returncode == 2 and "no API key" in r.stderr
    r = sandlot({**env, "SANDLOT_API_KEY": "sl_nope"}, "sandbox", "list")
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr and "Traceback" not in r.stderr
    r = sandlot(env, "exec", "thr_cli", "--env", "novalue", "--", "true")
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr
    r = sandlot(env, "sync", "/nonexistent/dir", "thr_cli")
    assert r.returncode == 2 and "not a directory" in r.stderr
    for cmd in (
        ["exec"],
        ["shell"],
        ["sync"],
        ["pull"],
        ["watch"],
        ["session", "ensure"],
        ["sandbox", "list"],
        ["template", "list"],
        ["pool", "list"],
        ["audit"],
        ["keys", "create"],
    ):
        r = sandlot(env, *cmd, "--help")
        assert r.returncode == 0 and "Example:" in r.stdout, cmd


def _tree(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "build").mkdir()
    (root / "node_modules" / "m").mkdir(parents=True)
    (root / ".gitignore").write_text("build/\n*.log\n!keep.log\nnode_modules\n")
    (root / "src" / ".gitignore").write_text("*.tmp\n")
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "src" / "pkg" / "data.bin").write_bytes(os.urandom(300_000))
    (root / "src" / "pkg" / "scratch.tmp").write_text("ignored\n")
    (root / "debug.log").write_text("ignored\n")
    (root / "keep.log").write_text("kept\n")
    (root / "build" / "out.o").write_bytes(b"\0" * 100)
    (root / "node_modules" / "m" / "i.js").write_text("ignored\n")


def _remote_files(env: dict[str, str], thread: str, remote: str) -> dict[str, bytes]:
    async def fetch() -> bytes:
        client = AsyncSandlot(env["SANDLOT_URL"], env["SANDLOT_API_KEY"], auto_refresh=False)
        try:
            return await (await client.ensure(thread)).download_archive(remote)
        finally:
            await client.aclose()

    data = asyncio.run(fetch())
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar:
            f = tar.extractfile(m) if m.isfile() else None
            if f is not None:
                out[m.name.removeprefix("./")] = f.read()
    return out


def test_sync_honours_gitignore_and_pull_never_overwrites_local_changes(
    env: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "proj"
    _tree(local)
    r = sandlot(env, "sync", str(local), "thr_sync:/workspace/proj")
    assert r.returncode == 0, r.stderr
    remote = _remote_files(env, "thr_sync", "/workspace/proj")
    expected = {".gitignore", "keep.log", "src/.gitignore", "src/main.py", "src/pkg/data.bin"}
    assert set(remote) == expected
    for rel in expected:
        assert remote[rel] == (local / rel).read_bytes(), rel

    # The sandbox changes one file and adds one; locally another file changed too.
    r = sandlot(
        env,
        "exec",
        "thr_sync",
        "--",
        "cd /workspace/proj && echo remote > src/main.py && echo new > src/new.py"
        " && echo remote > keep.log",
    )
    assert r.returncode == 0
    (local / "keep.log").write_text("local edit\n")
    r = sandlot(env, "pull", "thr_sync:/workspace/proj", str(local))
    assert r.returncode == 1 and "conflict" in r.stderr and "keep.log" in r.stderr
    assert (local / "src/main.py").read_text() == "remote\n"
    assert (local / "src/new.py").read_text() == "new\n"
    assert (local / "keep.log").read_text() == "local edit\n"
    assert (local / "keep.log.sandlot-remote").read_text() == "remote\n"
    # Still a conflict on the next pull: the local change is never taken as the base.
    r = sandlot(env, "pull", "thr_sync:/workspace/proj", str(local))
    assert r.returncode == 1 and (local / "keep.log").read_text() == "local edit\n"
    r = sandlot(env, "pull", "--force", "thr_sync:/workspace/proj", str(local))
    assert r.returncode == 0 and (local / "keep.log").read_text() == "remote\n"


def test_sync_watch_pushes_changes(env: dict[str, str], tmp_path: Path) -> None:
    local = tmp_path / "w"
    local.mkdir()
    (local / "a.txt").write_text("one\n")
    proc = subprocess.Popen(
        [*SANDLOT, "sync", str(local), "thr_watchsync", "--watch"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while "watching" not in (proc.stderr.readline() if proc.stderr else ""):
            assert time.monotonic() < deadline and proc.poll() is None
        (local / "b.txt").write_text("two\n")
        (local / "a.txt").unlink()
        deadline = time.monotonic() + 15
        while True:
            files = _remote_files(env, "thr_watchsync", "/workspace")
            if files.get("b.txt") == b"two\n" and "a.txt" not in files:
                break
            assert time.monotonic() < deadline, files.keys()
            time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_watch_shows_an_agents_write_within_a_second(
    env: dict[str, str], server: SandlotServer
) -> None:
    agent_key = server.key("alice", "agent")
    sandlot(env, "exec", "thr_watch", "--", "true")
    child = pexpect.spawn(
        SANDLOT[0],
        [*SANDLOT[1:], "watch", "thr_watch", "--json"],
        env=env,
        encoding="utf-8",
        timeout=20,
    )
    try:
        time.sleep(1.5)  # let the watch catch up with the log

        async def agent_writes() -> float:
            client = AsyncSandlot(env["SANDLOT_URL"], agent_key, auto_refresh=False)
            try:
                sb = await client.ensure("thr_watch")
                t0 = time.monotonic()
                await sb.write("/workspace/from-agent.txt", "hello human\n")
                return t0
            finally:
                await client.aclose()

        t0 = asyncio.run(agent_writes())
        child.expect(r"\{[^\n]*from-agent\.txt[^\n]*\}", timeout=5)
        seen = time.monotonic() - t0
        event = json.loads(child.match.group(0))
        assert event["actor"]["type"] == "agent"
        assert event["details"]["fs"]["path"] == "/workspace/from-agent.txt"
        assert seen < 1.0, f"the watch showed the write after {seen:.2f} s"
    finally:
        child.terminate(force=True)
    # A new watch resumes after the last event the previous one showed.
    last = event["sequence"]
    sandlot(env, "exec", "thr_watch", "--", "echo later > /workspace/later.txt")
    again = pexpect.spawn(
        SANDLOT[0],
        [*SANDLOT[1:], "watch", "thr_watch", "--json"],
        env=env,
        encoding="utf-8",
        timeout=20,
    )
    try:
        again.expect(r"\{[^\n]*\}")
        assert json.loads(again.match.group(0))["sequence"] == last + 1
    finally:
        again.terminate(force=True)


def test_shell_through_a_real_terminal_shared_with_an_observer(env: dict[str, str]) -> None:
    driver = pexpect.spawn(
        SANDLOT[0],
        [*SANDLOT[1:], "shell", "thr_shell"],
        env=env,
        encoding="utf-8",
        timeout=20,
        dimensions=(30, 100),
    )
    observer = None
    try:
        driver.expect(r"\$ ")
        driver.sendline("echo hello-$((6*7)); tty; stty size")
        driver.expect(r"hello-42")
        driver.expect(r"/dev/pts/\d+")
        driver.expect(r"30 100")
        observer = pexpect.spawn(
            SANDLOT[0],
            [*SANDLOT[1:], "shell", "thr_shell", "--observe"],
            env=env,
            encoding="utf-8",
            timeout=20,
            dimensions=(30, 100),
        )
        observer.expect("hello-42")  # history on attach
        driver.sendline("echo typed-by-driver")
        driver.expect("typed-by-driver\r\n")
        observer.expect("typed-by-driver\r\n")
        observer.send("echo observers-cannot-type\r")
        driver.setwinsize(40, 120)
        time.sleep(0.5)
        driver.sendline("stty size")
        driver.expect("40 120")
        # Ctrl-C reaches the remote program, not the client.
        driver.sendline("sleep 30")
        time.sleep(0.5)
        driver.sendcontrol("c")
        driver.expect(r"\$ ")
        assert driver.isalive()
        # Ctrl-] detaches; the shell lives on and a new client gets its history.
        driver.sendline("export MARK=still-here")
        driver.expect(r"\$ ")
        driver.send("\x1d")
        driver.expect(pexpect.EOF)
        again = pexpect.spawn(
            SANDLOT[0], [*SANDLOT[1:], "shell", "thr_shell"], env=env, encoding="utf-8", timeout=20
        )
        again.expect("MARK=still-here")
        again.sendline("echo $MARK")
        again.expect("still-here\r\n")
        again.sendline("exit 5")
        again.expect(pexpect.EOF)
        again.wait()
        assert again.exitstatus == 5
    finally:
        driver.terminate(force=True)
        if observer is not None:
            assert "observers-cannot-type" not in (observer.before or "")
            observer.terminate(force=True)


@pytest.mark.timeout(180)  # some thirty CLI processes, each a Python start-up
def test_session_and_resource_commands(env: dict[str, str], server: SandlotServer) -> None:
    r = sandlot(env, "session", "ensure", "thr_res", "--json")
    grant = json.loads(r.stdout)
    assert grant["binding"]["scope"] == {"type": "thread", "id": "thr_res"}
    sid = grant["session_id"]
    assert (
        json.loads(sandlot(env, "session", "get", "thr_res", "--json").stdout)["session_id"] == sid
    )
    assert "expires_at" in json.loads(sandlot(env, "session", "refresh", sid, "--json").stdout)
    assert (
        json.loads(sandlot(env, "session", "heartbeat", "thr_res", "--json").stdout)["state"]
        == "active"
    )
    r = sandlot(env, "sandbox", "create", "--name", "scratch", "--json")
    sb = json.loads(r.stdout)
    assert sb["state"] == "active"
    listed = json.loads(sandlot(env, "sandbox", "list", "--json").stdout)
    assert sb["id"] in {s["id"] for s in listed}
    assert (
        json.loads(sandlot(env, "sandbox", "suspend", sb["id"], "--json").stdout)["state"]
        == "suspended"
    )
    assert (
        json.loads(sandlot(env, "sandbox", "resume", sb["id"], "--json").stdout)["state"]
        == "active"
    )
    # --json prints the answer as the server sent it, not the SDK's typed view of it.
    wire = {"Authorization": f"Bearer {env['SANDLOT_API_KEY']}"}
    # The sandbox may change between the two reads (it turns idle with no session on it):
    # compare two reads with no event between them.
    for _ in range(5):
        got = json.loads(sandlot(env, "sandbox", "get", sb["id"], "--json").stdout)
        direct = httpx.get(f"{server.url}/v1/sandboxes/{sb['id']}", headers=wire).json()
        if got["last_event_sequence"] == direct["last_event_sequence"]:
            break
    assert got == direct
    assert sandlot(env, "sandbox", "delete", sb["id"]).returncode == 0
    assert "default" in sandlot(env, "template", "list").stdout
    template = json.loads(sandlot(env, "template", "get", "default").stdout)
    assert template["image"] == "host"
    assert template == httpx.get(f"{server.url}/v1/templates/default", headers=wire).json()
    r = sandlot(env, "pool", "create", "warm", "--template", "default")
    assert r.returncode == 1 and "FORBIDDEN" in r.stderr
    admin = {**env, "SANDLOT_API_KEY": server.key("root")}
    assert (
        sandlot(
            admin, "pool", "create", "warm", "--template", "default", "--min-ready", "0"
        ).returncode
        == 0
    )
    assert "warm" in sandlot(admin, "pool", "list").stdout
    assert sandlot(admin, "pool", "delete", "warm").returncode == 0
    audit = json.loads(sandlot(admin, "audit", "--scope", "thread:thr_res", "--json").stdout)
    assert audit and audit[0]["action"] == "session.ensure"
    page = httpx.get(
        f"{server.url}/v1/audit",
        params={"scope": "thread:thr_res"},
        headers={"Authorization": f"Bearer {admin['SANDLOT_API_KEY']}"},
    ).json()
    assert audit == page["items"]
    r = sandlot(env, "session", "release", "thr_res", "--terminate")
    assert r.returncode == 0 and "terminated" in r.stdout


def test_shell_outlives_an_outage(tmp_path: Path) -> None:
    """Every connection reset for 6 s under a live `sandlot shell`: it reattaches to the
    same shell (its state intact), types what was typed meanwhile, and goes on, instead of
    giving up after a few tries."""
    from tests.faultproxy import serving

    with serving(20261123) as proxy:
        srv = SandlotServer(tmp_path / "d", env={"SANDLOT_PUBLIC_URL": proxy.url})
        srv.port = free_port()
        proxy.upstream = ("127.0.0.1", srv.port)
        srv.start()
        try:
            env = {
                **os.environ,
                "SANDLOT_URL": proxy.url,
                "SANDLOT_API_KEY": srv.key("alice"),
                "HOME": str(tmp_path),
                "XDG_CONFIG_HOME": str(tmp_path / ".config"),
            }
            shell = pexpect.spawn(
                SANDLOT[0], [*SANDLOT[1:], "shell", "thr_outage"], env=env, encoding="utf-8",
                timeout=30, dimensions=(30, 100),
            )  # fmt: skip
            try:
                shell.expect(r"\$ ")
                shell.sendline("export MARK=before-the-outage")
                shell.expect(r"\$ ")
                proxy.outage(6.0)
                time.sleep(2.0)
                shell.sendline("echo typed-$((20 + 3))")  # while disconnected: kept, sent after
                time.sleep(4.5)
                shell.expect("typed-23\r\n")
                shell.sendline("echo mark=$MARK")
                shell.expect("mark=before-the-outage\r\n")
                assert proxy.stats.resets > 5  # more failures in a row than the attempts
                assert "Traceback" not in (shell.before or "")
                shell.sendline("exit 3")
                shell.expect(pexpect.EOF)
                shell.wait()
                assert shell.exitstatus == 3
            finally:
                shell.terminate(force=True)
        finally:
            srv.stop()
            srv.cleanup()


def test_watch_of_a_sandbox_that_kept_only_its_latest_events(
    env: dict[str, str], tmp_path: Path
) -> None:
    # A first watch, or --from-start, of a sandbox with more events than it keeps ended
    # at once: "events before this cursor are no longer kept" (exit 1).
    with running(tmp_path / "d", env={"SANDLOT_DP_EVENT_RETENTION": "20"}) as srv:
        mine = {**env, "SANDLOT_URL": srv.url, "SANDLOT_API_KEY": srv.key("alice")}
        made = sandlot(mine, "exec", "thr_busy", "--", "for i in $(seq 40); do : > f$i; done")
        assert made.returncode == 0, made.stderr

        def watch(*extra: str, home: Path) -> tuple[list[int], str]:
            run_env = {**mine, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                       "XDG_CACHE_HOME": str(home / ".cache")}  # fmt: skip
            try:
                subprocess.run(
                    [*SANDLOT, "watch", "thr_busy", "--json", *extra],
                    env=run_env, capture_output=True, text=True, timeout=8,
                )  # fmt: skip
            except subprocess.TimeoutExpired as live:  # it follows the log: stopped here
                out = live.stdout.decode() if isinstance(live.stdout, bytes) else live.stdout
                err = live.stderr.decode() if isinstance(live.stderr, bytes) else live.stderr
                return [json.loads(line)["sequence"] for line in (out or "").splitlines()], (
                    err or ""
                )
            raise AssertionError("the watch ended")

        every, said = watch("--from-start", home=tmp_path / "h1")
        assert len(every) == 20 and every == list(range(every[0], every[0] + 20)), every
        assert "no longer kept" not in said
        first, said = watch(home=tmp_path / "h2")
        assert first == every
        assert f"events 1 to {every[0] - 1} are no longer kept" in said

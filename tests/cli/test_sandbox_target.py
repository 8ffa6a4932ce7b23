"""Every sandbox command addresses a sandbox by id (``--sandbox ID``) as well as a thread,
against a real ``sandlot serve``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pexpect
import pytest

from sandlot.sdk import AsyncSandlot
from tests.cli.test_cli import (
    SANDLOT,
    sandlot,
)
from tests.servers import SandlotServer, running


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("cli-sb") / "d") as srv:
        yield srv


def create(env: dict[str, str]) -> str:
    r = sandlot(env, "sandbox", "create", "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["id"])


@pytest.fixture(scope="module")
def sandbox_id(env: dict[str, str]) -> str:
    return create(env)


def test_exec_in_a_standalone_sandbox(env: dict[str, str], sandbox_id: str) -> None:
    r = sandlot(env, "exec", "--sandbox", sandbox_id, "--", "echo", "hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hi\n"
    r = sandlot(env, "exec", "--sandbox", sandbox_id, "--", "echo out; exit 3")
    assert r.returncode == 3 and r.stdout == "out\n"
    # Options may follow --sandbox; the command is what follows --.
    r = sandlot(env, "exec", "--sandbox", sandbox_id, "--cwd", "/tmp", "--", "pwd")
    assert r.stdout == "/tmp\n"
    # The sandbox stays one that serves no thread.
    r = sandlot(env, "sandbox", "get", sandbox_id, "--json")
    assert json.loads(r.stdout)["scope"] is None


# Paths in commands are relative to the workspace (the working directory): an unisolated
# sandbox sees the host's file system, where /workspace is not its workspace.
def test_sync_pull_and_cat(env: dict[str, str], sandbox_id: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.txt").write_text("from the human\n")
    r = sandlot(env, "sync", str(src), "--sandbox", f"{sandbox_id}:/workspace/app")
    assert r.returncode == 0, r.stderr
    assert f"to {sandbox_id}:/workspace/app" in r.stderr
    r = sandlot(env, "exec", "--sandbox", sandbox_id, "--", "cat", "app/pkg/a.txt")
    assert r.returncode == 0 and r.stdout == "from the human\n"
    # Default directory: /workspace.
    r = sandlot(env, "sync", str(src), "--sandbox", sandbox_id)
    assert r.returncode == 0, r.stderr
    r = sandlot(env, "exec", "--sandbox", sandbox_id, "--", "cat pkg/a.txt")
    assert r.stdout == "from the human\n"
    sandlot(env, "exec", "--sandbox", sandbox_id, "--", "echo agent > app/b.txt")
    back = tmp_path / "back"
    r = sandlot(env, "pull", "--sandbox", f"{sandbox_id}:/workspace/app", str(back))
    assert r.returncode == 0, r.stderr
    assert (back / "pkg" / "a.txt").read_text() == "from the human\n"
    assert (back / "b.txt").read_text() == "agent\n"


def test_watch_and_shell(env: dict[str, str], sandbox_id: str) -> None:
    async def write() -> None:
        async with AsyncSandlot(env["SANDLOT_URL"], env["SANDLOT_API_KEY"]) as client:
            sandbox = await client.attach_sandbox(sandbox_id)
            await sandbox.write("/workspace/watched.txt", "w\n")

    asyncio.run(write())
    watch = pexpect.spawn(
        SANDLOT[0],
        [*SANDLOT[1:], "watch", "--sandbox", sandbox_id, "--from-start", "--json"],
        env=env,
        encoding="utf-8",
        timeout=20,
    )
    try:
        watch.expect(r"\{[^\n]*watched\.txt[^\n]*\}")
    finally:
        watch.terminate(force=True)
    shell = pexpect.spawn(
        SANDLOT[0],
        [*SANDLOT[1:], "shell", "--sandbox", sandbox_id],
        env=env,
        encoding="utf-8",
        timeout=20,
    )
    try:
        shell.expect(r"[$#] ")  # root, unisolated: #
        shell.sendline("echo by-id-$((6*7))")
        shell.expect("by-id-42")
        shell.sendline("exit 4")
        shell.expect(pexpect.EOF)
        shell.wait()
        assert shell.exitstatus == 4
    finally:
        shell.terminate(force=True)


def test_session_get_prints_the_grant(env: dict[str, str], sandbox_id: str) -> None:
    r = sandlot(env, "session", "get", "--sandbox", sandbox_id, "--json")
    assert r.returncode == 0, r.stderr
    grant = json.loads(r.stdout)
    assert grant["sandbox"]["id"] == sandbox_id
    assert grant["binding"]["scope"] == {"type": "sandbox", "id": sandbox_id}
    r = sandlot(env, "session", "release", grant["session_id"])
    assert r.returncode == 0 and r.stdout == f"released {grant['session_id']}\n"


@pytest.mark.parametrize(
    "args",
    [
        ["session", "get", "thr_x", "--sandbox", "sb_x"],
        ["session", "get"],
        ["exec", "thr_x", "--sandbox", "sb_x", "--", "true"],
        ["exec", "--", "true"],
        ["exec", "--sandbox", "sb_x"],
        ["shell", "thr_x", "--sandbox", "sb_x"],
        ["shell"],
        ["watch", "thr_x", "--sandbox", "sb_x"],
        ["watch"],
        ["sync", ".", "thr_x", "--sandbox", "sb_x"],
        ["sync", "."],
        ["pull", "thr_x", ".", "--sandbox", "sb_x"],
        ["pull", "."],
    ],
)
def test_thread_or_sandbox_exactly_one(env: dict[str, str], args: list[str]) -> None:
    r = sandlot(env, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "--sandbox" in r.stderr or "THREAD" in r.stderr


def test_refusals(env: dict[str, str], server: SandlotServer) -> None:
    mine = create(env)
    mallory = {**env, "SANDLOT_API_KEY": server.key("mallory")}
    r = sandlot(mallory, "exec", "--sandbox", mine, "--", "echo hi")
    assert r.returncode == 1 and r.stdout == ""
    assert "FORBIDDEN" in r.stderr and "Traceback" not in r.stderr
    sessions = f"{server.url}/v1/sandbox/sessions"
    headers = {"Authorization": f"Bearer {mallory['SANDLOT_API_KEY']}"}
    r = httpx.post(sessions, json={"sandbox_id": mine, "mode": "attach_only"}, headers=headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "FORBIDDEN"
    headers = {"Authorization": f"Bearer {env['SANDLOT_API_KEY']}"}
    r = httpx.post(sessions, json={"sandbox_id": mine, "mode": "ensure"}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST"
    assert sandlot(env, "sandbox", "delete", mine).returncode == 0
    r = httpx.post(sessions, json={"sandbox_id": mine, "mode": "attach_only"}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "SANDBOX_NOT_FOUND"
    r = sandlot(env, "exec", "--sandbox", mine, "--", "echo hi")
    assert r.returncode == 1 and "SANDBOX_NOT_FOUND" in r.stderr


def test_session_commands_by_sandbox_id(env: dict[str, str]) -> None:
    sandbox_id = create(env)
    r = sandlot(env, "session", "refresh", "--sandbox", sandbox_id, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["expires_at"]
    r = sandlot(env, "session", "heartbeat", "--sandbox", sandbox_id, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] in ("active", "idle")
    r = sandlot(env, "session", "release", "--sandbox", sandbox_id, "--terminate")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("terminated ssn_")
    r = sandlot(env, "sandbox", "get", sandbox_id, "--json")
    assert json.loads(r.stdout)["state"] == "terminated"
    # Both, or neither, is a usage error.
    r = sandlot(env, "session", "heartbeat")
    assert r.returncode == 2
    assert "THREAD or --sandbox ID" in r.stderr

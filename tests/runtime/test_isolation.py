"""Isolation probes (TESTING.md), each run inside a real sandbox."""

# Probes read /proc and cgroup files directly: instant, and the point of the test.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandlot.protocol.sessions import NetworkMode, Resources, Template
from sandlot.runtime.base import SandboxRuntime
from sandlot.runtime.local import IsolatedRuntime, LocalRuntimeManager, RuntimeSettings
from tests.runtime.conftest import require_isolation, run

# The isolation probes of the reliability suite: every test here is one.
pytestmark = [pytest.mark.isolation, pytest.mark.reliability]

HERE = Path(__file__).parent


async def test_runs_as_sandbox_user_without_privileges(sandbox: SandboxRuntime) -> None:
    result = await run(
        sandbox, ["sh", "-c", "id -u; grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status"]
    )
    assert result.status.exit_code == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0] == "1000"
    assert "CapEff:\t0000000000000000" in lines
    assert "CapPrm:\t0000000000000000" in lines
    assert "NoNewPrivs:\t1" in lines


async def test_bwrap_and_every_process_run_as_the_sandbox_host_uid(
    sandbox: SandboxRuntime, settings: RuntimeSettings
) -> None:
    assert isinstance(sandbox, IsolatedRuntime)
    host_pids = sandbox.cgroup.pids()
    assert len(host_pids) >= 2  # bubblewrap's monitor and the init
    comms = set()
    for pid in host_pids:
        status = Path(f"/proc/{pid}/status").read_text()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        assert "0" not in uids
        if os.geteuid() == 0:
            assert all(
                settings.uid_base <= int(u) < settings.uid_base + settings.uid_count for u in uids
            )
        comms.add(Path(f"/proc/{pid}/comm").read_text().strip())
    assert "bwrap" in comms
    assert sandbox.fs_ids == (sandbox.uid, sandbox.uid if os.geteuid() == 0 else os.getgid())


def test_server_secrets_invisible_inside(settings: RuntimeSettings, data_dir: Path) -> None:
    """A server with a secret in its environment and argv: no process inside can see it."""
    secret = "sandlot-marker-" + os.urandom(8).hex()
    script = textwrap.dedent(
        """
        import asyncio, json, sys
        from pathlib import Path
        from sandlot.protocol.sessions import Template
        from sandlot.runtime.base import ProcessSpec
        from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings
        from tests.runtime.conftest import run

        SCAN = '''
        import os, sys
        markers = sys.stdin.read().split()
        readable = 0
        hits = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            for name in ("environ", "cmdline"):
                try:
                    data = open(f"/proc/{pid}/{name}", "rb").read()
                except OSError:
                    continue
                readable += 1
                if any(m.encode() in data for m in markers):
                    hits.append(f"{pid}/{name}")
        print(readable, " ".join(hits))
        '''

        async def main():
            data = Path(sys.argv[1])
            mgr = LocalRuntimeManager(RuntimeSettings(
                run_dir=data / "run", workspaces_dir=data / "ws", volumes_dir=data / "vol"))
            mgr.preflight()
            rt = await mgr.create("sb-secret", 1, Template(name="t", image="host"), {})
            try:
                # A long-lived sibling, so more than the scanner itself is scanned.
                await rt.spawn(ProcessSpec(argv=["sleep", "30"]))
                # Markers on stdin: the scanner's own argv must not contain them.
                res = await run(rt, ["python3", "-c", SCAN],
                                stdin=(sys.argv[2] + " " + str(data)).encode())
                files = await run(rt, ["sh", "-c",
                    "ls -d /root /home /sys /run /var /etc/shadow /etc/ssh "
                    + str(data) + " 2>&1; env"])
                print(json.dumps({"scan": res.stdout, "files": files.stdout,
                                  "err": res.stderr}))
            finally:
                await mgr.cleanup_leftovers(set())

        asyncio.run(main())
        """
    )
    child_data = data_dir / "secret-server"
    child_data.mkdir(mode=0o700)
    env = {**os.environ, "SANDLOT_TEST_SECRET": secret}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(child_data), secret],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=HERE.parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    readable, _, hits = report["scan"].strip().partition(" ")
    assert int(readable) >= 4, report  # the scanner and the sleeper, environ and cmdline
    assert hits == "", f"secret or host path visible in {hits}"
    assert secret not in report["files"]
    assert "SANDLOT_TEST_SECRET" not in report["files"]
    for path in ("/root", "/home", "/sys", "/run", "/var", "/etc/shadow", "/etc/ssh"):
        assert f"'{path}': No such file or directory" in report["files"], report["files"]
    assert f"'{child_data}': No such file or directory" in report["files"]


async def test_init_environment_and_memory_unreadable(sandbox: SandboxRuntime) -> None:
    result = await run(
        sandbox,
        [
            "sh",
            "-c",
            "cat /proc/1/environ; echo rc=$?; ls /proc/1/fd; echo rc=$?; "
            "tr '\\0' ' ' </proc/1/cmdline",
        ],
    )
    assert "rc=1\n" in result.stdout and "rc=2" in result.stdout
    assert "Permission denied" in result.stderr
    assert " init " in result.stdout  # the init's own argv: fd numbers only


async def test_template_env_is_what_the_sandbox_sees(
    sandbox: SandboxRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_HOST_ONLY", "leak")
    result = await run(sandbox, ["env"], env={"EXTRA": "1"})
    env = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert env["SANDBOX_GREETING"] == "hello"
    assert env["EXTRA"] == "1"
    assert env["HOME"] == "/workspace"
    assert "SANDLOT_HOST_ONLY" not in env


async def test_no_network_by_default(manager: LocalRuntimeManager, template: Template) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
    )
    try:
        isolated = await manager.create("sb-nonet", 1, template, {})
        result = await run(isolated, ["python3", "-c", probe])
        assert result.stdout.startswith("refused"), result
        assert "['lo']" in result.stdout
        host_net = template.model_copy(update={"network": NetworkMode.HOST})
        shared = await manager.create("sb-hostnet", 1, host_net, {})
        result = await run(shared, ["python3", "-c", probe])
        assert result.stdout.startswith("connected"), result
    finally:
        server.close()


async def test_few_pids_visible(sandbox: SandboxRuntime) -> None:
    result = await run(sandbox, ["sh", "-c", "ls /proc | grep -c '^[0-9]*$'"])
    # init, this shell, and ls/grep
    assert int(result.stdout) <= 5


async def test_proc_sys_writes_denied(sandbox: SandboxRuntime) -> None:
    current = Path("/proc/sys/vm/overcommit_ratio").read_text().strip()
    result = await run(
        sandbox, ["sh", "-c", f"echo {current} > /proc/sys/vm/overcommit_ratio && echo written"]
    )
    assert "written" not in result.stdout
    assert result.status.exit_code != 0
    assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr


async def test_filesystem_layout(sandbox: SandboxRuntime) -> None:
    result = await run(
        sandbox,
        [
            "sh",
            "-c",
            "touch /workspace/w && touch /tmp/t && echo ok; touch /usr/x 2>&1; touch /x 2>&1;"
            "grep -E ' /(workspace|tmp) ' /proc/self/mountinfo",
        ],
    )
    assert result.stdout.startswith("ok\n"), result
    assert result.stdout.count("Read-only file system") == 2
    for mount_point in ("/workspace", "/tmp"):
        line = next(x for x in result.stdout.splitlines() if f" {mount_point} " in x)
        options = line.split()[5].split(",")
        assert "nosuid" in options and "nodev" in options and "rw" in options
    host_ws = sandbox.workspace / "w"
    assert host_ws.exists()
    assert (host_ws.stat().st_uid, host_ws.stat().st_gid) == sandbox.fs_ids
    tmp = next(m for m in sandbox.mounts() if m.sandbox_path == "/tmp")
    assert (tmp.host_path / "t").exists()


async def test_device_allowlist(sandbox: SandboxRuntime) -> None:
    # stat, not find: bind-mounted device nodes sit on placeholder files of the tmpfs.
    lister = (
        "import os, stat\n"
        "for root, dirs, files in os.walk('/dev'):\n"
        "    for n in dirs + files:\n"
        "        p = os.path.join(root, n)\n"
        "        m = os.lstat(p).st_mode\n"
        "        if stat.S_ISCHR(m) or stat.S_ISBLK(m): print(p)\n"
    )
    result = await run(sandbox, ["python3", "-c", lister])
    devices = set(result.stdout.split())
    allowed = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"}
    allowed.add("/dev/pts/ptmx")
    assert devices <= allowed | {d for d in devices if d.startswith("/dev/pts/")}
    assert {"/dev/null", "/dev/urandom", "/dev/pts/ptmx"} <= devices


async def test_setuid_does_not_raise_privilege(sandbox: SandboxRuntime) -> None:
    script = (
        "cp /usr/bin/id /workspace/suid-id && chmod 4755 /workspace/suid-id; "
        "/workspace/suid-id -u; "
        "for b in /usr/bin/su /usr/bin/passwd /usr/bin/mount; do "
        "  [ -u $b ] && { $b -h >/dev/null 2>&1; $b root -c 'id -u' </dev/null 2>/dev/null; }; "
        "done; echo done"
    )
    result = await run(sandbox, ["sh", "-c", script])
    assert result.stdout.split()[0] == "1000"
    assert "\n0\n" not in result.stdout
    assert result.stdout.rstrip().endswith("done")


def _compile_probe(workspace: Path) -> str:
    target = workspace / "syscall_probe"
    subprocess.run(
        ["cc", "-O0", "-o", str(target), str(HERE / "syscall_probe.c")],
        check=True,
        capture_output=True,
    )
    return "/workspace/syscall_probe"


async def test_seccomp_denylist_returns_its_errno(sandbox: SandboxRuntime) -> None:
    probe = _compile_probe(sandbox.workspace)
    result = await run(sandbox, [probe])
    assert result.status.exit_code == 0, result
    seen = {name: int(code) for name, code in (line.split() for line in result.stdout.splitlines())}
    expected = {name: errno.EPERM for name in seen}
    expected["clone3"] = errno.ENOSYS
    expected["getpid"] = 0
    assert seen == expected
    assert len(seen) >= 28


@pytest.mark.parametrize("abi", ["i386", "x32"])
async def test_foreign_syscall_abis_killed(sandbox: SandboxRuntime, abi: str) -> None:
    probe = _compile_probe(sandbox.workspace)
    result = await run(sandbox, [probe, abi])
    assert "allowed" not in result.stdout
    assert result.status.signal == "SIGSYS"


async def test_tiocsti_denied_on_a_real_terminal(sandbox: SandboxRuntime) -> None:
    from tests.runtime.test_lifecycle import pty_output

    script = (
        "import fcntl, termios, ctypes, os\n"
        "try:\n"
        "    fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('injected')\n"
        "except OSError as e:\n"
        "    print('denied', e.errno)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "c = ctypes.c_char(b'y')\n"
        "rc = libc.syscall(16, 0, ctypes.c_ulong(0x100005412), ctypes.byref(c))\n"
        "print('high', rc, ctypes.get_errno())\n"
    )
    out = await pty_output(sandbox, ["python3", "-c", script])
    assert f"denied {errno.EPERM}" in out, out
    assert f"high -1 {errno.EPERM}" in out, out
    assert "injected" not in out


async def test_fork_bomb_stopped_by_pids_limit(
    manager: LocalRuntimeManager, template: Template
) -> None:
    limited = template.model_copy(update={"resources": Resources(pids=32, memory_mb=256)})
    rt = await manager.create("sb-forks", 1, limited, {})
    bomb = (
        "import os, time\n"
        "ok = 0\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.closerange(0, 3); time.sleep(3); os._exit(0)\n"
        "        ok += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print(ok, flush=True)\n"
        "os._exit(0)\n"
    )
    task = asyncio.ensure_future(run(rt, ["python3", "-c", bomb]))
    # The host stays responsive meanwhile.
    started = time.monotonic()
    subprocess.run(["true"], check=True)
    assert time.monotonic() - started < 1.0
    result = await task
    assert 0 < int(result.stdout) < 32, result
    await manager.destroy("sb-forks")


async def test_memory_hog_reported_as_oom(manager: LocalRuntimeManager, template: Template) -> None:
    small = template.model_copy(update={"resources": Resources(memory_mb=64, pids=64)})
    rt = await manager.create("sb-oom", 1, small, {})
    result = await run(rt, ["python3", "-c", "b = bytearray(200 << 20); print('survived')"])
    assert "survived" not in result.stdout
    assert result.status.oom_killed
    assert result.status.signal == "SIGKILL"
    # An ordinary failure afterwards is not reported as OOM.
    result = await run(rt, ["sh", "-c", "exit 3"])
    assert result.status.exit_code == 3 and not result.status.oom_killed


def test_skips_only_outside_ci_as_non_root() -> None:
    if os.geteuid() == 0 or os.environ.get("CI"):
        require_isolation()  # must not skip here
    else:
        with pytest.raises(pytest.skip.Exception):
            require_isolation()


async def test_cpu_limit_throttles(manager: LocalRuntimeManager, template: Template) -> None:
    slow = template.model_copy(update={"resources": Resources(cpu=0.2, memory_mb=256)})
    rt = await manager.create("sb-cpu", 1, slow, {})
    spin = (
        "import time\n"
        "end = time.monotonic() + 1.0\n"
        "while time.monotonic() < end: pass\n"
        "print(time.process_time())\n"
    )
    result = await run(rt, ["python3", "-c", spin])
    # 20% of one CPU over one second, plus the interpreter's start.
    assert float(result.stdout) < 0.45, result

"""Sandbox lifecycle on real sandboxes: create, exec, PTY, suspend/resume, adopt, destroy."""

# Probes read /proc and cgroup files directly: instant, and the point of the test.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from sandlot.protocol.sessions import Template, VolumeMount
from sandlot.protocol.states import SandboxState
from sandlot.runtime.base import ProcessSpec, SandboxRuntime
from sandlot.runtime.direct import set_winsize
from sandlot.runtime.local import (
    IsolatedRuntime,
    LocalRuntimeManager,
    RuntimeSettings,
    RuntimeUnavailable,
)
from tests.runtime.conftest import collect, run

pytestmark = pytest.mark.isolation


async def read_until(fd: int, marker: bytes, timeout: float = 10.0) -> bytes:
    loop = asyncio.get_running_loop()
    buf = b""
    deadline = loop.time() + timeout
    while marker not in buf:
        if loop.time() > deadline:
            raise TimeoutError(f"{marker!r} not seen in {buf!r}")
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            await asyncio.sleep(0.005)
            continue
        except OSError:  # EIO: the terminal's last process is gone
            break
        if not chunk:
            break
        buf += chunk
    return buf


async def pty_output(rt: SandboxRuntime, argv: list[str]) -> str:
    proc = await rt.spawn(ProcessSpec(argv=argv, pty=(80, 24)))
    assert proc.pty_fd is not None
    try:
        out = await read_until(proc.pty_fd, b"\x00never")
    except TimeoutError:
        out = b""
    await proc.wait()
    os.close(proc.pty_fd)
    return out.decode(errors="replace")


async def test_exec_pipes_exit_codes_and_signals(sandbox: SandboxRuntime) -> None:
    result = await run(sandbox, ["sh", "-c", "cat; echo err >&2; exit 7"], stdin=b"in\n")
    assert (result.stdout, result.stderr, result.status.exit_code) == ("in\n", "err\n", 7)
    assert result.status.signal is None
    result = await run(sandbox, ["sh", "-c", "kill -TERM $$"])
    assert result.status.signal == "SIGTERM" and result.status.exit_code == 128 + 15


async def test_spawn_errors_like_subprocess(sandbox: SandboxRuntime) -> None:
    with pytest.raises(FileNotFoundError):
        await sandbox.spawn(ProcessSpec(argv=["no-such-command"]))
    with pytest.raises(FileNotFoundError):
        await sandbox.spawn(ProcessSpec(argv=["true"], cwd="/no/such/dir"))
    result = await run(sandbox, ["pwd"])
    assert result.stdout == "/workspace\n"


async def test_send_signal_reaches_the_process_group(sandbox: SandboxRuntime) -> None:
    proc = await sandbox.spawn(ProcessSpec(argv=["sh", "-c", "sleep 100 & sleep 100; wait"]))
    assert proc.returncode is None
    await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    result = await collect(proc, timeout=5)
    assert result.status.signal == "SIGKILL"
    assert proc.returncode == 137
    left = await run(sandbox, ["sh", "-c", "ps -eo comm | grep -c sleep"])
    assert left.stdout.strip() == "0"
    proc.send_signal(signal.SIGTERM)  # after the exit: no error


async def test_large_argv_and_many_concurrent_execs(sandbox: SandboxRuntime) -> None:
    big = "x" * 100_000  # one argument may not exceed 128 KiB (MAX_ARG_STRLEN)
    result = await run(sandbox, ["sh", "-c", 'printf %s "$1$2$3" | wc -c', "sh", big, big, big])
    assert result.stdout.strip() == "300000"
    results = await asyncio.gather(*(run(sandbox, ["echo", str(i)]) for i in range(50)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(50)]


async def test_processes_see_each_other(sandbox: SandboxRuntime) -> None:
    proc = await sandbox.spawn(ProcessSpec(argv=["sleep", "30"]))
    result = await run(sandbox, ["sh", "-c", f"cat /proc/{proc.pid}/cmdline | tr '\\0' ' '"])
    assert result.stdout.strip() == "sleep 30"
    proc.send_signal(signal.SIGKILL)
    await collect(proc)


async def test_pty_shell_has_a_controlling_terminal_and_resizes(sandbox: SandboxRuntime) -> None:
    proc = await sandbox.spawn(
        ProcessSpec(argv=["sh", "-c", "tty; stty size; read x; stty size"], pty=(80, 24))
    )
    fd = proc.pty_fd
    assert fd is not None and proc.stdout_fd is None
    out = await read_until(fd, b"24 80")
    assert b"/dev/pts/" in out, out
    assert b"not a tty" not in out
    set_winsize(fd, 100, 40)
    os.write(fd, b"\n")
    out = await read_until(fd, b"40 100")
    status = await proc.wait()
    assert status.exit_code == 0
    os.close(fd)


async def test_pty_job_control(sandbox: SandboxRuntime) -> None:
    proc = await sandbox.spawn(ProcessSpec(argv=["bash", "--norc", "-i"], pty=(80, 24)))
    fd = proc.pty_fd
    assert fd is not None
    os.write(fd, b"sleep 30\n")
    await asyncio.sleep(0.2)
    os.write(fd, b"\x03")  # ^C reaches the foreground job through the tty
    os.write(fd, b"echo after-$?\n")
    out = await read_until(fd, b"after-130")
    assert b"no job control" not in out
    os.write(fd, b"exit\n")
    await proc.wait()
    os.close(fd)


async def test_destroy_kills_survivors_and_removes_everything(
    manager: LocalRuntimeManager, template: Template, settings: RuntimeSettings
) -> None:
    rt = await manager.create("sb-gone", 1, template, {})
    assert isinstance(rt, IsolatedRuntime)
    await run(rt, ["sh", "-c", "setsid nohup sleep 1000 >/dev/null 2>&1 & echo started"])
    await run(rt, ["sh", "-c", "echo data > /workspace/f"])
    host_pids = rt.cgroup.pids()
    assert len(host_pids) >= 3
    cgroup_dirs = list(rt.cgroup.dirs.values())
    await manager.destroy("sb-gone")
    for pid in host_pids:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie_of_other(pid)
    assert not any(d.exists() for d in cgroup_dirs)
    assert not (settings.run_dir / "sb-gone").exists()
    assert not (settings.workspaces_dir / "sb-gone").exists()
    assert rt.state is SandboxState.TERMINATED
    assert "sb-gone" not in manager.list_existing()
    await manager.destroy("sb-gone")  # idempotent


def _is_zombie_of_other(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


async def test_keep_workspace_and_named_volumes(
    manager: LocalRuntimeManager, template: Template, settings: RuntimeSettings
) -> None:
    volume = settings.volumes_dir / "cache"
    with_volumes = template.model_copy(
        update={
            "volume_mounts": [
                VolumeMount(volume="cache", path="/cache"),
                VolumeMount(volume="ro", path="/ref", read_only=True),
            ]
        }
    )
    ref = settings.volumes_dir / "ro"
    ref.mkdir(parents=True)
    (ref / "r").write_text("ref")
    rt = await manager.create("sb-vol", 1, with_volumes, {"cache": volume, "ro": ref})
    result = await run(rt, ["sh", "-c", "echo v > /cache/v && cat /ref/r && touch /ref/x"])
    assert result.stdout == "ref"
    assert "Read-only" in result.stderr
    assert any(m.sandbox_path == "/cache" and m.writable for m in rt.mounts())
    await run(rt, ["sh", "-c", "echo w > /workspace/w"])
    await manager.destroy("sb-vol", keep_workspace=True)
    assert (settings.workspaces_dir / "sb-vol" / "w").read_text() == "w\n"
    assert (volume / "v").read_text() == "v\n"
    await manager.destroy("sb-vol")
    assert not (settings.workspaces_dir / "sb-vol").exists()
    assert (volume / "v").exists()

    # A named volume at /workspace is the workspace, and survives destroy.
    at_ws = template.model_copy(
        update={"volume_mounts": [VolumeMount(volume="proj", path="/workspace")]}
    )
    proj = settings.volumes_dir / "proj"
    rt = await manager.create("sb-proj", 1, at_ws, {"proj": proj})
    await run(rt, ["sh", "-c", "echo p > /workspace/p"])
    assert rt.workspace == proj
    await manager.destroy("sb-proj")
    assert (proj / "p").read_text() == "p\n"


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


async def test_suspend_resume_keeps_processes_and_files_and_stops_cpu(
    manager: LocalRuntimeManager, sandbox: SandboxRuntime
) -> None:
    assert isinstance(sandbox, IsolatedRuntime)
    await run(sandbox, ["sh", "-c", "echo kept > /workspace/k"])
    spinner = await sandbox.spawn(ProcessSpec(argv=["sh", "-c", "while :; do :; done"]))
    await asyncio.sleep(0.2)
    await manager.suspend(sandbox)
    assert sandbox.state is SandboxState.SUSPENDED
    pids = sandbox.cgroup.pids()
    before = _cpu_ticks(pids)
    await asyncio.sleep(0.5)
    assert _cpu_ticks(pids) == before
    await manager.resume(sandbox)
    assert sandbox.state is SandboxState.ACTIVE
    await asyncio.sleep(0.3)
    assert _cpu_ticks(pids) > before
    assert spinner.returncode is None
    result = await run(sandbox, ["cat", "/workspace/k"])
    assert result.stdout == "kept\n"
    spinner.send_signal(signal.SIGKILL)
    assert (await collect(spinner)).status.signal == "SIGKILL"


async def test_exec_into_suspended_sandbox_waits_for_resume(
    manager: LocalRuntimeManager, sandbox: SandboxRuntime
) -> None:
    await manager.suspend(sandbox)
    task = asyncio.ensure_future(run(sandbox, ["echo", "late"]))
    await asyncio.sleep(0.2)
    assert not task.done()
    await manager.resume(sandbox)
    assert (await task).stdout == "late\n"


async def test_adopt_after_dropping_the_manager(
    settings: RuntimeSettings, template: Template
) -> None:
    first = LocalRuntimeManager(settings)
    first.preflight()
    rt = await first.create("sb-adopt", 3, template, {})
    assert isinstance(rt, IsolatedRuntime)
    sleeper = await rt.spawn(ProcessSpec(argv=["sleep", "60"]))
    await first.suspend(rt)
    rt.close()
    del first

    second = LocalRuntimeManager(settings)
    second.preflight()
    assert second.list_existing() == {"sb-adopt"}
    assert await second.adopt("sb-adopt", 2, template) is None  # other generation
    adopted = await second.adopt("sb-adopt", 3, template)
    assert isinstance(adopted, IsolatedRuntime)
    assert adopted.state is SandboxState.SUSPENDED
    assert adopted.fs_ids == rt.fs_ids
    await second.resume(adopted)
    result = await run(adopted, ["sh", "-c", f"cat /proc/{sleeper.pid}/cmdline | tr '\\0' ' '"])
    assert result.stdout.strip() == "sleep 60"

    await second.cleanup_leftovers(set())
    assert second.list_existing() == set()
    assert adopted.state is SandboxState.TERMINATED
    assert await second.adopt("sb-adopt", 3, template) is None
    assert (await sleeper.wait()).signal == "SIGKILL"


async def test_cleanup_keeps_wanted_sandboxes(
    manager: LocalRuntimeManager, template: Template
) -> None:
    await manager.create("sb-keep", 1, template, {})
    await manager.create("sb-drop", 1, template, {})
    await manager.cleanup_leftovers({"sb-keep"})
    assert manager.list_existing() == {"sb-keep"}


async def test_init_death_marks_the_sandbox_failed(sandbox: SandboxRuntime) -> None:
    assert isinstance(sandbox, IsolatedRuntime)
    os.kill(sandbox.init_pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while sandbox.state is not SandboxState.FAILED:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    with pytest.raises(OSError):
        await sandbox.spawn(ProcessSpec(argv=["true"]))


async def test_each_sandbox_has_its_own_host_uid(
    manager: LocalRuntimeManager, template: Template
) -> None:
    a = await manager.create("sb-a", 1, template, {})
    b = await manager.create("sb-b", 1, template, {})
    if os.geteuid() == 0:
        assert a.fs_ids != b.fs_ids
    assert a.fs_ids is not None and a.fs_ids[0] != 0


async def test_create_retry_after_a_crash_mid_create(
    manager: LocalRuntimeManager, template: Template, settings: RuntimeSettings
) -> None:
    (settings.run_dir / "sb-retry").mkdir()
    rt = await manager.create("sb-retry", 1, template, {})
    assert (await run(rt, ["true"])).status.exit_code == 0


def test_preflight_explains_what_is_missing(settings: RuntimeSettings) -> None:
    bad = RuntimeSettings(
        run_dir=settings.run_dir,
        workspaces_dir=settings.workspaces_dir,
        volumes_dir=settings.volumes_dir,
        bwrap="no-such-bwrap",
    )
    with pytest.raises(RuntimeUnavailable, match="apt-get install -y bubblewrap"):
        LocalRuntimeManager(bad).preflight()
    if os.geteuid() == 0:
        root_uid = RuntimeSettings(
            run_dir=settings.run_dir,
            workspaces_dir=settings.workspaces_dir,
            volumes_dir=settings.volumes_dir,
            uid_base=0,
        )
        with pytest.raises(RuntimeUnavailable, match="never 0"):
            LocalRuntimeManager(root_uid).preflight()


async def test_unisolated_mode_only_when_asked(
    settings: RuntimeSettings, template: Template
) -> None:
    direct = RuntimeSettings(
        run_dir=settings.run_dir,
        workspaces_dir=settings.workspaces_dir,
        volumes_dir=settings.volumes_dir,
        mode="unisolated",
    )
    mgr = LocalRuntimeManager(direct)
    mgr.preflight()
    rt = await mgr.create("sb-direct", 1, template, {})
    assert not isinstance(rt, IsolatedRuntime)
    result = await run(rt, ["sh", "-c", "echo $SANDBOX_GREETING"])
    assert result.stdout == "hello\n"
    await mgr.destroy("sb-direct")
    assert mgr.list_existing() == set()


HELLO_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    char cwd[256];
    printf("hello from %s uid=%d etc=%d usr=%d\n", getcwd(cwd, sizeof cwd), getuid(),
           access("/etc/marker", F_OK) == 0, access("/usr", F_OK) == 0);
    return 0;
}
"""


async def test_rootfs_image(
    manager: LocalRuntimeManager, template: Template, data_dir: Path
) -> None:
    """A rootfs without libc: the static init runs, and only the image is visible."""
    rootfs = data_dir / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    (rootfs / "etc" / "marker").write_text("from the image")
    (rootfs / "workspace").mkdir()
    source = data_dir / "hello.c"
    source.write_text(HELLO_C)
    proc = await asyncio.create_subprocess_exec(
        "cc", "-static", "-O1", "-o", str(rootfs / "bin" / "hello"), str(source)
    )
    assert await proc.wait() == 0
    for path in [rootfs, *rootfs.rglob("*")]:
        path.chmod(0o755)
    image = template.model_copy(update={"image": str(rootfs)})
    rt = await manager.create("sb-rootfs", 1, image, {})
    result = await run(rt, ["/bin/hello"])
    assert result.stdout == "hello from /workspace uid=1000 etc=1 usr=0\n", result
    assert _host_root_for(rt, "/bin/hello") == rootfs


def _host_root_for(rt: SandboxRuntime, sandbox_path: str) -> Path:
    best = max(
        (m for m in rt.mounts() if sandbox_path.startswith(m.sandbox_path)),
        key=lambda m: len(m.sandbox_path),
    )
    return best.host_path


async def test_traversable_data_dir_needs_no_staging(template: Template) -> None:
    """The usual server layout (/var/lib/sandlot): bubblewrap binds the paths directly."""
    root = Path(tempfile.mkdtemp(prefix="sandlot-open-", dir="/tmp"))
    try:
        root.chmod(0o711)
        settings = RuntimeSettings(
            run_dir=root / "run", workspaces_dir=root / "ws", volumes_dir=root / "vol"
        )
        mgr = LocalRuntimeManager(settings)
        mgr.preflight()
        rt = await mgr.create("sb-open", 1, template, {})
        result = await run(rt, ["sh", "-c", "echo hi > /workspace/f && cat /workspace/f"])
        assert result.stdout == "hi\n"
        await mgr.cleanup_leftovers(set())
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_sandboxes_of_a_vanished_data_dir_are_swept(
    manager: LocalRuntimeManager, template: Template, data_dir: Path
) -> None:
    gone = data_dir / "gone"
    other = LocalRuntimeManager(
        RuntimeSettings(run_dir=gone / "run", workspaces_dir=gone / "ws", volumes_dir=gone / "vol")
    )
    other.preflight()
    rt = await other.create("sb-orphan", 1, template, {})
    assert isinstance(rt, IsolatedRuntime)
    rt.close()
    cgroup_dirs = list(rt.cgroup.dirs.values())
    shutil.rmtree(gone)  # its server crashed and its directory was removed
    await manager.cleanup_leftovers(set())
    assert not any(d.exists() for d in cgroup_dirs)
    assert not any(d.parent.exists() for d in cgroup_dirs)
    assert not Path(f"/proc/{rt.init_pid}").exists() or _is_zombie_of_other(rt.init_pid)

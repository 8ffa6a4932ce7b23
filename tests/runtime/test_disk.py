"""The per-sandbox disk limit (template ``resources.disk_mb``) on real sandboxes.

A sandbox's ``/workspace`` and ``/tmp`` share one size-limited filesystem: a
command writing past it gets ENOSPC, the host's filesystem takes no more than
the limit, the limit holds through suspend/resume and a server restart, and a
deleted sandbox leaves no image, mount or loop device. Through a real
``sandlot serve``: a write through the dataplane gets 429 QUOTA_EXCEEDED and the
sandbox's event log says the disk is full.

The host's share is measured as the blocks allocated to the sandbox's files on
the host filesystem (the image included), not as the filesystem's free space,
which other work on the machine moves at the same time.
"""

# Probes read /proc, /sys and the host's files directly: instant, and the point of the test.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandlot.protocol.sessions import Resources, Template
from sandlot.runtime.base import SandboxRuntime
from sandlot.runtime.disk import MOUNT_ROOT, loops_backed_by, mounts_of
from sandlot.runtime.local import IsolatedRuntime, LocalRuntimeManager, RuntimeSettings
from tests.broker.test_e2e import wait_active
from tests.runtime.conftest import require_isolation, run
from tests.servers import SandlotServer

pytestmark = pytest.mark.isolation

MIB = 1 << 20
NO_SPACE = "No space left on device"


@pytest.fixture
def disk_template() -> Template:
    return Template(
        name="disk", image="host", resources=Resources(memory_mb=256, pids=128, disk_mb=64)
    )


def host_allocated(paths: list[Path]) -> int:
    """Bytes allocated on the host's filesystem to the files under ``paths`` (not crossing
    into other filesystems, such as the sandbox's disk itself)."""
    total = 0
    for root in paths:
        if not root.exists():
            continue
        dev = os.lstat(root).st_dev
        if root.is_file():
            total += os.lstat(root).st_blocks * 512
            continue
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.lstat(os.path.join(dirpath, d)).st_dev == dev]
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if st.st_dev == dev:
                    total += st.st_blocks * 512
    return total


def sandbox_files(settings: RuntimeSettings, sandbox_id: str) -> list[Path]:
    return [
        settings.workspaces_dir,
        settings.run_dir / sandbox_id,
        settings.run_dir / ".disks" / f"{sandbox_id}.img",
    ]


async def assert_full_at(rt: SandboxRuntime, directory: str) -> None:
    """Writing 100 MB into ``directory`` stops at the disk's end, and the space comes back."""
    result = await run(rt, ["sh", "-c", f"head -c 100M /dev/zero > {directory}/big"])
    assert result.status.exit_code != 0, result
    assert NO_SPACE in result.stderr
    written = await run(rt, ["sh", "-c", f"stat -c %s {directory}/big; rm {directory}/big"])
    assert 32 * MIB < int(written.stdout) <= 64 * MIB


def mountpoint_of(settings: RuntimeSettings, sandbox_id: str) -> Path:
    return MOUNT_ROOT / LocalRuntimeManager(settings).tag / sandbox_id


def disk_leftovers(settings: RuntimeSettings, sandbox_id: str) -> list[str]:
    """What remains of a sandbox's disk on the host: image, mount (point), loop device."""
    image = settings.run_dir / ".disks" / f"{sandbox_id}.img"
    mountpoint = mountpoint_of(settings, sandbox_id)
    found = [str(image)] if image.exists() else []
    found += [str(m) for m in mounts_of(set(loops_backed_by(settings.run_dir)))]
    found += [str(mountpoint)] if mountpoint.exists() else []
    found += list(loops_backed_by(image))
    return found


async def wait_no_leftovers(settings: RuntimeSettings, sandbox_id: str) -> None:
    # A loop device goes with its last user; the kernel may take a moment after the unmount.
    deadline = time.monotonic() + 10
    while disk_leftovers(settings, sandbox_id):
        assert time.monotonic() < deadline, disk_leftovers(settings, sandbox_id)
        await asyncio.sleep(0.05)


async def test_full_disk_gives_enospc_in_workspace_and_tmp(
    manager: LocalRuntimeManager, settings: RuntimeSettings, disk_template: Template
) -> None:
    rt = await manager.create("sb-disk", 1, disk_template, {})
    before = host_allocated(sandbox_files(settings, "sb-disk"))
    await assert_full_at(rt, "/workspace")
    await assert_full_at(rt, "/tmp")
    # Both directories are one filesystem: what /tmp holds is gone from /workspace.
    await run(rt, ["sh", "-c", "head -c 40M /dev/zero > /tmp/forty"])
    result = await run(rt, ["sh", "-c", "head -c 40M /dev/zero > /workspace/forty"])
    assert NO_SPACE in result.stderr
    grown = host_allocated(sandbox_files(settings, "sb-disk")) - before
    assert grown <= 64 * MIB, f"the host took {grown / MIB:.1f} MiB"
    # The dataplane reaches both through host paths on the same disk.
    hosts = {m.sandbox_path: m.host_path for m in rt.mounts()}
    assert os.stat(hosts["/tmp"]).st_dev == os.stat(hosts["/workspace"]).st_dev
    assert os.stat(hosts["/workspace"]).st_dev != os.stat(settings.workspaces_dir).st_dev
    assert (hosts["/tmp"] / "forty").stat().st_size == 40 * MIB
    size, free = rt.disk_usage() or (0, 0)
    assert 56 * MIB < size <= 64 * MIB and free < 24 * MIB


async def test_the_limit_holds_through_suspend_resume_and_restarts(
    manager: LocalRuntimeManager, settings: RuntimeSettings, disk_template: Template
) -> None:
    rt = await manager.create("sb-keep", 1, disk_template, {})
    await run(rt, ["sh", "-c", "echo kept > /workspace/note"])
    await manager.suspend(rt)
    await manager.resume(rt)
    await assert_full_at(rt, "/workspace")

    # A restarted server (the old one gone without a word, as after kill -9).
    assert isinstance(rt, IsolatedRuntime)
    rt.close()
    second = LocalRuntimeManager(settings)
    second.preflight()
    adopted = await second.adopt("sb-keep", 1, disk_template)
    assert adopted is not None
    assert (await run(adopted, ["cat", "/workspace/note"])).stdout == "kept\n"
    await assert_full_at(adopted, "/tmp")

    # The host's mount gone too (an operator's umount): re-adoption mounts the disk
    # again from the loop device the sandbox still holds, never a second copy.
    assert isinstance(adopted, IsolatedRuntime)
    adopted.close()
    mountpoint = mountpoint_of(settings, "sb-keep")
    subprocess.run(["umount", "--lazy", str(mountpoint)], check=True)
    assert not os.path.ismount(mountpoint)
    third = LocalRuntimeManager(settings)
    third.preflight()
    again = await third.adopt("sb-keep", 1, disk_template)
    assert again is not None and os.path.ismount(mountpoint)
    assert len(loops_backed_by(settings.run_dir / ".disks" / "sb-keep.img")) == 1
    await run(again, ["sh", "-c", "echo inside > /workspace/inside"])
    assert (again.workspace / "inside").read_text() == "inside\n"
    (again.workspace / "outside").write_text("outside\n")
    assert (await run(again, ["cat", "/workspace/outside"])).stdout == "outside\n"
    await assert_full_at(again, "/workspace")
    await third.destroy("sb-keep")
    await wait_no_leftovers(settings, "sb-keep")


async def test_delete_and_crash_cleanup_leave_no_image_mount_or_loop(
    manager: LocalRuntimeManager, settings: RuntimeSettings, disk_template: Template
) -> None:
    rt = await manager.create("sb-gone", 1, disk_template, {})
    await run(rt, ["sh", "-c", "head -c 8M /dev/zero > /workspace/f; echo x > /tmp/t"])
    assert disk_leftovers(settings, "sb-gone"), "the sandbox has no disk of its own"
    await manager.destroy("sb-gone")
    assert not (settings.workspaces_dir / "sb-gone").exists()
    await wait_no_leftovers(settings, "sb-gone")

    # A disk mounted in a second place too (an older version mounted it in the workspaces
    # directory): a delete unmounts it there as well.
    await manager.create("sb-twice", 1, disk_template, {})
    device = next(iter(loops_backed_by(settings.run_dir / ".disks" / "sb-twice.img")))
    elsewhere = settings.workspaces_dir / "sb-twice"
    subprocess.run(["mount", device, str(elsewhere)], check=True)
    await manager.destroy("sb-twice")
    assert not elsewhere.exists()
    await wait_no_leftovers(settings, "sb-twice")

    # A server that died with sandboxes running: the next one removes what it does not keep.
    rt = await manager.create("sb-orphan", 1, disk_template, {})
    assert isinstance(rt, IsolatedRuntime)
    rt.close()
    successor = LocalRuntimeManager(settings)
    successor.preflight()
    assert "sb-orphan" in successor.list_existing()
    await successor.cleanup_leftovers(set())
    assert successor.list_existing() == set()
    await wait_no_leftovers(settings, "sb-orphan")

    # A disk still mounted whose image someone deleted (a test's temporary directory
    # removed under a server, say) is still found, and unmounted.
    plain = settings.workspaces_dir / "sb-stray"
    disk = successor._disks.provide("sb-stray", 16, os.getuid(), os.getgid(), workspace=plain)
    assert disk is not None
    disk.image.unlink()
    assert successor.list_existing() == {"sb-stray"}
    await successor.cleanup_leftovers(set())
    await wait_no_leftovers(settings, "sb-stray")
    assert not disk.mountpoint.exists()
    # The same, the directory gone with it and no server left to ask: any server's start
    # unmounts disks whose image is gone.
    disk = successor._disks.provide("sb-lost", 16, os.getuid(), os.getgid(), workspace=None)
    assert disk is not None
    disk.image.unlink()
    LocalRuntimeManager(settings).preflight()
    await wait_no_leftovers(settings, "sb-lost")


# --- through sandlot serve ------------------------------------------------------------

CONFIG = """
[templates.small]
image = "host"
resources = { cpu = 1.0, memory_mb = 512, pids = 256, disk_mb = 64 }
shells = { default = ["/bin/sh"] }
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SandlotServer]:
    require_isolation()
    srv = SandlotServer(tmp_path / "d", config=CONFIG, mode="isolated").start()
    try:
        yield srv
    finally:
        srv.stop()
        srv.cleanup()


def ensure(srv: SandlotServer, headers: dict[str, str]) -> dict[str, str]:
    r = httpx.post(
        f"{srv.url}/v1/sandbox/sessions",
        json={"scope": {"type": "thread", "id": "thr_disk"}, "mode": "ensure", "template": "small"},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    grant = r.json()
    wait_active(srv.url, headers, grant)
    return {
        "session": grant["session_id"],
        "base": grant["dataplane"]["http_base_url"],
        "sandbox": grant["sandbox"]["id"],
        "auth": f"Bearer {grant['token']}",
    }


def exec_(box: dict[str, str], command: str) -> dict[str, object]:
    r = httpx.post(
        f"{box['base']}/exec",
        json={"command": command, "timeout_seconds": 30},
        headers={"Authorization": box["auth"]},
        timeout=40,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def next_event(box: dict[str, str], event_type: str, after: int, timeout: float = 10) -> dict:
    """The first event of ``event_type`` after sequence ``after`` (waits for it)."""
    deadline = time.monotonic() + timeout
    with httpx.stream(
        "GET",
        f"{box['base']}/events?after={after}",
        headers={"Authorization": box["auth"]},
        timeout=timeout,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["event_type"] == event_type:
                    return dict(ev)
            assert time.monotonic() < deadline, f"no {event_type} event"
    raise AssertionError(f"the event stream ended before {event_type}")


def upload(box: dict[str, str], path: str, size: int) -> httpx.Response:
    def body() -> Iterator[bytes]:
        chunk = bytes(MIB)
        for _ in range(size // MIB):
            yield chunk

    return httpx.post(
        f"{box['base']}/files/upload",
        params={"path": path},
        content=body(),
        headers={"Authorization": box["auth"]},
        timeout=60,
    )


def test_serve_full_disk_typed_error_event_and_restart(server: SandlotServer) -> None:
    headers = server.headers("alice")
    box = ensure(server, headers)

    # A command fills the disk: ENOSPC for it, and the event log says so.
    out = exec_(box, "head -c 100M /dev/zero > /workspace/big")
    assert out["exit_code"] != 0 and NO_SPACE in str(out["stderr"])
    full = next_event(box, "service.disk_full", 0)
    assert full["details"]["service"]["name"] == "disk"
    assert full["details"]["service"]["source"] == "watch"
    exec_(box, "rm /workspace/big")
    available = next_event(box, "service.disk_available", full["sequence"])

    # A write through the dataplane: the typed error, and the event at once.
    r = upload(box, "/workspace/upload.bin", 80 * MIB)
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "QUOTA_EXCEEDED" and error["retryable"] is False
    assert error["metadata"] == {"resource": "disk"}
    full = next_event(box, "service.disk_full", available["sequence"])
    assert full["details"]["service"]["source"] == "api"
    assert upload(box, "/workspace/small.bin", 4 * MIB).status_code == 201

    # kill -9 of the server, restart: the sandbox is re-adopted with its limit.
    server.kill9()
    server.restart()
    box = ensure(server, headers)
    out = exec_(box, "ls /workspace; head -c 100M /dev/zero > /tmp/big")
    assert "small.bin" in str(out["stdout"])
    assert out["exit_code"] != 0 and NO_SPACE in str(out["stderr"])

    # Delete: nothing of the disk is left on the host.
    sandbox = box["sandbox"]
    r = httpx.delete(
        f"{server.url}/v1/sandbox/sessions/{box['session']}?terminate=true",
        headers=headers,
        timeout=30,
    )
    assert r.status_code in (200, 202, 204), r.text
    settings = RuntimeSettings(
        run_dir=server.data_dir / "run",
        workspaces_dir=server.data_dir / "workspaces",
        volumes_dir=server.data_dir / "volumes",
    )
    deadline = time.monotonic() + 20
    while disk_leftovers(settings, sandbox) or (settings.workspaces_dir / sandbox).exists():
        assert time.monotonic() < deadline, disk_leftovers(settings, sandbox)
        time.sleep(0.1)


async def test_a_workspace_from_before_disk_limits_is_kept_not_hidden(
    manager: LocalRuntimeManager, settings: RuntimeSettings, disk_template: Template
) -> None:
    # A sandbox made by an older server, re-created after a crash: its files stay visible.
    old = settings.workspaces_dir / "sb-old"
    old.mkdir(parents=True)
    (old / "notes.txt").write_text("mine\n")
    rt = await manager.create("sb-old", 1, disk_template, {})
    assert (await run(rt, ["cat", "/workspace/notes.txt"])).stdout == "mine\n"
    assert rt.disk_usage() is None
    await manager.destroy("sb-old")
    assert not old.exists()


async def test_a_create_cancelled_while_its_disk_is_made_leaves_nothing(
    manager: LocalRuntimeManager,
    settings: RuntimeSettings,
    disk_template: Template,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sandbox deleted while it is being created: the provider cancels the create,
    # waits for it, then destroys. The disk is made in a thread that a cancel cannot
    # stop; held up here so that the cancel lands while it runs.
    disks = manager._disks
    provide = disks.provide
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_provide(*args: object, **kw: object) -> object:
        loop.call_soon_threadsafe(started.set)
        time.sleep(0.5)
        return provide(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(disks, "provide", slow_provide)
    task = asyncio.ensure_future(manager.create("sb-cancel", 1, disk_template, {}))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await manager.destroy("sb-cancel")
    await asyncio.sleep(0.6)  # past the moment a stray thread would have mounted it
    await wait_no_leftovers(settings, "sb-cancel")
    assert not (settings.workspaces_dir / "sb-cancel").exists()

"""Local sandboxes: bubblewrap namespaces + cgroups + seccomp, managed for the local provider.

A sandbox is one long-lived init (``init.c``) started by bubblewrap from an
unprivileged host uid (``uid_base + n`` when the server is root, else the
server's own uid) in new user, mount, pid, ipc, uts and (by default) network
namespaces, inside its own cgroup. Every exec and shell is forked by that init
on request, so it inherits the namespaces, cgroup, seccomp filter and dropped
capabilities. Sandboxes do not die with the server (bubblewrap's
``--die-with-parent`` is tied to the spawning thread, and a crash must not take
the user's work down): a restarted server re-adopts them from their cgroup and
run directory, and removes what it does not want to keep.

Per sandbox, on the host::

    run_dir/<id>/state.json   uid, generation, workspace, volumes (for adopt/destroy)
    run_dir/<id>/ctl          the init's control socket (never visible inside)
    run_dir/<id>/tmp/         the sandbox's /tmp
    run_dir/<id>/launch.log   bubblewrap's and the init's error output
    workspaces_dir/<id>/      /workspace, unless a named volume is mounted there
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandlot.protocol.states import SandboxState
from sandlot.protocol.templates import NetworkMode, Template
from sandlot.runtime.artifacts import ArtifactUnavailable
from sandlot.runtime.base import (
    WORKSPACE,
    SandboxRuntime,
)
from sandlot.runtime.bwrap import (
    STAGE_DIR,
    BindMount,
    build_host_etc,
    bwrap_args,
    image_entries,
)
from sandlot.runtime.cgroups import CgroupError, CgroupLayout, Limits, SandboxCgroup
from sandlot.runtime.control import INIT_PROTOCOL
from sandlot.runtime.direct import DirectRuntime
from sandlot.runtime.disk import MOUNT_ROOT, DiskManager, in_thread
from sandlot.runtime.initbin import export_seccomp, init_binary
from sandlot.runtime.isolated import IsolatedRuntime, SandboxRecord, find_init
from sandlot.runtime.preflight import (
    RuntimeUnavailable,
    check_platform,
    check_uid_range,
    check_user_namespaces,
    find_bwrap,
)
from sandlot.runtime.tools import TOOLS_DIR, host_limit, prepare_tools_dir

__all__ = [
    "IsolatedRuntime",
    "LocalRuntimeManager",
    "RuntimeSettings",
    "RuntimeUnavailable",
    "SandboxStartError",
]

_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
READY_TIMEOUT = 10.0
#: ``<tag>`` → the run dir of the server that owns ``sandlot-<tag>`` cgroups (root only).
TAG_REGISTRY = Path("/run/sandlot/tags")


@dataclass(frozen=True)
class RuntimeSettings:
    """Where the local runtime keeps its state, and how it isolates.

    ``run_dir`` holds one directory per sandbox (and the helper programs they bind);
    ``workspaces_dir`` the workspaces, ``volumes_dir`` the named volumes.
    ``mode="unisolated"`` runs plain subprocesses (no isolation; only when
    asked for explicitly). ``uid_base``/``uid_count``: the host uids given to
    sandboxes when the server runs as root, one per sandbox.
    """

    run_dir: Path
    workspaces_dir: Path
    volumes_dir: Path
    mode: Literal["isolated", "unisolated"] = "isolated"
    bwrap: str = "bwrap"
    uid_base: int = 2_000_000
    uid_count: int = 60_000


class SandboxStartError(RuntimeError):
    """bubblewrap or the sandbox init failed; the message carries their error output."""


async def _wait_readable(fd: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await asyncio.wait_for(waiter, timeout)
    finally:
        loop.remove_reader(fd)


def _vanished_servers(layout: CgroupLayout) -> list[str]:
    """Tags of other servers whose run dir is gone: nobody can adopt or delete their
    sandboxes any more. Servers not in the registry are not ours to judge."""
    vanished = []
    for tag in layout.other_tags():
        try:
            run_dir = (TAG_REGISTRY / tag).read_text()
        except OSError:
            continue
        if not os.path.exists(run_dir):
            vanished.append(tag)
    return vanished


def _world_traversable(path: Path) -> bool:
    """Whether any uid can reach ``path`` (else the launcher stages it: a mount
    namespace of its own costs several milliseconds per create)."""
    return all(p.stat().st_mode & 0o001 for p in path.parents)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)


def _rmtree(path: Path) -> None:
    def fix_and_retry(func: object, p: str, exc_info: object) -> None:
        # A non-root server cannot delete inside a directory the sandbox made read-only.
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)

    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=fix_and_retry)


class LocalRuntimeManager:
    """Creates, adopts, suspends and destroys the sandboxes of this host for the local provider."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self._is_root = os.geteuid() == 0
        resolved = str(settings.run_dir.resolve())
        digest = hashlib.sha256(resolved.encode()).digest()
        #: Tells this server's cgroups apart from other servers' on the same host.
        self.tag = digest.hex()[:10]
        self._uid_offset = int.from_bytes(digest[:4], "big") % max(1, settings.uid_count)
        self._prepared = False
        self._layout: CgroupLayout | None = None
        self._bwrap = ""
        self._init_binary = Path()
        self._seccomp = b""
        self._etc = settings.run_dir / ".etc"
        self._runtimes: dict[str, IsolatedRuntime] = {}
        self._uids_in_use: set[int] = set()
        #: ripgrep and its launcher, bound read-only into every sandbox (``tools.py``).
        self._tools: Path | None = None
        #: Size-limited disks for the workspace and /tmp (``disk.py``).
        self._disks = DiskManager(
            settings.run_dir / ".disks", MOUNT_ROOT / self.tag, settings.workspaces_dir
        )

    # --- preflight ------------------------------------------------------------------

    def preflight(self) -> None:
        """Check that sandboxes can be made here; raises :class:`RuntimeUnavailable`."""
        for d in (self.settings.run_dir, self.settings.workspaces_dir, self.settings.volumes_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RuntimeUnavailable(f"cannot create {d}: {exc.strerror}") from exc
        if self.settings.mode == "unisolated":
            host_limit()  # said at start if the launcher is unavailable
            self._prepared = True
            return
        check_platform()
        if self._is_root and not STAGE_DIR.is_dir():
            raise RuntimeUnavailable(f"{STAGE_DIR} is missing: sandbox mounts are staged there")
        bwrap = find_bwrap(self.settings.bwrap)
        check_user_namespaces()
        check_uid_range(self._is_root, self.settings.uid_base, self.settings.uid_count)
        binary = init_binary()
        seccomp = export_seccomp(binary)
        try:
            layout = CgroupLayout(self.tag)
            layout.ensure_parents()
            probe = layout.sandbox(f".preflight-{os.getpid()}")
            probe.create(Limits(memory_bytes=64 << 20, pids=16, cpu=0.5))
            probe.thaw()
            _remove_probe(probe)
            # Parents exist only while sandboxes do; the first create makes them again.
            layout.remove_parents_if_empty()
        except (CgroupError, OSError) as exc:
            hint = (
                "run the server as root"
                if not self._is_root
                else "check that the cgroup filesystem is mounted read-write"
            )
            raise RuntimeUnavailable(
                f"cgroup controllers (memory, pids, cpu, freezer) are not writable: {exc}; "
                f"{hint}, or delegate a cgroup v2 subtree to this user "
                "(or use the explicit 'unisolated' mode)"
            ) from exc
        build_host_etc(self._etc)
        try:
            self._tools = prepare_tools_dir(self.settings.run_dir / ".tools")
        except ArtifactUnavailable as exc:
            raise RuntimeUnavailable(f"the helper launcher is unavailable: {exc}") from None
        self._bwrap, self._init_binary, self._seccomp, self._layout = bwrap, binary, seccomp, layout
        self._trial(binary, bwrap)
        self._disks.prepare()
        self._prepared = True

    def _trial(self, binary: Path, bwrap: str) -> None:
        """Start a throwaway namespace sandbox the way real ones start, to catch what
        only the kernel can tell (user namespaces refused, setuid blocked)."""
        uid, gid = self._ids_for(self.settings.uid_base + self._uid_offset)
        args = [
            "--unshare-user",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-net",
            "--disable-userns",
            "--proc",
            "/proc",
        ]
        for sandbox_path, host_path in image_entries("host"):
            if host_path.is_symlink():
                args += ["--symlink", os.readlink(host_path), sandbox_path]
            else:
                args += ["--ro-bind", str(host_path), sandbox_path]
        args_fd = os.memfd_create("bwrap-args", 0)
        try:
            os.write(args_fd, b"".join(a.encode() + b"\0" for a in args))
            os.lseek(args_fd, 0, os.SEEK_SET)
            result = subprocess.run(
                [
                    str(binary),
                    "launch",
                    str(uid),
                    str(gid),
                    bwrap,
                    str(args_fd),
                    "0",  # fds kept
                    "0",  # cgroups joined
                    "0",  # sources staged
                    "/usr/bin/true",
                ],
                pass_fds=(args_fd,),
                capture_output=True,
                text=True,
                env={},
                check=False,
                timeout=10,
            )
        finally:
            os.close(args_fd)
        if result.returncode != 0 or result.stderr.strip():
            raise RuntimeUnavailable(
                "a trial sandbox failed to start (user namespaces, or the sandbox uid): "
                + (result.stderr.strip() or f"exit status {result.returncode}")
            )

    def _register(self, present: bool) -> None:
        """Lets other servers recognise this one's cgroups once its data dir is gone."""
        if not self._is_root:
            return
        with contextlib.suppress(OSError):
            if present:
                TAG_REGISTRY.mkdir(parents=True, exist_ok=True)
                (TAG_REGISTRY / self.tag).write_text(str(self.settings.run_dir.resolve()))
            else:
                (TAG_REGISTRY / self.tag).unlink()

    def _require(self) -> CgroupLayout:
        if not self._prepared:
            self.preflight()
        assert self._layout is not None
        return self._layout

    # --- bookkeeping ----------------------------------------------------------------

    def _ids_for(self, uid: int) -> tuple[int, int]:
        if not self._is_root:
            return os.getuid(), os.getgid()
        return uid, uid

    def _allocate_uid(self) -> int:
        if not self._is_root:
            return os.getuid()
        if not self._uids_in_use:
            for sid in self._run_entries():
                rec = SandboxRecord.load(self.settings.run_dir / sid / "state.json")
                if rec is not None:
                    self._uids_in_use.add(rec.uid)
        base, count = self.settings.uid_base, self.settings.uid_count
        for i in range(count):
            uid = base + (self._uid_offset + i) % count
            if uid not in self._uids_in_use:
                self._uids_in_use.add(uid)
                return uid
        raise SandboxStartError(f"all {count} sandbox uids from {base} are in use")

    def _run_entries(self) -> set[str]:
        try:
            return {
                e.name
                for e in os.scandir(self.settings.run_dir)
                if e.is_dir(follow_symlinks=False) and _SANDBOX_ID.match(e.name)
            }
        except FileNotFoundError:
            return set()

    def list_existing(self) -> set[str]:
        """Sandboxes with a run directory or a cgroup on this host (from this data dir)."""
        names = self._run_entries() | self._disks.existing()
        if self.settings.mode == "isolated":
            with contextlib.suppress(CgroupError, RuntimeUnavailable):
                names |= {n for n in self._require().existing() if _SANDBOX_ID.match(n)}
        return names

    async def cleanup_leftovers(self, keep: set[str]) -> None:
        """Destroy every sandbox of this data dir not in ``keep`` (after a crash).

        Also kills the sandboxes of servers whose data dir no longer exists
        (nobody could ever adopt or delete them; a removed test directory, say).
        """
        for sandbox_id in sorted(self.list_existing() - keep):
            await self.destroy(sandbox_id)
        if self.settings.mode != "isolated":
            return
        layout = self._require()
        if not self.list_existing():
            layout.remove_parents_if_empty()
            self._register(False)
        for tag in _vanished_servers(layout):
            orphans = CgroupLayout(tag)
            for name in orphans.existing():
                cgroup = orphans.sandbox(name)
                await cgroup.kill_all()
                await cgroup.remove()
            orphans.remove_parents_if_empty()
            with contextlib.suppress(OSError):
                images = Path((TAG_REGISTRY / tag).read_text()) / ".disks"
                DiskManager(images, MOUNT_ROOT / tag, Path()).release_all()
            with contextlib.suppress(OSError):
                (TAG_REGISTRY / tag).unlink()

    # --- lifecycle ------------------------------------------------------------------

    async def create(
        self,
        sandbox_id: str,
        generation: int,
        template: Template,
        volumes: Mapping[str, Path],
    ) -> SandboxRuntime:
        """Start a sandbox and return once its init accepts commands."""
        if not _SANDBOX_ID.match(sandbox_id):
            raise ValueError(f"invalid sandbox id {sandbox_id!r}")
        if self.settings.mode == "isolated":
            self._require()
        run = self.settings.run_dir / sandbox_id
        if sandbox_id in self._runtimes or run.exists():
            # A retry after a crash mid-create: start clean, keep the user's files.
            await self.destroy(sandbox_id, keep_workspace=True)
        uid, gid = self._ids_for(self._allocate_uid())
        try:
            record = self._prepare_dirs(sandbox_id, generation, template, volumes, uid, gid)
            if self._disks.available and template.resources.disk_mb:
                await in_thread(self._provide_disk, sandbox_id, record, template)
                record.save(run / "state.json")
            if self.settings.mode == "unisolated":
                return DirectRuntime(
                    sandbox_id,
                    generation,
                    template,
                    Path(record.workspace),
                    tmp=run / "tmp",
                )
            runtime = await self._launch(sandbox_id, generation, template, record)
        except BaseException:
            await asyncio.shield(self.destroy(sandbox_id, keep_workspace=True))
            raise
        self._runtimes[sandbox_id] = runtime
        return runtime

    def _prepare_dirs(
        self,
        sandbox_id: str,
        generation: int,
        template: Template,
        volumes: Mapping[str, Path],
        uid: int,
        gid: int,
    ) -> SandboxRecord:
        run = self.settings.run_dir / sandbox_id
        # Traversable (not listable): a non-root server's bubblewrap binds from here by path.
        run.mkdir(mode=0o711)
        tmp = run / "tmp"
        tmp.mkdir()
        os.chown(tmp, uid, gid)
        tmp.chmod(0o1777)
        mounted: list[tuple[str, str, bool]] = []
        workspace: Path | None = None
        for vm in template.volume_mounts:
            if vm.volume not in volumes:
                raise ValueError(f"volume {vm.volume!r} of template {template.name!r} not given")
            host = Path(volumes[vm.volume])
            host.mkdir(parents=True, exist_ok=True)
            if not vm.read_only and host.stat().st_uid != uid:
                # Named volumes outlive sandboxes, and each sandbox has its own uid.
                _chown_tree(host, uid, gid)
            mounted.append((vm.path.rstrip("/") or "/", str(host), not vm.read_only))
            if vm.path.rstrip("/") == WORKSPACE:
                workspace = host
        if workspace is None:
            workspace = self.settings.workspaces_dir / sandbox_id
            workspace.mkdir(mode=0o755, exist_ok=True)
            if workspace.stat().st_uid != uid:
                _chown_tree(workspace, uid, gid)
        image = template.image
        if image != "host" and not Path(image).is_dir():
            raise ValueError(f"image {image!r} is neither 'host' nor a rootfs directory")
        record = SandboxRecord(
            generation=generation,
            mode=self.settings.mode,
            uid=uid,
            gid=gid,
            workspace=str(workspace),
            image=image,
            volumes=mounted,
            init_protocol=INIT_PROTOCOL,
        )
        record.save(run / "state.json")
        return record

    def _provide_disk(self, sandbox_id: str, record: SandboxRecord, template: Template) -> None:
        """Mount the sandbox's size-limited disk; the workspace and /tmp move onto it."""
        size = template.resources.disk_mb or 0
        on_disk = all(path != WORKSPACE for path, _, _ in record.volumes)
        plain = Path(record.workspace) if on_disk else None
        disk = self._disks.provide(sandbox_id, size, record.uid, record.gid, workspace=plain)
        if disk is None:
            return
        if on_disk:
            record.workspace = str(disk.workspace)
        record.tmp, record.disk_mb = str(disk.tmp), size

    async def _launch(
        self, sandbox_id: str, generation: int, template: Template, record: SandboxRecord
    ) -> IsolatedRuntime:
        layout = self._require()
        run = self.settings.run_dir / sandbox_id
        cgroup = layout.sandbox(sandbox_id)
        res = template.resources
        limits = Limits(memory_bytes=res.memory_mb << 20, pids=res.pids, cpu=res.cpu)
        try:
            cgroup.create(limits)
        except FileNotFoundError:
            # The parents went with the last sandbox (cleanup_leftovers).
            self._register(True)
            layout.ensure_parents()
            cgroup.create(limits)

        opened: list[int] = []

        def keep(fd: int) -> int:
            opened.append(fd)
            return fd

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            run_fd = keep(os.open(run, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            ctl = str(run / "ctl")
            listener.bind(ctl if len(ctl) < 100 else f"/proc/self/fd/{run_fd}/ctl")
            os.chmod("ctl", 0o600, dir_fd=run_fd)
            ready_r, ready_w = os.pipe()
            keep(ready_r)
            keep(ready_w)

            staged: list[str] = []

            def source(path: str | Path, name: str) -> Path:
                # A non-root server's sandboxes share its uid, which can walk its own tree.
                if not self._is_root or _world_traversable(Path(path)):
                    return Path(path)
                staged.extend([str(path), name])
                return STAGE_DIR / name

            mounts = [
                BindMount(source(record.tmp_dir(run), "tmp"), "/tmp", True),
                BindMount(source(record.workspace, "workspace"), WORKSPACE, True),
            ]
            mounts += [
                BindMount(source(host, f"volume{i}"), path, writable)
                for i, (path, host, writable) in enumerate(record.volumes)
                if path != WORKSPACE
            ]
            if self._tools is not None:
                mounts.append(BindMount(source(self._tools, "tools"), TOOLS_DIR, False))
            host_image = record.image == "host"
            etc = source(self._etc, "etc") if host_image else None
            image_root = None if host_image else source(record.image, "image")
            init_fd = keep(os.open(self._init_binary, os.O_RDONLY | os.O_CLOEXEC))
            seccomp_fd = keep(os.memfd_create("seccomp", os.MFD_CLOEXEC))
            os.write(seccomp_fd, self._seccomp)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            args, command = bwrap_args(
                image=record.image,
                image_root=image_root,
                etc=etc,
                mounts=mounts,
                share_net=template.network is NetworkMode.HOST,
                seccomp_fd=seccomp_fd,
                init_fd=init_fd,
                listen_fd=listener.fileno(),
                ready_fd=ready_w,
            )
            args_fd = keep(os.memfd_create("bwrap-args", os.MFD_CLOEXEC))
            os.write(args_fd, b"".join(a.encode() + b"\0" for a in args))
            os.lseek(args_fd, 0, os.SEEK_SET)
            log_fd = keep(
                os.open(run / "launch.log", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            )
            null_fd = keep(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
            passed = [
                listener.fileno(),
                ready_w,
                seccomp_fd,
                init_fd,
            ]
            argv = [
                "sandlot-init",
                "launch",
                str(record.uid),
                str(record.gid),
                self._bwrap,
                str(args_fd),
                str(len(passed)),
                *map(str, passed),
                str(len(cgroup.procs_files)),
                *map(str, cgroup.procs_files),
                str(len(staged) // 2),
                *staged,
                *command,
            ]
            actions = [
                (os.POSIX_SPAWN_DUP2, null_fd, 0),
                (os.POSIX_SPAWN_DUP2, null_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
                # dup2 onto itself clears close-on-exec in the child only.
                *((os.POSIX_SPAWN_DUP2, fd, fd) for fd in [args_fd, *passed]),
            ]
            launcher = os.posix_spawn(
                self._init_binary, argv, {}, file_actions=actions, setsid=True
            )
        finally:
            listener.close()
            for fd in opened:
                if fd != ready_r:
                    os.close(fd)
        try:
            try:
                await _wait_readable(ready_r, READY_TIMEOUT)
                ok = os.read(ready_r, 1) == b"R"
            except TimeoutError:
                ok = False
            await self._reap(launcher)
        finally:
            os.close(ready_r)
        init_pid = find_init(cgroup) if ok else None
        if init_pid is None:
            log = ""
            with contextlib.suppress(OSError):
                log = (run / "launch.log").read_text(errors="replace").strip()
            raise SandboxStartError(
                f"sandbox {sandbox_id} failed to start: {log or 'no error output'}"
            )
        return IsolatedRuntime(
            sandbox_id,
            generation,
            template,
            record=record,
            run=run,
            cgroup=cgroup,
            init_pid=init_pid,
        )

    @staticmethod
    async def _reap(pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            # The launcher exits as soon as bubblewrap is running.
            await _wait_readable(pidfd, READY_TIMEOUT)
        except TimeoutError:
            pass
        finally:
            os.close(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - it has exited: no wait

    async def adopt(
        self, sandbox_id: str, generation: int, template: Template
    ) -> SandboxRuntime | None:
        """Take over a sandbox left running by a previous server, or ``None`` if it is gone."""
        if not _SANDBOX_ID.match(sandbox_id):
            return None
        run = self.settings.run_dir / sandbox_id
        record = SandboxRecord.load(run / "state.json")
        if record is None or record.generation != generation or record.mode != self.settings.mode:
            return None
        if record.mode == "isolated" and not (run / "ctl").exists():
            return None
        if self.settings.mode == "unisolated":
            return DirectRuntime(
                sandbox_id, generation, template, Path(record.workspace), tmp=run / "tmp"
            )
        cgroup = self._require().sandbox(sandbox_id)
        init_pid = find_init(cgroup)
        if init_pid is None:
            return None
        if record.disk_mb:
            await in_thread(self._disks.remount, sandbox_id)
        self._uids_in_use.add(record.uid)
        runtime = IsolatedRuntime(
            sandbox_id,
            generation,
            template,
            record=record,
            run=run,
            cgroup=cgroup,
            init_pid=init_pid,
        )
        if cgroup.is_frozen():
            runtime.state = SandboxState.SUSPENDED
        self._runtimes[sandbox_id] = runtime
        return runtime

    async def suspend(self, rt: SandboxRuntime) -> None:
        """Freeze every process of the sandbox (cgroup freezer)."""
        if isinstance(rt, IsolatedRuntime):
            await rt.cgroup.freeze()
            rt.state = SandboxState.SUSPENDED
        elif isinstance(rt, DirectRuntime):
            rt.state = SandboxState.SUSPENDED

    async def resume(self, rt: SandboxRuntime) -> None:
        """Thaw a suspended sandbox."""
        if isinstance(rt, IsolatedRuntime):
            rt.cgroup.thaw()
            rt.state = SandboxState.ACTIVE
        elif isinstance(rt, DirectRuntime):
            rt.state = SandboxState.ACTIVE

    async def destroy(self, sandbox_id: str, *, keep_workspace: bool = False) -> None:
        """Kill every process of the sandbox, remove its cgroup and run dir (idempotent).

        The workspace goes too unless ``keep_workspace``; named volumes always stay.
        """
        if not _SANDBOX_ID.match(sandbox_id):
            raise ValueError(f"invalid sandbox id {sandbox_id!r}")
        runtime = self._runtimes.pop(sandbox_id, None)
        if runtime is not None:
            runtime.state = SandboxState.TERMINATED
            runtime.close()
        run = self.settings.run_dir / sandbox_id
        record = SandboxRecord.load(run / "state.json")
        if self.settings.mode == "isolated":
            cgroup = self._require().sandbox(sandbox_id)
            await cgroup.kill_all()
            await cgroup.remove()
        await in_thread(self._disks.release, sandbox_id, keep_workspace)
        await asyncio.to_thread(_rmtree, run)
        if not keep_workspace:
            await asyncio.to_thread(_rmtree, self.settings.workspaces_dir / sandbox_id)
        if record is not None:
            self._uids_in_use.discard(record.uid)


def _remove_probe(cgroup: SandboxCgroup) -> None:
    """Remove an empty cgroup from synchronous code (the preflight probe)."""
    for d in cgroup.dirs.values():
        with contextlib.suppress(FileNotFoundError):
            d.rmdir()

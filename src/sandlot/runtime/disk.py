"""Per-sandbox disks: a size-limited ext4 filesystem holding ``/workspace`` and ``/tmp``.

A template's ``resources.disk_mb`` is enforced by the kernel: the server (root)
gives each sandbox a sparse image file of that size, formatted ext4 and
loop-mounted before bubblewrap starts; bubblewrap, which runs as the sandbox's
unprivileged uid and cannot mount anything, binds the image's ``workspace`` and
``tmp`` directories like any others. A write beyond the size fails with ENOSPC,
in the sandbox and in the dataplane alike, and nothing a sandbox writes lands
anywhere else on the host. Per sandbox::

    run_dir/.disks/<id>.img                 the image (sparse: what was written, at most its size)
    /run/sandlot/disks/<tag>/<id>/          where it is mounted (nosuid, nodev, noatime)
    /run/sandlot/disks/<tag>/<id>/workspace the sandbox's /workspace (unless a volume is there)
    /run/sandlot/disks/<tag>/<id>/tmp       the sandbox's /tmp

Mount points are outside the data directory (``tag`` is the runtime's, one per
data directory), so removing a data directory never walks into a mounted disk
and deletes its files on the way, or fails on a busy mount point; they are as
reachable by other host users as the workspaces directory is.

Choices, and why:

- ``/tmp`` is in the same filesystem, so one limit covers both. A size-limited
  tmpfs would be charged to the sandbox's memory cgroup: a full ``/tmp`` would
  take the memory of its processes and end in the OOM killer, not in ENOSPC.
- No journal: a sandbox does not outlive a host crash (its processes are gone,
  so the restarted server deletes it), and without one a durable 4 KiB write
  costs about what it costs on the host's own filesystem (0.6 to 0.9 ms here;
  with a journal 1.1 to 1.5 ms).
- One formatted image per size is made once (``mkfs.ext4``, about 17 ms) and
  copied sparsely for each sandbox (under 1 ms: a few hundred KiB of
  metadata). The loop device does direct I/O: the sandbox's files are cached
  once, in its own memory cgroup, not a second time in the host's page cache.
  Copying, attaching and mounting take about 4 ms, unmounting and deleting
  about the same (docs/RUNTIME.md has the figures).
- No online discard (it costs about 0.1 ms per overwrite): blocks freed inside
  stay allocated in the image until the sandbox is deleted, so an image takes
  at most the most its sandbox ever held, never more than its size.
- Images are thin, as cloud disks are: a new disk is refused when the host
  filesystem could not hold it in full beside :data:`HOST_RESERVE_BYTES` for
  the server's own data, but disks made earlier are not counted at their full
  size (200 sandboxes of 1 GiB would otherwise need 200 GiB free). One sandbox
  can never fill the host; all of them together only if the operator allows
  more live sandboxes times ``disk_mb`` than the host has free.
- Loop devices are attached with AUTOCLEAR (they go with the last unmount) and
  unmounted lazily (``MNT_DETACH``), so a file descriptor the dataplane still
  holds delays nothing. A mount lives in the host's mount table, so it
  survives a server crash; if it is gone when a sandbox is re-adopted, it is
  mounted again from the loop device still attached (the sandbox's own mount
  namespace holds it), never through a second one, which would mount the same
  filesystem twice.

Disks need root, ``mkfs.ext4`` (e2fsprogs) and loop devices; :meth:`DiskManager.check`
says what is missing, and without them ``disk_mb`` cannot be enforced (the
manager warns loudly, as for the unisolated mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("sandlot.runtime.disk")
T = TypeVar("T")

#: Where the disks are mounted, per server (``<tag>/<id>``): outside the data directory,
#: so that removing one never walks into a mounted disk.
MOUNT_ROOT = Path("/run/sandlot/disks")

#: Kept free on the host's filesystem beside a new disk's full size (the server's own data).
HOST_RESERVE_BYTES = 1 << 30

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_CLR_FD = 0x4C01
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_DIRECT_IO = 16
_MS_NOSUID, _MS_NODEV, _MS_NOATIME = 2, 4, 1024
_MNT_DETACH = 2
_EXT4_IOC_SHUTDOWN = 0x8004587D
_EXT4_GOING_FLAGS_NOLOGFLUSH = 2
#: Inode tables were never written (the image reads back zeros): no background zeroing.
_MOUNT_DATA = "noinit_itable"
MKFS_OPTIONS = (
    "-q",
    "-F",
    "-b",
    "4096",
    "-m",
    "0",  # no blocks reserved for root: nobody is root in a sandbox
    "-O",
    "^has_journal",
    "-E",
    "nodiscard,lazy_itable_init=1",
    "-L",
    "sandlot",
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class DiskError(RuntimeError):
    """A sandbox disk could not be made or mounted; the message says why."""


@dataclass(frozen=True)
class SandboxDisk:
    """Where one sandbox's disk lives on the host."""

    image: Path
    mountpoint: Path

    @property
    def workspace(self) -> Path:
        return self.mountpoint / "workspace"

    @property
    def tmp(self) -> Path:
        return self.mountpoint / "tmp"


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)


def _mount(device: str, target: Path) -> None:
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOATIME
    ret = _libc.mount(device.encode(), os.fsencode(target), b"ext4", flags, _MOUNT_DATA.encode())
    _check(ret, str(target))


def _umount(target: Path) -> None:
    _check(_libc.umount2(os.fsencode(target), _MNT_DETACH), str(target))


def _shutdown(mountpoint: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)


def attach_loop(image: Path, *, autoclear: bool = True) -> tuple[str, int]:
    """Attach ``image`` to a free loop device: ``(device path, open fd)``.

    With ``autoclear``, the fd must stay open until the device is mounted (AUTOCLEAR
    detaches it at its last close); without, it stays attached until
    :func:`detach_loop`.
    """
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        try:
            name = os.fsencode(image)[-63:]
            info = struct.pack(
                "=QQQQQIIII64s64s32s16s",
                *(0,) * 8,
                (_LO_FLAGS_AUTOCLEAR if autoclear else 0) | _LO_FLAGS_DIRECT_IO,
                name,
                b"",
                b"",
                b"",
            )
            config = struct.pack("=II", backing, 0) + info + bytes(64)
            for _ in range(32):
                device = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
                fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(fd, _LOOP_CONFIGURE, config)
                except OSError as exc:
                    os.close(fd)
                    if exc.errno == errno.EBUSY:
                        continue  # another process took it between the two calls
                    raise
                return device, fd
            raise DiskError("no free loop device (each attempt was taken by another process)")
        finally:
            os.close(backing)
    finally:
        os.close(ctl)


def detach_loop(device: str) -> None:
    """Detach a loop device (once unmounted everywhere, if a mount still holds it)."""
    fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _LOOP_CLR_FD)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # not attached (any more)
            raise
    finally:
        os.close(fd)


def _loops() -> dict[str, str]:
    """Every attached loop device: device → backing file (`` (deleted)`` when it is)."""
    found = {}
    with contextlib.suppress(FileNotFoundError), os.scandir("/sys/block") as it:
        for entry in it:
            if not entry.name.startswith("loop"):
                continue
            try:
                with open(f"/sys/block/{entry.name}/loop/backing_file") as f:
                    found[f"/dev/{entry.name}"] = f.read().rstrip("\n")
            except OSError:
                continue  # not attached
    return found


def loops_backed_by(prefix: Path) -> dict[str, str]:
    """Attached loop devices whose backing file is ``prefix`` or lies under it: device → file."""
    root = os.path.realpath(prefix)
    found = {}
    for device, backing in _loops().items():
        backing = backing.removesuffix(" (deleted)")
        if backing == root or backing.startswith(root.rstrip("/") + "/"):
            found[device] = backing
    return found


def release_deleted() -> None:
    """Unmount the sandbox disks whose image was deleted under them: nobody can adopt or
    remove those any more (a data directory removed while its server was down)."""
    deleted = {dev for dev, backing in _loops().items() if backing.endswith(" (deleted)")}
    for mountpoint in mounts_of(deleted) if deleted else []:
        if mountpoint.parent.parent == MOUNT_ROOT:
            with contextlib.suppress(OSError):
                _umount(mountpoint)
                mountpoint.rmdir()


def _mount_table() -> list[tuple[int, Path]]:
    """``(device number, mount point)`` of every mount in this mount namespace."""
    table = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" ", 5)
            major, minor = fields[2].split(":")
            where = fields[4]
            if "\\" in where:  # octal escapes for spaces and the like, as the kernel writes them
                where = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), where)
            table.append((os.makedev(int(major), int(minor)), Path(where)))
    return table


def mounts_of(devices: set[str]) -> list[Path]:
    """Mount points (in this mount namespace) of the given block devices."""
    numbers = set()
    for device in devices:
        with contextlib.suppress(OSError):
            numbers.add(os.stat(device).st_rdev)
    return [where for dev, where in _mount_table() if dev in numbers]


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` keeping its holes (an image is mostly holes)."""
    size = src.stat().st_size
    fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fout, size)
            offset = 0
            while offset < size:
                try:
                    start = os.lseek(fin, offset, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break  # only a hole is left
                    raise
                end = os.lseek(fin, start, os.SEEK_HOLE)
                while start < end:
                    start += os.copy_file_range(fin, fout, end - start, start, start)
                offset = end
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _has_entries(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _traversable(path: Path) -> bool:
    """Whether every uid may walk down to ``path`` (itself included)."""
    try:
        return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))
    except OSError:
        return False


def _pid_alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)


def make_room(directory: Path, size: int) -> None:
    """Refuse a disk of ``size`` bytes in ``directory`` that the host's filesystem could not
    hold in full beside the server's reserve (:data:`HOST_RESERVE_BYTES`)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free - size < HOST_RESERVE_BYTES:
        mib = 1 << 20
        raise DiskError(
            f"not enough free space on the host for a {size // mib} MiB sandbox disk: "
            f"{free // mib} MiB free, {HOST_RESERVE_BYTES // mib} MiB kept for the server"
        )


def find_mkfs() -> str | None:
    """``mkfs.ext4``, also where a non-root ``PATH`` leaves out the sbin directories."""
    return shutil.which("mkfs.ext4") or shutil.which("mkfs.ext4", path="/usr/sbin:/sbin")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread; cancelled, wait for it to end before raising.

    ``asyncio.to_thread`` lets a cancelled caller go on while the thread still
    runs: a destroy that follows would find no disk, and the thread would then
    mount one nobody removes.
    """
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


class DiskManager:
    """Makes, mounts and removes the disks of one server's sandboxes."""

    def __init__(self, images: Path, mounts: Path, like: Path) -> None:
        #: ``<id>.img`` files, and the formatted ``.template-<MiB>.img`` they are copied from.
        self.images = images
        #: ``<id>/`` mount points; other uids may walk through it only if they may walk
        #: through ``like`` (the workspaces directory it stands in for).
        self.mounts = mounts
        self._like = like
        self._lock = threading.Lock()
        self._mkfs = ""

    @property
    def available(self) -> bool:
        """Whether :meth:`prepare` found that disks can be made here."""
        return bool(self._mkfs)

    def prepare(self) -> None:
        """Check that disks can be made here; warn loudly if not (``disk_mb`` is then ignored)."""
        self._sweep()
        problem = self.check()
        if problem is not None:
            log.warning(
                "SANDBOX DISK LIMITS ARE NOT ENFORCED: %s. Templates' disk_mb is ignored and "
                "a sandbox can fill the host's filesystem.",
                problem,
            )

    def disk(self, sandbox_id: str) -> SandboxDisk:
        return SandboxDisk(self.images / f"{sandbox_id}.img", self.mounts / sandbox_id)

    def check(self) -> str | None:
        """Why disks cannot be made here (``None``: they can). Tries one for real."""
        if os.geteuid() != 0:
            return "mounting a disk needs root (the server does not run as root)"
        mkfs = find_mkfs()
        if mkfs is None:
            return "mkfs.ext4 not found: install it with: sudo apt-get install -y e2fsprogs"
        if not os.path.exists("/dev/loop-control"):
            return "/dev/loop-control is missing: load the loop module (modprobe loop)"
        self._mkfs = mkfs
        try:
            self.images.mkdir(mode=0o700, parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".trial-", dir=self.images) as trial:
                disk = SandboxDisk(Path(trial) / "disk.img", Path(trial) / "mnt")
                sparse_copy(self._template(1), disk.image)
                disk.mountpoint.mkdir()
                device, fd = attach_loop(disk.image)
                try:
                    _mount(device, disk.mountpoint)
                finally:
                    os.close(fd)
                _umount(disk.mountpoint)
        except (OSError, subprocess.SubprocessError, DiskError) as exc:
            self._mkfs = ""
            return f"a trial disk could not be made and mounted: {exc}"
        return None

    # --- per sandbox ----------------------------------------------------------------

    def provide(
        self, sandbox_id: str, size_mb: int, uid: int, gid: int, *, workspace: Path | None
    ) -> SandboxDisk | None:
        """Make (or find) the sandbox's disk and mount it, its directories owned by ``uid``.

        ``workspace``: the plain directory the disk's ``workspace`` replaces
        (``None``: a volume is the workspace, the disk holds ``/tmp`` only).
        An image left by an earlier attempt (a create retried after a crash) is
        kept, with the user's files and its size. ``None``: the sandbox keeps a
        workspace made before disk limits existed, with its files, and no limit.
        """
        if not self._mkfs:
            raise DiskError("sandbox disks are not available here (see the server's warning)")
        disk = self.disk(sandbox_id)
        if not self.mounts.is_dir():
            mode = 0o711 if _traversable(self._like) else 0o700
            self.mounts.mkdir(mode=mode, parents=True, exist_ok=True)
            self.mounts.chmod(mode)
        with self._lock:
            fresh = not disk.image.exists()
            if fresh and workspace is not None and _has_entries(workspace):
                log.warning("sandbox %s keeps its workspace of before disk limits", sandbox_id)
                return None
            if fresh:
                make_room(self.images, size_mb << 20)
                template = self._template(size_mb)
                staging = disk.image.with_name(f".{sandbox_id}.{os.getpid()}.tmp")
                staging.unlink(missing_ok=True)
                sparse_copy(template, staging)
                staging.rename(disk.image)
        try:
            disk.mountpoint.mkdir(mode=0o755, exist_ok=True)
            if not os.path.ismount(disk.mountpoint):
                self._mount(disk, fresh=fresh)
            dirs = [(disk.tmp, 0o1777)]
            if workspace is not None:
                dirs.append((disk.workspace, 0o755))
            for path, mode in dirs:
                path.mkdir(mode=mode, exist_ok=True)
                path.chmod(mode)
                st = path.stat()
                if (st.st_uid, st.st_gid) != (uid, gid):
                    # A new image holds two empty directories; a kept one the user's files.
                    if fresh:
                        os.chown(path, uid, gid)
                    else:
                        _chown_tree(path, uid, gid)
        except BaseException:
            if fresh:
                self.release(sandbox_id)
            raise
        return disk

    def remount(self, sandbox_id: str) -> None:
        """Mount a running sandbox's disk again if its host mount is gone (after adopt)."""
        disk = self.disk(sandbox_id)
        if not os.path.ismount(disk.mountpoint) and disk.image.exists():
            disk.mountpoint.mkdir(mode=0o755, parents=True, exist_ok=True)
            self._mount(disk, fresh=False)

    def release(self, sandbox_id: str, keep_image: bool = False) -> None:
        """Unmount the sandbox's disk and, unless ``keep_image``, delete it (idempotent)."""
        disk = self.disk(sandbox_id)
        # Wherever it is mounted: an older version mounted disks in the workspaces
        # directory, and a re-adopted sandbox of that version is mounted in both places.
        if os.path.ismount(disk.mountpoint):
            dev = os.stat(disk.mountpoint).st_dev
            mounted = [where for d, where in _mount_table() if d == dev]
        elif disk.image.exists():
            mounted = mounts_of(set(loops_backed_by(disk.image)))
        else:
            mounted = []
        for mountpoint in mounted:
            for _ in range(8):  # stacked mounts, should a crash have left two
                if not os.path.ismount(mountpoint):
                    break
                if not keep_image:
                    # Its files are about to go: no writeback on unmount (about 10 ms less).
                    _shutdown(mountpoint)
                _umount(mountpoint)
        if not keep_image:
            disk.image.unlink(missing_ok=True)
            with contextlib.suppress(FileNotFoundError):
                disk.mountpoint.rmdir()
            with contextlib.suppress(OSError):
                self.mounts.rmdir()  # the last one: nothing of this server is left in /run

    def release_all(self) -> None:
        """Unmount every disk whose image is here (a server whose data directory is gone)."""
        attached = loops_backed_by(self.images)
        for mountpoint in mounts_of(set(attached)):
            with contextlib.suppress(OSError):
                _umount(mountpoint)
        shutil.rmtree(self.mounts, ignore_errors=True)

    def existing(self) -> set[str]:
        """Sandboxes with an image here, or a disk of ours still mounted."""
        try:
            with os.scandir(self.images) as it:
                names = [e.name for e in it]
        except FileNotFoundError:
            return set()
        found = {n[:-4] for n in names if n.endswith(".img") and _ID.match(n[:-4])}
        mounted = [where for _, where in _mount_table() if where.parent == self.mounts]
        return found | {m.name for m in mounted if _ID.match(m.name)}

    @staticmethod
    def usage(path: Path) -> tuple[int, int]:
        """``(size, free)`` in bytes of the filesystem holding ``path``, as its users see it."""
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    # --- internals ------------------------------------------------------------------

    def _sweep(self) -> None:
        """Remove what a server killed while making a disk left behind (trial, staging),
        and any server's disks whose images are gone."""
        release_deleted()
        with contextlib.suppress(FileNotFoundError), os.scandir(self.mounts) as it:
            for entry in it:
                if not os.path.ismount(entry.path) and not self.disk(entry.name).image.exists():
                    with contextlib.suppress(OSError):
                        os.rmdir(entry.path)  # a mount point of a disk deleted meanwhile
        try:
            with os.scandir(self.images) as it:
                entries = list(it)
        except FileNotFoundError:
            return
        for entry in entries:
            path = Path(entry.path)
            if entry.name.startswith((".trial-", ".root-")) and entry.is_dir():
                with contextlib.suppress(OSError):
                    if os.path.ismount(path / "mnt"):
                        _umount(path / "mnt")
                shutil.rmtree(path, ignore_errors=True)
            elif entry.name.endswith(".tmp") and not _pid_alive(entry.name.split(".")[-2]):
                path.unlink(missing_ok=True)

    def _mount(self, disk: SandboxDisk, *, fresh: bool) -> None:
        # A disk still attached (its sandbox's mount namespace holds it) is mounted
        # from that device: a second loop device would mount the same filesystem twice.
        attached = [] if fresh else list(loops_backed_by(disk.image))
        if attached:
            _mount(attached[0], disk.mountpoint)
            return
        device, fd = attach_loop(disk.image)
        try:
            _mount(device, disk.mountpoint)
        finally:
            os.close(fd)

    def _template(self, size_mb: int) -> Path:
        """The formatted image of ``size_mb`` MiB every disk of that size is copied from."""
        path = self.images / f".template-{size_mb}.img"
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(prefix=".root-", dir=self.images) as root:
            os.chmod(root, 0o755)  # noqa: S103 - the root of every sandbox disk
            os.mkdir(os.path.join(root, "workspace"), 0o755)
            os.mkdir(os.path.join(root, "tmp"))
            os.chmod(os.path.join(root, "tmp"), 0o1777)  # noqa: S103 - a /tmp
            staging = self.images / f".template-{size_mb}.{os.getpid()}.tmp"
            with open(staging, "wb") as f:
                f.truncate(size_mb << 20)
            try:
                subprocess.run(
                    [self._mkfs or "mkfs.ext4", *MKFS_OPTIONS, "-d", root, str(staging)],
                    capture_output=True,
                    check=True,
                    env={},
                    timeout=60,
                )
            except subprocess.CalledProcessError as exc:
                staging.unlink(missing_ok=True)
                err = exc.stderr.decode(errors="replace").strip()
                raise DiskError(f"mkfs.ext4 failed for a {size_mb} MiB disk: {err}") from exc
            staging.rename(path)
        return path

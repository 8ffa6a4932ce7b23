"""Size-limited workspaces for the ``docker`` provider's sandboxes.

A template's ``resources.disk_mb`` bounds a container sandbox's ``/workspace`` as it
bounds a local sandbox's (:mod:`sandlot.runtime.disk`): each sandbox gets a sparse image
file of that size, formatted ext4 with its root owned by the sandbox user (and no
``lost+found``: the root is the workspace), and attached to a loop device by the
provider. Its workspace volume is the engine's ``local`` driver mounting that device
(``type=ext4``), so the engine mounts it, in its own mount namespace, when the container
starts: a write beyond the size fails with ENOSPC inside the sandbox, and nothing the
sandbox writes lands on the host's filesystem beyond its image.

The device stays attached for the sandbox's life (no AUTOCLEAR): the volume names the
device, so the device must name that sandbox's image for as long as the container may
start. It is detached once the sandbox's container and volume are removed; an image and
a device left by a crash are removed with the sandbox's other leftovers. Images are thin,
as :mod:`sandlot.runtime.disk`'s are: a new one is refused when the host's filesystem
could not hold it in full beside the server's reserve (:func:`~sandlot.runtime.disk.make_room`).

This needs the provider to run as root on the engine's host (an engine reached over a
Unix socket), ``mkfs.ext4`` and ``debugfs`` (e2fsprogs) and loop devices:
:meth:`WorkspaceDisks.check` says what is missing, and without them ``disk_mb`` is not
enforced (the provider warns loudly when it starts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from sandlot.runtime.disk import (
    MKFS_OPTIONS,
    DiskError,
    attach_loop,
    detach_loop,
    find_mkfs,
    loops_backed_by,
    make_room,
    sparse_copy,
)


class WorkspaceDisks:
    """The workspace images of one docker provider's sandboxes, in ``directory``."""

    def __init__(self, directory: Path, uid: int, gid: int) -> None:
        self.directory = directory
        self.uid, self.gid = uid, gid
        self._mkfs = ""
        self._debugfs = ""
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """Whether :meth:`check` found that disks can be made here."""
        return bool(self._mkfs)

    def check(self) -> str | None:
        """Why workspace disks cannot be made here (``None``: they can). Tries one."""
        if os.geteuid() != 0:
            return "attaching a disk needs root (the server does not run as root)"
        mkfs = find_mkfs()
        debugfs = shutil.which("debugfs") or shutil.which("debugfs", path="/usr/sbin:/sbin")
        if mkfs is None or debugfs is None:
            return "mkfs.ext4 or debugfs not found: install them with: apt-get install -y e2fsprogs"
        if not os.path.exists("/dev/loop-control"):
            return "/dev/loop-control is missing: load the loop module (modprobe loop)"
        self._mkfs, self._debugfs = mkfs, debugfs
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".trial-", dir=self.directory) as trial:
                image = Path(trial) / "disk.img"
                sparse_copy(self._template(1), image)
                _, fd = attach_loop(image)
                os.close(fd)  # AUTOCLEAR: detached as it closes
        except (OSError, subprocess.SubprocessError, DiskError) as exc:
            self._mkfs = self._debugfs = ""
            return f"a trial disk could not be made and attached: {exc}"
        return None

    def image(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}.img"

    def attach(self, sandbox_id: str, size_mb: int) -> str:
        """The loop device of the sandbox's disk, made (``size_mb`` MiB) if it has none
        and attached if it is not. An image left by an earlier attempt is kept, with the
        user's files and its size."""
        if not self.available:
            raise DiskError("workspace disks are not available here (see the server's warning)")
        image = self.image(sandbox_id)
        with self._lock:
            if not image.exists():
                make_room(self.directory, size_mb << 20)
                staging = image.with_name(f".{sandbox_id}.{os.getpid()}.tmp")
                staging.unlink(missing_ok=True)
                sparse_copy(self._template(size_mb), staging)
                staging.rename(image)
            attached = sorted(loops_backed_by(image))
            if attached:
                return attached[0]
            device, fd = attach_loop(image, autoclear=False)
            os.close(fd)
            return device

    def release(self, sandbox_id: str, *, keep_image: bool) -> None:
        """Detach the sandbox's disk (once its container and volume are gone) and, unless
        ``keep_image``, delete it. Idempotent."""
        image = self.image(sandbox_id)
        for device in loops_backed_by(image):
            with contextlib.suppress(FileNotFoundError):
                detach_loop(device)
        if not keep_image:
            image.unlink(missing_ok=True)

    def sandboxes(self) -> set[str]:
        """The sandboxes that have an image here."""
        if not self.directory.is_dir():
            return set()
        return {p.stem for p in self.directory.glob("*.img") if not p.name.startswith(".")}

    def _template(self, size_mb: int) -> Path:
        """The formatted image of ``size_mb`` MiB, its root the sandbox user's, that every
        disk of that size is copied from."""
        path = self.directory / f".template-{size_mb}-{self.uid}-{self.gid}.img"
        if path.exists():
            return path
        staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(staging, "wb") as f:
            f.truncate(size_mb << 20)
        options = list(MKFS_OPTIONS)
        extended = options.index("-E") + 1
        options[extended] += f",root_owner={self.uid}:{self.gid}"
        try:
            for argv in (
                [self._mkfs, *options, str(staging)],
                # The root is the workspace: nothing of the filesystem's own in it.
                [self._debugfs, "-w", "-R", "rmdir lost+found", str(staging)],
            ):
                subprocess.run(argv, capture_output=True, check=True, env={}, timeout=60)
        except subprocess.CalledProcessError as exc:
            staging.unlink(missing_ok=True)
            err = exc.stderr.decode(errors="replace").strip()
            raise DiskError(f"making a {size_mb} MiB workspace disk failed: {err}") from exc
        staging.rename(path)
        return path

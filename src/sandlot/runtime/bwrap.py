"""What a sandbox sees: bubblewrap's options for the image, mounts and namespaces.

bubblewrap runs as the sandbox's unprivileged host uid and resolves every
source by path (even ``--bind-fd``). When the server is root, its data
directory may not be traversable by that uid, so the launcher first binds the
sandbox's own directories at ``STAGE_DIR/<name>`` in a private mount namespace
(``init.c``), and bubblewrap binds them from there. The options travel through
``--args FD`` and never reach the sandbox; the init is executed through an fd,
so nothing of it is mounted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

#: The sandbox user, as seen inside (mapped to the sandbox's host uid).
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_USER = "sandbox"
HOSTNAME = "sandbox"

#: Where the launcher stages bind sources (a tmpfs over it, in its own mount namespace).
STAGE_DIR = Path("/tmp")

#: Top-level directories of the host bound read-only for the ``host`` image.
HOST_IMAGE_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")

#: Host ``/etc`` entries copied into a sandbox's ``/etc``: what programs need to
#: run, nothing that holds credentials (shadow, ssh, sudoers, pip/git configs...).
HOST_ETC_ALLOWLIST = (
    "alternatives",
    "bash.bashrc",
    "bash_completion",
    "bash_completion.d",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "gai.conf",
    "host.conf",
    "inputrc",
    "issue",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "locale.gen",
    "localtime",
    "magic",
    "magic.mime",
    "mime.types",
    "nanorc",
    "networks",
    "os-release",
    "profile",
    "profile.d",
    "protocols",
    "python3",
    "python3.11",
    "resolv.conf",
    "rpc",
    "services",
    "shells",
    "skel",
    "ssl",
    "terminfo",
    "timezone",
    "vim",
    "xattr.conf",
)

#: Top-level names of a rootfs image not bound into the sandbox (provided fresh or hidden).
ROOTFS_SKIP = frozenset({"dev", "proc", "sys", "tmp", "workspace", "run"})

_GENERATED_ETC = {
    "passwd": (
        "root:x:0:0:root:/root:/bin/sh\n"
        f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:{SANDBOX_USER}:/workspace:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ),
    "group": f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
    "hostname": f"{HOSTNAME}\n",
    "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\nservices: files\n",
}


def _etc_fingerprint(source: Path) -> str:
    digest = hashlib.sha256(repr(sorted(_GENERATED_ETC.items())).encode())
    for name in HOST_ETC_ALLOWLIST:
        top = source / name
        paths = [top]
        if top.is_dir() and not top.is_symlink():
            paths += sorted(top.rglob("*"))
        for path in paths:
            try:
                st = path.lstat()
            except OSError:
                continue
            digest.update(f"{path}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def build_host_etc(target: Path, source: Path = Path("/etc")) -> None:
    """Write the minimal ``/etc`` of the ``host`` image into ``target``.

    Rebuilt (and swapped in whole) only when the host's entries changed: copying
    hundreds of symlinks costs about a second on slow filesystems.
    """
    fingerprint = _etc_fingerprint(source)
    stamp = target.with_name(target.name + ".fingerprint")
    with contextlib.suppress(OSError):
        if target.is_dir() and stamp.read_text() == fingerprint:
            return
    staging = target.with_name(target.name + f".{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in HOST_ETC_ALLOWLIST:
        src = source / name
        dst = staging / name
        try:
            if src.is_symlink():
                dst.symlink_to(os.readlink(src))
            elif src.is_dir():
                shutil.copytree(src, dst, symlinks=True, ignore_dangling_symlinks=True)
            elif src.is_file():
                shutil.copy2(src, dst)
        except OSError:
            continue  # unreadable or vanished: the sandbox does without it
    for name, text in _GENERATED_ETC.items():
        (staging / name).write_text(text)
    for path in [staging, *staging.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    old = target.with_name(target.name + f".{os.getpid()}.old")
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    stamp.write_text(fingerprint)


@dataclass(frozen=True)
class BindMount:
    """A host directory bound into the sandbox."""

    host_path: Path
    sandbox_path: str
    writable: bool


def image_entries(image: str) -> list[tuple[str, Path]]:
    """``(sandbox path, host path)`` of each read-only top-level entry of an image."""
    if image == "host":
        root, names = Path("/"), list(HOST_IMAGE_DIRS)
    else:
        root = Path(image)
        names = [n for n in sorted(os.listdir(root)) if n not in ROOTFS_SKIP]
    return [(f"/{n}", root / n) for n in names if (root / n).is_symlink() or (root / n).exists()]


def bwrap_args(
    *,
    image: str,
    image_root: Path | None = None,
    etc: Path | None,
    mounts: list[BindMount],
    share_net: bool,
    seccomp_fd: int,
    init_fd: int,
    listen_fd: int,
    ready_fd: int,
) -> tuple[list[str], list[str]]:
    """bubblewrap's options (passed through ``--args FD``) and the command it runs.

    ``image_root``: where bubblewrap finds a rootfs image (staged), if not at ``image``.
    """
    args = [
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--disable-userns",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
        "--hostname",
        HOSTNAME,
    ]
    if not share_net:
        args.append("--unshare-net")
    for sandbox_path, host_path in image_entries(image):
        if host_path.is_symlink():
            args += ["--symlink", os.readlink(host_path), sandbox_path]
        elif image != "host" and image_root is not None:
            args += ["--ro-bind", str(image_root / host_path.name), sandbox_path]
        else:
            args += ["--ro-bind", str(host_path), sandbox_path]
    if etc is not None:
        args += ["--ro-bind", str(etc), "/etc"]
    args += ["--dev", "/dev", "--proc", "/proc"]
    for m in mounts:
        args += ["--bind" if m.writable else "--ro-bind", str(m.host_path), m.sandbox_path]
    args += [
        # The root tmpfs holds only mount points; nothing may be written there.
        "--remount-ro",
        "/",
        "--chdir",
        "/",
        "--seccomp",
        str(seccomp_fd),
        "--as-pid-1",
    ]
    command = [
        # The init is executed through its fd: nothing of it is mounted in the sandbox.
        f"/proc/self/fd/{init_fd}",
        "init",
        str(listen_fd),
        str(ready_fd),
    ]
    return args, command

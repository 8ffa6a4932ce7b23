"""Checks that the isolated runtime can work on this host, with messages saying how to fix it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

MIN_BWRAP = (0, 8, 0)  # --disable-userns


class RuntimeUnavailable(Exception):
    """The isolated runtime cannot run here; the message says what is missing and the fix."""


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def check_platform() -> None:
    if not sys.platform.startswith("linux"):
        raise RuntimeUnavailable(
            "isolated sandboxes need Linux namespaces; on this system use the explicit "
            "'unisolated' mode (no isolation at all)"
        )


def find_bwrap(name: str) -> str:
    """Absolute path of bubblewrap, checked to be recent enough."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeUnavailable(
            f"bubblewrap ({name!r}) not found: install it with: sudo apt-get install -y bubblewrap"
        )
    result = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", result.stdout)
    if result.returncode != 0 or match is None:
        raise RuntimeUnavailable(f"{path} --version failed: {result.stderr.strip()}")
    version = tuple(int(g) for g in match.groups())
    if version < MIN_BWRAP:
        raise RuntimeUnavailable(
            f"bubblewrap {match.group(0)} at {path} is too old: "
            f"{'.'.join(map(str, MIN_BWRAP))} or later is needed (for --disable-userns)"
        )
    if Path(path).stat().st_mode & 0o4000:
        raise RuntimeUnavailable(
            f"{path} is setuid root; sandlot needs the unprivileged bubblewrap "
            "(user namespaces): remove the setuid bit or point the 'bwrap' setting elsewhere"
        )
    return path


def check_user_namespaces() -> None:
    if _read_int("/proc/sys/user/max_user_namespaces") == 0:
        raise RuntimeUnavailable(
            "user namespaces are disabled (user.max_user_namespaces = 0): "
            "enable them with: sudo sysctl -w user.max_user_namespaces=15000"
        )
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        raise RuntimeUnavailable(
            "unprivileged user namespaces are disabled: "
            "enable them with: sudo sysctl -w kernel.unprivileged_userns_clone=1"
        )
    if _read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == 1:
        raise RuntimeUnavailable(
            "AppArmor restricts unprivileged user namespaces: allow them for bubblewrap "
            "with an AppArmor profile, or: sudo sysctl -w "
            "kernel.apparmor_restrict_unprivileged_userns=0"
        )


def check_uid_range(is_root: bool, uid_base: int, uid_count: int) -> None:
    if not is_root:
        return
    if uid_base < 1 or uid_count < 1 or uid_base + uid_count > 2**32 - 2:
        raise RuntimeUnavailable(
            f"sandbox uid range {uid_base}+{uid_count} is invalid: sandboxes must run as "
            "unprivileged host uids (never 0); set uid_base to an unused range such as 2000000"
        )

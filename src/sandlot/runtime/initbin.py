"""The compiled sandbox init (``init.c``): built on first use, cached by source hash."""

from __future__ import annotations

import subprocess
from importlib import resources
from pathlib import Path

from sandlot.runtime.cbuild import BuildError, build_cached
from sandlot.runtime.preflight import RuntimeUnavailable

_INSTALL_HINT = "install them with: sudo apt-get install -y gcc libc6-dev libseccomp-dev"


def init_source() -> bytes:
    return resources.files("sandlot.runtime").joinpath("init.c").read_bytes()


def ensure_init_binary(cache_dir: Path) -> Path:
    """Path of the init binary for the current source, compiling it if needed.

    Statically linked so that it runs in any rootfs image, whatever its libc.
    """
    try:
        return build_cached(
            init_source(), cache_dir, "sandlot-init", ["-O2", "-static"], ["-lseccomp"]
        )
    except BuildError as exc:
        raise RuntimeUnavailable(f"{exc}; {_INSTALL_HINT}") from None


def export_seccomp(binary: Path) -> bytes:
    """The sandbox seccomp filter as classic BPF, ready for ``bwrap --seccomp``."""
    result = subprocess.run([str(binary), "seccomp"], capture_output=True, check=False, env={})
    if result.returncode != 0 or not result.stdout:
        raise RuntimeUnavailable(
            f"building the seccomp filter failed: {result.stderr.decode(errors='replace')}"
        )
    return result.stdout

"""The sandbox init (``init.c``), built with the package (``setup.py``) as ``sandlot-init``."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sandlot.runtime.artifacts import ArtifactUnavailable, verified
from sandlot.runtime.preflight import RuntimeUnavailable

INIT = "sandlot-init"


def init_binary() -> Path:
    """The init program, checked against its build manifest; raises
    :class:`RuntimeUnavailable` (saying how to rebuild it) when it is not built or not
    to be trusted.

    Statically linked so that it runs in any rootfs image, whatever its libc.
    """
    try:
        return verified("sandlot.runtime", INIT)
    except ArtifactUnavailable as exc:
        raise RuntimeUnavailable(f"the sandbox init is unavailable: {exc}") from None


def export_seccomp(binary: Path) -> bytes:
    """The sandbox seccomp filter as classic BPF, ready for ``bwrap --seccomp``."""
    result = subprocess.run([str(binary), "seccomp"], capture_output=True, check=False, env={})
    if result.returncode != 0 or not result.stdout:
        raise RuntimeUnavailable(
            f"building the seccomp filter failed: {result.stderr.decode(errors='replace')}"
        )
    return result.stdout

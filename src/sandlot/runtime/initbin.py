"""The compiled sandbox init (``init.c``): built on first use, cached by source hash."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from sandlot.runtime.preflight import RuntimeUnavailable

_INSTALL_HINT = "install them with: sudo apt-get install -y gcc libc6-dev libseccomp-dev"


def init_source() -> bytes:
    return resources.files("sandlot.runtime").joinpath("init.c").read_bytes()


def ensure_init_binary(cache_dir: Path) -> Path:
    """Path of the init binary for the current source, compiling it if needed.

    Statically linked so that it runs in any rootfs image, whatever its libc.
    """
    source = init_source()
    digest = hashlib.sha256(source).hexdigest()[:16]
    binary = cache_dir / f"sandlot-init-{digest}"
    if binary.exists():
        return binary
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeUnavailable(f"no C compiler to build the sandbox init; {_INSTALL_HINT}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src = Path(tmp) / "init.c"
        src.write_bytes(source)
        out = Path(tmp) / "init"
        result = subprocess.run(
            [compiler, "-O2", "-static", "-o", str(out), str(src), "-lseccomp"],
            capture_output=True,
            text=True,
            check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
        )
        if result.returncode != 0:
            raise RuntimeUnavailable(
                "compiling the sandbox init failed "
                f"({_INSTALL_HINT}):\n{result.stderr.strip()[-2000:]}"
            )
        out.chmod(0o755)
        # Atomic: concurrent servers may race to build the same binary.
        os.replace(out, binary)
    return binary


def export_seccomp(binary: Path) -> bytes:
    """The sandbox seccomp filter as classic BPF, ready for ``bwrap --seccomp``."""
    result = subprocess.run([str(binary), "seccomp"], capture_output=True, check=False, env={})
    if result.returncode != 0 or not result.stdout:
        raise RuntimeUnavailable(
            f"building the seccomp filter failed: {result.stderr.decode(errors='replace')}"
        )
    return result.stdout

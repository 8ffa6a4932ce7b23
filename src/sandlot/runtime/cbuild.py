"""C helpers compiled on first use with the system's compiler, cached by content.

The sandbox init (``init.c``) and the dataplane's file operations
(``native.c``) ship as source and are built here: one build per distinct
source and flags, named by their hash, written atomically so that servers
starting together may race to build the same file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


class BuildError(Exception):
    """No C compiler, or the source did not compile (the message says which)."""


def build_cached(
    source: bytes,
    cache_dir: Path,
    stem: str,
    flags: Sequence[str],
    libs: Sequence[str] = (),
) -> Path:
    """Path of ``source`` compiled with ``flags`` (then ``libs``), building it if needed.

    The file is ``cache_dir/<stem>-<hash>``; the hash covers the source, the
    flags and the libraries.
    """
    key = b"\0".join([source, *(a.encode() for a in (*flags, *libs))])
    out_path = cache_dir / f"{stem}-{hashlib.sha256(key).hexdigest()[:16]}"
    if out_path.exists():
        return out_path
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BuildError("no C compiler (cc or gcc)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src = Path(tmp) / f"{stem}.c"
        src.write_bytes(source)
        out = Path(tmp) / stem
        result = subprocess.run(
            [compiler, *flags, "-o", str(out), str(src), *libs],
            capture_output=True,
            text=True,
            check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
        )
        if result.returncode != 0:
            raise BuildError(f"compiling {stem}.c failed:\n{result.stderr.strip()[-2000:]}")
        out.chmod(0o755)
        os.replace(out, out_path)
    return out_path

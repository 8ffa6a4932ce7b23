"""Helper programs a runtime starts on a sandbox's behalf (ripgrep for ``/fs/grep``).

Every such process runs where the sandbox's own commands run (its namespaces, cgroup,
uid and limits) and is bounded by ``limit.c`` (``sandlot-limit``), a small static
launcher that kills it at its deadline, as soon as nobody reads its output (the server
died or gave up on the request) or when its parent dies, without needing the server.

- Isolated sandboxes see both programs read-only at :data:`TOOLS_DIR` (the runtime binds
  a directory of the server's there, see :func:`prepare_tools_dir`), whatever their image.
- A plain-process runtime runs them from the host (:func:`host_tools`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import shutil
import sys
from pathlib import Path

from sandlot.runtime.artifacts import ArtifactUnavailable, verified

log = logging.getLogger("sandlot.runtime.tools")

#: Where an isolated sandbox's processes find the helper programs (read-only).
TOOLS_DIR = "/.sandlot"
RIPGREP = "rg"
LIMIT = "sandlot-limit"
#: Names a caller may ask a runtime to start.
TOOLS = frozenset({RIPGREP})


class ToolUnavailable(OSError):
    """The runtime has no such helper program (ripgrep is not installed, say)."""


@functools.cache
def host_ripgrep() -> str | None:
    """ripgrep on the host: next to ``sys.executable`` (PyPI ``ripgrep``), else on PATH."""
    local = Path(sys.executable).parent / RIPGREP
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(RIPGREP)


def limit_binary() -> Path:
    """The launcher built with the package (static: it runs in any rootfs image), checked
    against its build manifest; raises :class:`ArtifactUnavailable`."""
    return verified("sandlot.runtime", LIMIT)


@functools.cache
def host_limit() -> str | None:
    """The launcher for plain-process runtimes (``None`` when it was not built or is not
    to be trusted, said once: the caller then bounds the process itself)."""
    try:
        return str(limit_binary())
    except ArtifactUnavailable as exc:
        log.warning("helper launcher unavailable: %s", exc)
        return None


def _place(source: Path, target: Path) -> None:
    """``target`` becomes the same file as ``source`` (a hard link, else a copy), readable
    and executable by every uid; replaced atomically when ``source`` changed."""
    with contextlib.suppress(OSError):
        if os.path.samefile(source, target):
            return
        src, dst = source.stat(), target.stat()
        if (src.st_size, src.st_mtime_ns) == (dst.st_size, dst.st_mtime_ns):
            return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    if (tmp.stat().st_mode & 0o555) != 0o555:
        # A hard link shares the inode: never loosen the original's mode, copy instead.
        tmp.unlink()
        shutil.copy2(source, tmp)
        tmp.chmod(0o755)
    os.replace(tmp, target)


def prepare_tools_dir(target: Path) -> Path | None:
    """Fill ``target`` with ripgrep and the launcher, for isolated sandboxes to bind at
    :data:`TOOLS_DIR`; ``None`` when ripgrep is not installed (``/fs/grep`` then answers
    503 in those sandboxes). Raises :class:`ArtifactUnavailable` if the launcher was not
    built or is not to be trusted."""
    rg = host_ripgrep()
    if rg is None:
        log.warning("ripgrep is not installed: /fs/grep of large trees will be unavailable")
        return None
    target.mkdir(mode=0o755, parents=True, exist_ok=True)
    target.chmod(0o755)
    _place(Path(rg), target / RIPGREP)
    _place(limit_binary(), target / LIMIT)
    return target


def limited_argv(limit: str, program: str, args: list[str], deadline: float) -> list[str]:
    """``program args`` under the launcher, killed after ``deadline`` seconds."""
    return [limit, str(max(1, math.ceil(deadline * 1000))), program, *args]

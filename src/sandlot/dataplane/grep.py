"""``/fs/grep`` through ripgrep (PyPI ``ripgrep==14.1.0`` or the system ``rg``).

ripgrep gets the confined directory as ``/proc/self/fd/N`` (an fd the
resolver opened and the child inherits), never a host path that a symlink
swap could redirect, and it does not follow symlinks while walking. Patterns
are literal unless ``regex`` is set. ``.git`` directories are skipped; hidden
files and ignored files are searched (like ``grep -r``).

The whole search (spawn, read, parse) runs on one worker thread: no child
watcher, no await per output line, and the event loop stays free.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from sandlot.dataplane.fsids import FsExecutor
from sandlot.dataplane.paths import PathResolver, Resolved, os_error
from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable

MAX_LINE_CHARS = 2000


@functools.cache
def ripgrep_path() -> str | None:
    local = Path(sys.executable).parent / "rg"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("rg")


async def grep(
    resolver: PathResolver,
    executor: FsExecutor,
    *,
    pattern: str,
    path: str,
    glob: str | None,
    max_count: int | None,
    regex: bool,
    ignore_case: bool,
    limit: int,
) -> dict[str, Any]:
    rg = ripgrep_path()
    if rg is None:
        raise ProviderUnavailable("ripgrep is not installed")
    if "\x00" in pattern or (glob is not None and "\x00" in glob):
        raise InvalidRequest("pattern contains a NUL byte")
    cap = min(limit, max_count) if max_count else limit
    flags = ["--fixed-strings"] if not regex else []
    if ignore_case:
        flags.append("--ignore-case")
    if glob:
        flags.append(f"--glob={glob}")

    def run() -> dict[str, Any]:
        try:
            with resolver.resolve(path) as res:
                return _search(rg, res, flags, pattern, cap, executor.fs_ids)
        except OSError as exc:
            raise os_error(exc) from None

    return await executor.heavy(run)


def _search(
    rg: str,
    res: Resolved,
    flags: list[str],
    pattern: str,
    cap: int,
    fs_ids: tuple[int, int] | None,
) -> dict[str, Any]:
    fd, is_dir = _open_target(res)
    # A directory becomes the child's working directory through its fd (one magic-link
    # lookup) and is searched as "."; naming every file through /proc/self/fd/N would
    # pay that lookup per file.
    magic = f"/proc/self/fd/{fd}"
    target = "." if is_dir else magic
    argv = [
        rg,
        "--no-config",
        "--no-heading",
        "--with-filename",
        "--line-number",
        "--null",
        "--color=never",
        "--no-messages",
        "--hidden",
        "--no-ignore",
        "--glob=!.git",
        # Bound what one line can cost (minified files): keep a preview of it.
        "--max-columns=8192",
        "--max-columns-preview",
        *flags,
        "-e",
        pattern,
        "--",
        target,
    ]
    ids: dict[str, Any] = {}
    if fs_ids is not None:
        setpriv = _setpriv()
        if setpriv is not None:
            # Popen(user=…) forks the whole server (no vfork with a uid change), which
            # costs milliseconds; setpriv drops to the sandbox user after a cheap vfork.
            argv = [
                setpriv,
                f"--reuid={fs_ids[0]}",
                f"--regid={fs_ids[1]}",
                "--clear-groups",
                "--",
                *argv,
            ]
        else:
            ids = {"user": fs_ids[0], "group": fs_ids[1], "extra_groups": []}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(fd,),
            cwd=magic if is_dir else None,
            **ids,
        )
    finally:
        os.close(fd)
    matches: list[dict[str, Any]] = []
    truncated = False
    base = res.sandbox_path.rstrip("/")
    skip = len(target.encode())
    paths: dict[bytes, str] = {}
    assert proc.stdout is not None and proc.stderr is not None
    try:
        pending = b""
        while not truncated:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for raw in lines:
                name, sep, rest = raw.partition(b"\x00")
                lineno, _, text = rest.partition(b":")
                if not sep or not lineno.isdigit():
                    continue
                if len(matches) >= cap:
                    truncated = True
                    break
                spath = paths.get(name)
                if spath is None:
                    rel = name[skip:].lstrip(b"/").decode("utf-8", "replace")
                    spath = f"{base}/{rel}" if is_dir and rel else res.sandbox_path
                    paths[name] = spath
                line = text[: MAX_LINE_CHARS * 4].decode("utf-8", "replace")
                matches.append({"path": spath, "line": int(lineno), "text": line[:MAX_LINE_CHARS]})
    finally:
        if truncated:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.stdout.close()
        err = proc.stderr.read(4096)
        proc.stderr.close()
        proc.wait()
    if proc.returncode == 2 and not matches and b"regex" in err.lower():
        raise InvalidRequest("invalid regular expression")
    return {"matches": matches, "truncated": truncated}


def _open_target(res: Resolved) -> tuple[int, bool]:
    """Open what to search: a directory, or one regular file (FIFOs and devices refused)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
    if res.name is None:
        return res.open(flags | os.O_DIRECTORY), True
    fd = res.open(flags)
    st = os.fstat(fd)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        os.close(fd)
        raise InvalidRequest("not a regular file or directory")
    return fd, stat.S_ISDIR(st.st_mode)


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv", path="/usr/bin:/bin")

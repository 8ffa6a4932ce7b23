"""``/fs/grep`` through ripgrep (PyPI ``ripgrep==14.1.0`` or the system ``rg``).

ripgrep gets the confined directory as ``/proc/self/fd/N`` (an fd the
resolver opened and the child inherits), never a host path that a symlink
swap could redirect, and it does not follow symlinks while walking. Patterns
are literal unless ``regex`` is set. ``.git`` directories are skipped; hidden
files and ignored files are searched (like ``grep -r``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from sandlot.dataplane.fsids import FsExecutor
from sandlot.dataplane.paths import PathResolver
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
    res = await executor.light(resolver.resolve, path)
    with res:
        fd = await executor.light(_open_target, res.dir_fd, res.name)
        try:
            target = f"/proc/self/fd/{fd}"
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
            ]
            if not regex:
                argv.append("--fixed-strings")
            if ignore_case:
                argv.append("--ignore-case")
            if glob:
                argv.append(f"--glob={glob}")
            argv += ["-e", pattern, "--", target]
            kwargs: dict[str, Any] = {}
            if executor.fs_ids is not None:
                kwargs = {
                    "user": executor.fs_ids[0],
                    "group": executor.fs_ids[1],
                    "extra_groups": [],
                }
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(fd,),
                **kwargs,
            )
        finally:
            os.close(fd)
        matches: list[dict[str, Any]] = []
        truncated = False
        base = res.sandbox_path.rstrip("/")
        single_file = res.name is not None and not await executor.light(_is_dir, res)
        assert proc.stdout is not None
        try:
            while True:
                raw = await proc.stdout.readline()
                if not raw:
                    break
                name, sep, rest = raw.partition(b"\x00")
                if not sep:
                    continue
                lineno, _, text = rest.partition(b":")
                if not lineno.isdigit():
                    continue
                if len(matches) >= cap:
                    truncated = True
                    break
                fname = name.decode("utf-8", "replace")
                rel = fname[len(target) :].lstrip("/")
                spath = res.sandbox_path if single_file or not rel else f"{base}/{rel}"
                line = text.rstrip(b"\n").decode("utf-8", "replace")
                matches.append({"path": spath, "line": int(lineno), "text": line[:MAX_LINE_CHARS]})
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            _, err = await proc.communicate()
        if proc.returncode == 2 and not matches and err and b"regex" in err.lower():
            raise InvalidRequest("invalid regular expression")
        return {"matches": matches, "truncated": truncated}


def _open_target(dir_fd: int, name: str | None) -> int:
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
    if name is None:
        return os.open(".", flags | os.O_DIRECTORY, dir_fd=dir_fd)
    fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        os.close(fd)
        raise InvalidRequest("not a regular file or directory")
    return fd


def _is_dir(res: Any) -> bool:
    return stat.S_ISDIR(res.lstat().st_mode)

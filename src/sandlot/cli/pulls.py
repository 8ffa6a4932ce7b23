"""``sandlot pull``: the sandbox's files written into a local tree without trusting them.

What a sandbox holds was written by an agent; the local tree is the human's, and
what lands there can run on their machine (a ``.git/config`` with
``core.fsmonitor`` runs at the next ``git status``). So a pull:

- never writes a path with a ``.git`` component (in any case, and the spellings
  macOS and Windows take for ``.git``), nor the sync manifest's own files, nor
  what the local ``.gitignore`` files exclude (a sync would not have sent it),
  nor a name that is absolute or climbs out; links, devices and FIFOs are not
  written either;
- follows no local symlink: each directory is opened from the one above it
  without following links, and a file whose local path passes through a
  symlink, or is one, is skipped;
- stages: each file is written, as it arrives, to a temporary file beside its
  destination (hashed meanwhile), and only once the whole archive, end marker
  included, has arrived are the temporaries renamed into place and the manifest
  saved. A failure (an archive cut short, ``max_bytes`` passed, the network, the
  local disk) removes every temporary file and every directory the pull made;
- keeps modes: a file that exists locally keeps its own; a new one takes the
  member's permission bits (no setuid, setgid or sticky bit) masked by the umask.

Whether a file may be overwritten is decided as before: one changed on both
sides since the last sync or pull is a conflict, its sandbox version written
beside it as ``FILE.sandlot-remote``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sandlot.cli.ignore import IgnoreFile
from sandlot.cli.tarreader import ArchiveReader
from sandlot.cli.trees import MANIFEST, load_manifest, save_manifest
from sandlot.dataplane.services.tarstream import TarError
from sandlot.protocol.errors import ConnectionLost, SandlotError

#: What the CLI writes beside a destination while a pull runs.
TEMP_PREFIX = ".sandlot-tmp-"
CONFLICT_SUFFIX = ".sandlot-remote"
#: Directory fds kept open at once (closed together beyond, and opened again as needed).
MAX_OPEN_DIRS = 256

#: Code points HFS+ ignores in names (``.g\u200cit`` is ``.git`` there), as git checks.
_HFS_IGNORED = dict.fromkeys(
    [0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF]
)
_UNREADABLE = "unreadable"


class PullError(Exception):
    """The pull failed; nothing of it was applied (the message says what happened)."""


class _Skip(Exception):
    """This member is not written; the message says why."""


def is_git_dir_name(part: str) -> bool:
    """Whether a path component names ``.git`` on some filesystem: any case (macOS and
    Windows fold it), trailing dots and spaces (Windows drops them), ignorable code
    points (HFS+ drops them), the 8.3 short name ``git~1``."""
    folded = part.translate(_HFS_IGNORED).rstrip(". ").casefold()
    return folded in (".git", "git~1")


def refusal(parts: list[str]) -> str | None:
    """Why a relative path must never be written locally, or ``None``."""
    for part in parts:
        if is_git_dir_name(part):
            return "inside .git"
        if part.casefold().startswith(MANIFEST):  # the manifest, or its temporary file
            return "the sync manifest"
    return None


class LocalIgnores:
    """The local tree's ``.gitignore`` files, read as a sync reads them (lazily, per directory)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files: dict[str, IgnoreFile | None] = {}

    def _file(self, rel_dir: str) -> IgnoreFile | None:
        if rel_dir not in self._files:
            self._files[rel_dir] = IgnoreFile.load(self.root / rel_dir if rel_dir else self.root)
        return self._files[rel_dir]

    def ignored(self, parts: list[str]) -> bool:
        specs: list[tuple[int, IgnoreFile]] = []
        for i in range(len(parts)):
            rel_dir = "/".join(parts[:i])
            spec = self._file(rel_dir)
            if spec is not None:
                specs.append((len(rel_dir) + 1 if rel_dir else 0, spec))
            rel = "/".join(parts[: i + 1])
            for prefix, s in reversed(specs):
                decision = s.decide(rel[prefix:], i < len(parts) - 1)
                if decision is not None:
                    if decision:
                        return True
                    break
        return False


class _Staging:
    """Directories of the local tree opened without following links, and the temporary
    files of one pull; :meth:`rollback` removes what the pull made."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds: dict[str, int] = {}
        #: Directories this pull made, in the order made.
        self.made: list[str] = []
        #: Temporary files not renamed yet: (directory, name).
        self.temps: set[tuple[str, str]] = set()

    def directory(self, rel_dir: str) -> int:
        """An fd of the local directory ``rel_dir``, made if missing; :class:`_Skip` when a
        component is a symlink or not a directory."""
        if len(self._fds) >= MAX_OPEN_DIRS:
            self._close_dirs()
        return self._open(rel_dir)

    def _open(self, rel_dir: str) -> int:
        if not rel_dir:
            return self.root_fd
        fd = self._fds.get(rel_dir)
        if fd is not None:
            return fd
        parent_rel, _, name = rel_dir.rpartition("/")
        parent = self._open(parent_rel)
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            os.mkdir(name, 0o777, dir_fd=parent)
            self.made.append(rel_dir)
        else:
            if stat.S_ISLNK(st.st_mode):
                raise _Skip(f"{rel_dir} is a symlink here")
            if not stat.S_ISDIR(st.st_mode):
                raise _Skip(f"{rel_dir} is not a directory here")
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped since the lstat
                raise _Skip(f"{rel_dir} is a symlink or not a directory here") from None
            raise
        self._fds[rel_dir] = fd
        return fd

    def temp(self, rel_dir: str) -> tuple[str, BinaryIO]:
        """A new temporary file in ``rel_dir`` (mode 0600 until it is complete)."""
        dir_fd = self.directory(rel_dir)
        name = TEMP_PREFIX + secrets.token_hex(8)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        self.temps.add((rel_dir, name))
        return name, open(fd, "wb", closefd=True)

    def discard(self, rel_dir: str, name: str) -> None:
        self.temps.discard((rel_dir, name))
        with contextlib.suppress(OSError, _Skip):
            os.unlink(name, dir_fd=self.directory(rel_dir))

    def rename(self, rel_dir: str, name: str, final: str) -> None:
        dir_fd = self.directory(rel_dir)
        os.rename(name, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        self.temps.discard((rel_dir, name))

    def rollback(self) -> None:
        for rel_dir, name in list(self.temps):
            self.discard(rel_dir, name)
        self._close_dirs()
        for rel_dir in reversed(self.made):
            with contextlib.suppress(OSError):
                os.rmdir(self.root / rel_dir)
        self.made.clear()

    def _close_dirs(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def close(self) -> None:
        self._close_dirs()
        os.close(self.root_fd)


def _local(dir_fd: int, name: str, rel: str) -> tuple[int | None, str | None]:
    """``(mode, sha256)`` of the local file (``(None, None)``: none); :class:`_Skip` when
    it is a symlink, a directory or anything but a regular file."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    if stat.S_ISLNK(st.st_mode):
        raise _Skip(f"{rel} is a symlink here")
    if not stat.S_ISREG(st.st_mode):
        raise _Skip(f"{rel} is not a regular file here")
    h = hashlib.sha256()
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return stat.S_IMODE(st.st_mode), _UNREADABLE
    with open(fd, "rb", closefd=True) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return stat.S_IMODE(st.st_mode), h.hexdigest()


@dataclass
class _Staged:
    rel_dir: str
    temp: str
    final: str
    remote_hash: str


@dataclass
class PullReport:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    #: Files the sandbox sent that were not written, with why.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: Files the local ``.gitignore`` files exclude.
    ignored: int = 0
    #: Bytes written locally.
    bytes: int = 0


def _split(name: str) -> list[str] | None:
    """The components of a member's name, ``None`` when absolute or climbing out."""
    if name.startswith("/") or "\0" in name:
        return None
    parts = [p for p in name.split("/") if p and p != "."]
    return None if ".." in parts else parts


async def pull_tree(
    chunks: AsyncIterator[bytes],
    root: Path,
    *,
    force: bool,
    max_bytes: int,
    umask: int,
) -> PullReport:
    """Write the archive arriving as ``chunks`` into ``root`` (see the module's docstring);
    :class:`PullError` when the pull failed and nothing of it was applied."""
    report = PullReport()
    manifest = load_manifest(root)
    ignores = LocalIgnores(root)
    staged: dict[str, _Staged] = {}
    decided: dict[str, str] = {}  # rel → "write" | "conflict" | "unchanged"
    hashes: dict[str, str] = {}
    staging = _Staging(root)
    try:
        reader = ArchiveReader(chunks)
        async for member in reader.members():
            if member.kind != "file":
                continue  # directories come with their files; links and devices are not written
            parts = _split(member.name)
            if not parts:
                if parts is None:
                    report.skipped.append((member.name, "outside the tree"))
                continue
            rel = "/".join(parts)
            why = refusal(parts)
            if why is not None:
                report.skipped.append((rel, why))
                continue
            if ignores.ignored(parts):
                report.ignored += 1
                continue
            if report.bytes + member.size > max_bytes:
                raise PullError(
                    f"the sandbox's files hold more than {max_bytes} bytes (--max-bytes);"
                    " nothing was written"
                )
            rel_dir = "/".join(parts[:-1])
            try:
                dir_fd = staging.directory(rel_dir)
                local_mode, local_hash = _local(dir_fd, parts[-1], rel)
            except _Skip as exc:
                report.skipped.append((rel, str(exc)))
                continue
            except OSError as exc:
                raise PullError(f"cannot write {root / rel}: {exc.strerror or exc}") from None
            if rel in staged:  # named twice: the last one counts
                old = staged.pop(rel)
                staging.discard(old.rel_dir, old.temp)
            temp, out = staging.temp(rel_dir)
            h = hashlib.sha256()
            with out:
                async for piece in reader.data():
                    out.write(piece)
                    h.update(piece)
                if local_mode is not None:
                    os.fchmod(out.fileno(), local_mode)
                else:
                    os.fchmod(out.fileno(), (member.mode & 0o777 or 0o644) & ~umask)
            report.bytes += member.size
            remote_hash = h.hexdigest()
            hashes[rel] = remote_hash
            base = manifest.get(rel)
            if local_hash == remote_hash:
                decided[rel] = "unchanged"
                staging.discard(rel_dir, temp)
            elif force or (local_hash is None and base is None) or local_hash == base:
                decided[rel] = "write"
                staged[rel] = _Staged(rel_dir, temp, parts[-1], remote_hash)
            else:
                decided[rel] = "conflict"
                staged[rel] = _Staged(rel_dir, temp, parts[-1] + CONFLICT_SUFFIX, remote_hash)
    except TarError as exc:
        staging.rollback()
        staging.close()
        raise PullError(f"{exc}; nothing was written") from None
    except ConnectionLost as exc:
        # The dataplane may end the stream by closing the connection rather than its body.
        staging.rollback()
        staging.close()
        raise PullError(f"the archive was cut short ({exc.message}); nothing was written") from None
    except SandlotError:
        staging.rollback()
        staging.close()
        raise
    except OSError as exc:
        staging.rollback()
        staging.close()
        where = f" {exc.filename}" if exc.filename else ""
        raise PullError(f"cannot write in {root}{where}: {exc.strerror or exc}") from None
    except BaseException:
        staging.rollback()
        staging.close()
        raise
    # The whole archive arrived: now, and only now, files take their places.
    failed: list[str] = []
    try:
        for rel, item in sorted(staged.items()):
            try:
                staging.rename(item.rel_dir, item.temp, item.final)
            except (OSError, _Skip) as exc:
                failed.append(f"{rel}: {getattr(exc, 'strerror', None) or exc}")
                staging.discard(item.rel_dir, item.temp)
                decided[rel] = "failed"
    finally:
        staging.close()
    for rel, what in sorted(decided.items()):
        if what == "write":
            report.written.append(rel)
        elif what == "unchanged":
            report.unchanged.append(rel)
        elif what == "conflict":
            report.conflicts.append(rel)
        # Both sides now agree on the files written or unchanged; a conflict keeps
        # its old base, so the next pull still sees the local change.
        if what in ("write", "unchanged"):
            manifest[rel] = hashes[rel]
    save_manifest(root, manifest)
    if failed:
        raise PullError(
            f"{len(failed)} files could not be put in place (the others were): " + "; ".join(failed)
        )
    return report

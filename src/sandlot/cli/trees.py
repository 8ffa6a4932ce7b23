"""Local trees for ``sandlot sync`` and ``sandlot pull``: what to send, and what changed.

``.gitignore`` files are honoured at every level (git's own matching rules,
through ``pathspec``); ``.git`` itself is never sent. A manifest in the local
tree (``.sandlot-sync.json``) remembers the content hash of every file as of
the last sync or pull, so ``pull`` can tell a file changed locally since then
(and must not be overwritten silently) from one that only changed remotely.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pathspec

MANIFEST = ".sandlot-sync.json"
ALWAYS_IGNORED = {".git", MANIFEST}


@dataclass
class TreeFile:
    rel: str
    path: Path
    size: int
    mode: int
    mtime: float


@dataclass
class LocalTree:
    root: Path
    files: list[TreeFile] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    symlinks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _ignore_spec(directory: Path, rel_dir: str) -> pathspec.PathSpec[Any] | None:
    gi = directory / ".gitignore"
    try:
        lines = gi.read_text(errors="replace").splitlines()
    except OSError:
        return None
    if rel_dir:
        # Patterns of a nested .gitignore are relative to its directory.
        anchored = []
        for line in lines:
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            neg = stripped.startswith("!")
            pat = stripped[1:] if neg else stripped
            if "/" in pat.rstrip("/"):
                pat = f"{rel_dir}/{pat.lstrip('/')}"
            else:
                pat = f"{rel_dir}/**/{pat}"
            anchored.append(("!" if neg else "") + pat)
        lines = anchored
    return pathspec.PathSpec.from_lines("gitwildmatch", lines)


def scan(root: Path) -> LocalTree:
    """Walk ``root``, skipping ignored paths; symlinks are kept as links, never followed."""
    tree = LocalTree(root)
    specs: list[pathspec.PathSpec[Any]] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if name in ALWAYS_IGNORED:
            return True
        probe = rel + "/" if is_dir else rel
        result = False
        for spec in specs:
            # Later (deeper) files win, as in git; negations re-include.
            for pattern in spec.patterns:
                if pattern.include is None:
                    continue
                if pattern.match_file(probe) is not None or (
                    is_dir and pattern.match_file(rel) is not None
                ):
                    result = bool(pattern.include)
        return result

    def walk(directory: Path, rel_dir: str) -> None:
        spec = _ignore_spec(directory, rel_dir)
        if spec is not None:
            specs.append(spec)
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            entries = []
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_symlink():
                if not ignored(rel, False):
                    tree.symlinks.append((rel, os.readlink(entry.path)))
                continue
            if entry.is_dir():
                if ignored(rel, True):
                    continue
                tree.dirs.append(rel)
                walk(Path(entry.path), rel)
            elif entry.is_file():
                if ignored(rel, False):
                    continue
                st = entry.stat()
                tree.files.append(
                    TreeFile(rel, Path(entry.path), st.st_size, st.st_mode, st.st_mtime)
                )
        if spec is not None:
            specs.pop()

    walk(root, "")
    return tree


class _Pipe(io.RawIOBase):
    """A write-only file whose bytes are handed out in chunks by a generator."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.chunks.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


def tar_stream(
    tree: LocalTree, *, progress: Callable[[int], None] | None = None, chunk: int = 1 << 20
) -> Iterator[bytes]:
    """The tree as one uncompressed tar stream, produced while it is read (bounded memory)."""
    pipe = _Pipe()
    with tarfile.open(fileobj=pipe, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rel in tree.dirs:
            info = tarfile.TarInfo(rel)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for rel, target in tree.symlinks:
            info = tarfile.TarInfo(rel)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
        for f in tree.files:
            info = tarfile.TarInfo(f.rel)
            info.size = f.size
            info.mode = f.mode & 0o777
            info.mtime = int(f.mtime)
            try:
                with open(f.path, "rb") as fh:
                    tar.addfile(info, _Counting(fh, progress))
            except OSError:
                continue  # vanished or unreadable since the scan
            if sum(map(len, pipe.chunks)) >= chunk:
                yield pipe.take()
    rest = pipe.take()
    if rest:
        yield rest


class _Counting(io.RawIOBase):
    def __init__(self, fh: io.BufferedReader, progress: Callable[[int], None] | None) -> None:
        self.fh = fh
        self.progress = progress

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        if self.progress is not None and data:
            self.progress(len(data))
        return data

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def file_hash(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def load_manifest(root: Path) -> dict[str, str]:
    try:
        data = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def save_manifest(root: Path, files: dict[str, str]) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": files}, sort_keys=True))
    os.replace(tmp, root / MANIFEST)


def manifest_of(tree: LocalTree) -> dict[str, str]:
    out = {}
    for f in tree.files:
        digest = file_hash(f.path)
        if digest is not None:
            out[f.rel] = digest
    return out


@dataclass
class PullPlan:
    write: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def plan_pull(
    root: Path, remote: dict[str, bytes], manifest: dict[str, str], *, force: bool = False
) -> PullPlan:
    """Decide, per remote file, whether pulling it would lose a local change."""
    plan = PullPlan()
    for rel, data in sorted(remote.items()):
        remote_hash = hashlib.sha256(data).hexdigest()
        local = root / rel
        local_hash = file_hash(local) if local.exists() else None
        base = manifest.get(rel)
        if local_hash == remote_hash:
            plan.unchanged.append(rel)
        elif force or (local_hash is None and base is None) or local_hash == base:
            plan.write.append(rel)
        else:
            plan.conflicts.append(rel)
    return plan

"""Local trees for ``sandlot sync`` and ``sandlot pull``: what to send, and what changed.

``.gitignore`` files are honoured at every level (git's own matching rules, see
:mod:`sandlot.cli.ignore`); ``.git`` itself is never sent. A manifest in the local
tree (``.sandlot-sync.json``) remembers the content hash of every file as of
the last sync or pull, so ``pull`` can tell a file changed locally since then
(and must not be overwritten silently) from one that only changed remotely.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.cli.ignore import IgnoreFile

MANIFEST = ".sandlot-sync.json"
ALWAYS_IGNORED = {".git", MANIFEST}


@dataclass
class TreeFile:
    rel: str
    #: Where it is on this machine (a string: a ``Path`` per file costs more than the read).
    path: str | os.PathLike[str]
    size: int
    mode: int
    mtime: float


@dataclass
class LocalTree:
    root: Path
    files: list[TreeFile] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    symlinks: list[tuple[str, str]] = field(default_factory=list)
    #: Links not sent: they point out of the tree (the sandbox refuses those).
    links_out: list[tuple[str, str]] = field(default_factory=list)
    #: What the walk could not read, with why: what it holds is unknown, so a
    #: ``--delete`` must not take it as gone.
    errors: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entries(self) -> Iterator[Entry]:
        yield from self.dirs
        yield from self.symlinks
        yield from self.files


#: What a walk yields: a directory (its relative path), a symlink ``(path, target)``, a file.
Entry = str | tuple[str, str] | TreeFile


def scan(root: Path, *, check_readable: bool = False) -> LocalTree:
    """Walk ``root``, skipping ignored paths; symlinks are kept as links, never followed.

    ``check_readable`` also counts, in ``tree.errors``, the files this user cannot read
    (a ``--delete`` sync must know them before it starts)."""
    tree = LocalTree(root)
    for _ in walk(root, tree):
        pass
    if check_readable:
        unreadable = [f.rel for f in tree.files if not os.access(f.path, os.R_OK)]
        tree.errors += [(rel, "not readable") for rel in unreadable]
    return tree


def points_out(rel: str, link: str) -> bool:
    """Whether the link ``rel`` → ``link`` leads out of the tree (absolute, or climbing
    above its root): the sandbox refuses such links, as it must."""
    if link.startswith("/") or "\0" in link:
        return True
    level = rel.count("/")
    for part in link.split("/"):
        if part == "..":
            level -= 1
            if level < 0:
                return True
        elif part and part != ".":
            level += 1
    return False


def walk(root: Path, tree: LocalTree | None = None) -> Iterator[Entry]:
    """:func:`scan` as it goes: every entry is yielded (and added to ``tree``) when found,
    a directory before what it holds, so a tar stream can start before the walk ends."""
    #: The ``.gitignore`` files above the entry being visited, outermost first, each
    #: with the length of its directory's relative path plus its "/" (0 at the root).
    specs: list[tuple[int, IgnoreFile]] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if name in ALWAYS_IGNORED:
            return True
        # A deeper .gitignore overrides a shallower one, as in git.
        for prefix, spec in reversed(specs):
            decision = spec.decide(rel[prefix:], is_dir)
            if decision is not None:
                return decision
        return False

    def visit(directory: str | Path, rel_dir: str) -> Iterator[Entry]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            entries = []
            if tree is not None and rel_dir:
                tree.errors.append((rel_dir, exc.strerror or str(exc)))
            elif tree is not None:
                raise
        has_ignore = any(e.name == ".gitignore" for e in entries)
        spec = IgnoreFile.load(directory) if has_ignore else None
        if spec is not None:
            specs.append((len(rel_dir) + 1 if rel_dir else 0, spec))
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_symlink():
                if ignored(rel, False):
                    continue
                try:
                    link = (rel, os.readlink(entry.path))
                except OSError as exc:
                    if tree is not None:
                        tree.errors.append((rel, exc.strerror or str(exc)))
                    continue
                if points_out(*link):
                    if tree is not None:
                        tree.links_out.append(link)
                    continue
                if tree is not None:
                    tree.symlinks.append(link)
                yield link
                continue
            if entry.is_dir():
                if ignored(rel, True):
                    continue
                if tree is not None:
                    tree.dirs.append(rel)
                yield rel
                yield from visit(entry.path, rel)
            elif entry.is_file():
                if ignored(rel, False):
                    continue
                try:
                    st = entry.stat()
                except OSError as exc:
                    if tree is not None:
                        tree.errors.append((rel, exc.strerror or str(exc)))
                    continue
                f = TreeFile(rel, entry.path, st.st_size, st.st_mode, st.st_mtime)
                if tree is not None:
                    tree.files.append(f)
                yield f
        if spec is not None:
            specs.pop()

    yield from visit(root, "")


BLOCK = 512
RECORD = 20 * BLOCK  #: what tar(1) pads an archive to
#: The largest size a ustar header holds (11 octal digits); beyond, a PAX record says it.
USTAR_MAX_SIZE = 8**11 - 1


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def _split_ustar(name: bytes) -> tuple[bytes, bytes] | None:
    """``(prefix, name)`` fitting the ustar fields (155 + 100 bytes), or ``None``."""
    if len(name) <= 100:
        return b"", name
    for i in range(len(name) - 1, 0, -1):
        if name[i : i + 1] == b"/" and i <= 155 and 0 < len(name) - i - 1 <= 100:
            return name[:i], name[i + 1 :]
    return None


def _header(
    name: bytes, *, mode: int, size: int, mtime: int, kind: bytes, link: bytes = b""
) -> bytes:
    """One ustar header block; the caller makes sure every field fits."""
    prefix, short = _split_ustar(name) or (b"", name[:100])
    fields = [
        short.ljust(100, b"\0"),
        _octal(mode, 8),
        _octal(0, 8),  # uid: the sandbox owns what it receives
        _octal(0, 8),  # gid
        _octal(size, 12),
        _octal(mtime, 12),
        b" " * 8,  # checksum, computed over the block with these spaces
        kind,
        link[:100].ljust(100, b"\0"),
        b"ustar\x0000",
        b"\0" * 32,  # uname
        b"\0" * 32,  # gname
        _octal(0, 8),
        _octal(0, 8),
        prefix.ljust(155, b"\0"),
        b"\0" * 12,
    ]
    block = bytearray(b"".join(fields))
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _pax_record(key: str, value: bytes) -> bytes:
    body = key.encode() + b"=" + value + b"\n"
    size = len(body) + 2
    while len(b"%d " % size) + len(body) != size:
        size += 1
    return b"%d " % size + body


def _entry(rel: str, *, mode: int, size: int, mtime: int, kind: bytes, link: str = "") -> bytes:
    """The header blocks of one member: ustar, preceded by a PAX header when a name is not
    plain ASCII, does not fit, or the size is beyond ustar's 8 GiB."""
    name = rel.encode("utf-8", "surrogateescape")
    target = link.encode("utf-8", "surrogateescape")
    records = b""
    if not name.isascii() or _split_ustar(name) is None:
        records += _pax_record("path", name)
    if not target.isascii() or len(target) > 100:
        records += _pax_record("linkpath", target)
    if size > USTAR_MAX_SIZE:
        records += _pax_record("size", b"%d" % size)
    out = b""
    if records:
        out += _header(b"././@PaxHeader", mode=0o644, size=len(records), mtime=mtime, kind=b"x")
        out += records + b"\0" * (-len(records) % BLOCK)
    return out + _header(
        name if name.isascii() else b"pax-path",
        mode=mode,
        size=min(size, USTAR_MAX_SIZE),
        mtime=mtime,
        kind=kind,
        link=target if target.isascii() else b"pax-linkpath",
    )


def tar_stream(
    tree: LocalTree | Iterable[Entry],
    *,
    progress: Callable[[int], None] | None = None,
    chunk: int = 1 << 20,
    digests: dict[str, str] | None = None,
) -> Iterator[bytes]:
    """The tree as one uncompressed tar stream, produced while it is read (bounded memory).

    A plain ustar writer (PAX records only where a name or size needs them): the
    standard library's writer spends more time on header objects than on the files.
    A file that shrank since the scan is padded with zeros and one that grew is cut
    at its scanned size, as tar(1) does, so the stream stays well-formed.
    ``digests``, when given, receives the SHA-256 of every file as sent (the
    manifest of :func:`save_manifest`), computed as the files are read.
    ``tree`` is a scanned tree or the entries of a :func:`walk` still going on.
    """
    parts: list[bytes] = []
    pending = 0
    written = 0

    def put(data: bytes) -> None:
        nonlocal pending, written
        parts.append(data)
        pending += len(data)
        written += len(data)

    def take() -> bytes:
        nonlocal pending
        data = b"".join(parts)
        parts.clear()
        pending = 0
        return data

    entries = tree.entries() if isinstance(tree, LocalTree) else tree
    for entry in entries:
        if isinstance(entry, str):
            put(_entry(entry.rstrip("/") + "/", mode=0o755, size=0, mtime=0, kind=b"5"))
            continue
        if isinstance(entry, tuple):
            put(_entry(entry[0], mode=0o777, size=0, mtime=0, kind=b"2", link=entry[1]))
            continue
        f = entry
        try:
            fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # vanished or unreadable since the scan
        h = hashlib.sha256() if digests is not None else None
        try:
            put(_entry(f.rel, mode=f.mode & 0o777, size=f.size, mtime=int(f.mtime), kind=b"0"))
            left = f.size
            while left > 0:
                try:
                    data = os.read(fd, min(left, 1 << 20))
                except OSError:
                    data = b""
                if not data:
                    data = b"\0" * left  # shrank (or unreadable) since the scan
                    left = 0
                else:
                    left -= len(data)
                put(data)
                if h is not None:
                    h.update(data)
                if progress is not None:
                    progress(len(data))
                if pending >= chunk:
                    yield take()
            put(b"\0" * (-f.size % BLOCK))
            if h is not None and digests is not None:
                digests[f.rel] = h.hexdigest()
        finally:
            os.close(fd)
        if pending >= chunk:
            yield take()
    put(b"\0" * (2 * BLOCK))
    put(b"\0" * (-written % RECORD))
    yield take()


def load_manifest(root: Path) -> dict[str, str]:
    try:
        data = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def save_manifest(root: Path, files: dict[str, str]) -> None:
    """Write the manifest through a new temporary file (never through a link left there)."""
    data = json.dumps({"version": 1, "files": files}, sort_keys=True).encode()
    tmp = root / f"{MANIFEST}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with open(fd, "wb", closefd=True) as f:
            f.write(data)
        os.replace(tmp, root / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

"""The C programs and library built with the package, each checked before it is used.

``setup.py`` compiles ``init.c``, ``limit.c`` and ``native.c`` when the package is built
(a wheel, ``pip install``, ``pip install -e``) and writes beside what it built a
``build-manifest.json``: for each artifact, its sha256 and the sha256 of the source it was
built from (``{"format": 1, "artifacts": {NAME: {"sha256", "source", "source_sha256",
...}}}``). :func:`verified` hands out an artifact only when

- the manifest and the artifact are regular files owned by root, by this process's user or
  by the owner of their package directory, and writable by nobody else (group and others);
- the artifact's sha256 is the manifest's (it is the file that was built, not another one
  put in its place);
- the manifest's source sha256 is that of the ``.c`` installed beside it (the build is of
  this source, not of an earlier one: a checkout edited and not rebuilt).

Otherwise :class:`ArtifactUnavailable` says which, and how to rebuild. A name alone is
never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

#: Written by ``setup.py`` beside the artifacts of each package directory.
MANIFEST = "build-manifest.json"
#: What the build needs, as Debian and Ubuntu name it.
SYSTEM_PACKAGES = "gcc libc6-dev libseccomp-dev"
REBUILD = (
    f"install a C compiler (sudo apt-get install -y {SYSTEM_PACKAGES}) and reinstall "
    "sandlot: pip install --force-reinstall --no-deps --no-cache-dir sandlot "
    "(in a checkout: pip install -e ., which ./scripts/serve and ./scripts/test run)"
)


class ArtifactUnavailable(Exception):
    """An artifact is not built, or is not to be trusted; the message says why and what to do."""


def package_dir(package: str) -> Path:
    """The directory of the installed ``package`` (its artifacts are there)."""
    found = resources.files(package)
    if not isinstance(found, Path):
        raise ArtifactUnavailable(f"{package} is not installed as files (it is in {found})")
    return found


def verified(package: str, name: str) -> Path:
    """The artifact ``name`` built into ``package``, checked against its build manifest."""
    return verify(package_dir(package), name)


def verify(directory: Path, name: str) -> Path:
    """``directory / name`` if it is what the manifest there says was built from the source
    beside it; raises :class:`ArtifactUnavailable`."""
    owners = {0, os.geteuid(), _owner(directory)}
    entry = _entries(directory / MANIFEST, owners).get(name)
    if not isinstance(entry, dict):
        raise ArtifactUnavailable(
            f"{name} was not built when sandlot was installed (no C compiler, or a library "
            f"missing; the build said which); {REBUILD}"
        )
    source_name = entry.get("source")
    if not isinstance(source_name, str) or "/" in source_name or source_name in ("", ".", ".."):
        raise ArtifactUnavailable(f"{directory / MANIFEST} names no source for {name}")
    source = directory / source_name
    try:
        source_digest = _sha256(source, None)
    except OSError as exc:
        raise ArtifactUnavailable(f"cannot read {source}: {exc.strerror}") from None
    if source_digest != entry.get("source_sha256"):
        raise ArtifactUnavailable(
            f"{directory / name} was built from another {source_name} than the one "
            f"installed beside it (a stale build); {REBUILD}"
        )
    artifact = directory / name
    try:
        digest = _sha256(artifact, owners)
    except FileNotFoundError:
        raise ArtifactUnavailable(f"{artifact} is missing; {REBUILD}") from None
    except OSError as exc:
        raise ArtifactUnavailable(f"cannot read {artifact}: {exc.strerror}") from None
    if digest != entry.get("sha256"):
        raise ArtifactUnavailable(
            f"{artifact} is not the file built with the package (its sha256 is not the one "
            f"in {MANIFEST}); {REBUILD}"
        )
    return artifact


def _owner(directory: Path) -> int:
    try:
        return directory.stat().st_uid
    except OSError as exc:
        raise ArtifactUnavailable(f"cannot read {directory}: {exc.strerror}") from None


def _entries(manifest: Path, owners: set[int]) -> dict[str, Any]:
    try:
        fd = _open(manifest, owners)
        with os.fdopen(fd, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        raise ArtifactUnavailable(
            f"{manifest} is missing: sandlot's C code was not built with the package "
            f"(installed other than by pip?); {REBUILD}"
        ) from None
    except OSError as exc:
        raise ArtifactUnavailable(f"cannot read {manifest}: {exc.strerror}") from None
    except ValueError as exc:
        raise ArtifactUnavailable(f"{manifest} is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != 1:
        raise ArtifactUnavailable(f"{manifest} is not a build manifest this sandlot reads")
    artifacts = body.get("artifacts")
    if not isinstance(artifacts, dict):
        raise ArtifactUnavailable(f"{manifest} is not a build manifest this sandlot reads")
    return artifacts


def _open(path: Path, owners: set[int]) -> int:
    """A descriptor of ``path``, a regular file owned by one of ``owners`` that nobody
    else can write; raises :class:`ArtifactUnavailable` (``OSError`` if it cannot open)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactUnavailable(f"{path} is not a regular file")
        if st.st_uid not in owners:
            raise ArtifactUnavailable(
                f"{path} belongs to uid {st.st_uid}, neither root, this server's user nor "
                "the owner of its package"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ArtifactUnavailable(
                f"{path} is writable by its group or by others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): anyone could change what the server runs; "
                f"chmod go-w {path}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sha256(path: Path, owners: set[int] | None) -> str:
    """The file's sha256, read from the descriptor that was checked (``owners``: see
    :func:`_open`; ``None``: no check, for the source, which is only compared)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if owners is None else _open(path, owners)
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

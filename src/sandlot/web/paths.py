"""A browser's paths: relative to the workspace root, never out of it.

boring-ui names files relative to the workspace (``src/app.py``, ``.`` for the root). The
dataplane names them as the sandbox sees them (``/workspace/src/app.py``), in both modes:
a sandbox's workspace, or the local folder its dataplane mounts at ``/workspace``.

:func:`to_sandbox` checks a browser's path lexically (relative, no NUL, valid UTF-8, not
climbing above the root) and turns it into the sandbox path; symlinks are then resolved by
the dataplane inside the sandbox's own view (it never follows one on the host).
:func:`to_browser` turns a path the dataplane answers with back into the browser's form,
or ``None`` when it lies outside the workspace (a symlink leading elsewhere in the
sandbox): such an answer is never shown to the browser.
"""

from __future__ import annotations

from sandlot.protocol.errors import InvalidRequest

#: Where the workspace is, as the sandbox sees it (and the local dataplane mounts the folder).
ROOT = "/workspace"
#: Longest path a browser may send (the dataplane's own limit).
MAX_PATH_BYTES = 4096


def parts_of(path: str) -> list[str]:
    """The components of a browser's path below the root (``[]`` for the root itself).

    Raises :class:`InvalidRequest` for an absolute path, one that climbs above the root,
    a NUL byte, text that is not UTF-8, or a path longer than :data:`MAX_PATH_BYTES`.
    """
    if not isinstance(path, str):
        raise InvalidRequest("path must be a string")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest("path is not valid UTF-8") from None
    if "\x00" in path:
        raise InvalidRequest("path contains a NUL byte")
    if size > MAX_PATH_BYTES:
        raise InvalidRequest("path too long")
    if path.startswith("/"):
        raise InvalidRequest("paths are relative to the workspace root (no leading /)")
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise InvalidRequest("path leads outside the workspace")
            parts.pop()
            continue
        parts.append(part)
    return parts


def normalized(path: str) -> str:
    """The browser's path in canonical form (``.`` for the root)."""
    return "/".join(parts_of(path)) or "."


def to_sandbox(path: str) -> str:
    """The sandbox path of a browser's path (see :func:`parts_of` for what is refused)."""
    parts = parts_of(path)
    return f"{ROOT}/{'/'.join(parts)}" if parts else ROOT


def to_browser(sandbox_path: str) -> str | None:
    """A sandbox path as the browser names it (``.`` for the root), or ``None`` outside."""
    if sandbox_path == ROOT:
        return "."
    if sandbox_path.startswith(ROOT + "/"):
        rest = sandbox_path[len(ROOT) + 1 :].strip("/")
        return rest or "."
    return None


def name_of(path: str) -> str:
    """The last component of a browser's path (``""`` for the root)."""
    return path.rsplit("/", 1)[-1] if path != "." else ""


def parent_of(path: str) -> str:
    """The directory holding a browser's path, as boring-ui's search reports it (``""`` for
    an entry at the root)."""
    return path.rsplit("/", 1)[0] if "/" in path else ""


def join(directory: str, name: str) -> str:
    """``directory/name`` in the browser's form."""
    return name if directory in ("", ".") else f"{directory}/{name}"

"""``sandlot://`` URIs: a sandbox's file, named one way by every integration.

``sandlot://{id}/{path}`` is the file at the absolute sandbox path ``/{path}``;
``sandlot://{id}`` alone is the sandbox itself. ``id`` is what a reader attaches
through, with its type prefix: a session (``ssn_…``, as the MCP server's resources
name files) or a sandbox (``sb_…``, as A2A parts and context ids do). The path is
percent-encoded (RFC 3986). Both directions refuse a ``..`` segment (a URI handed
over by someone else must not climb out of the directory it names), a NUL, a query
and a fragment, with a :class:`ValueError` that says why.

Standard library only: the SDK loads this module.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import quote, unquote

SCHEME = "sandlot"

#: A session or sandbox id: what the broker hands out, and nothing a URI would misread.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")
#: A path as RFC 3986 lets it stand unencoded: its characters and %XX escapes.
_ENCODED_PATH = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*")


class SandboxUri(NamedTuple):
    """A parsed ``sandlot://`` URI: the id it names and the absolute path, if any."""

    id: str
    #: The absolute sandbox path; ``None`` when the URI names the sandbox itself.
    path: str | None


def sandbox_uri(id: str, path: str | None = None) -> str:
    """``sandlot://{id}/{path}`` for an absolute sandbox path (``sandlot://{id}`` without one)."""
    _check_id(id, id)
    if path is None:
        return f"{SCHEME}://{id}"
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute sandbox path")
    _check_path(path, path)
    return f"{SCHEME}://{id}/{quote(path[1:], safe='/')}"


def parse_sandbox_uri(uri: str) -> SandboxUri:
    """The id and the absolute path of a ``sandlot://`` URI; :class:`ValueError` if malformed."""
    if not isinstance(uri, str):
        raise ValueError(f"a sandlot:// URI is a string, not {type(uri).__name__}")
    scheme, sep, rest = uri.partition("://")
    if scheme.lower() != SCHEME or not sep:
        raise ValueError(f"{uri!r} is not a {SCHEME}:// URI")
    if "?" in rest or "#" in rest:
        raise ValueError(f"{uri!r}: a {SCHEME}:// URI has no query or fragment")
    id, slash, encoded = rest.partition("/")
    _check_id(id, uri)
    if not slash:
        return SandboxUri(id, None)
    if not _ENCODED_PATH.fullmatch(encoded):
        raise ValueError(f"{uri!r}: the path holds characters that must be percent-encoded")
    try:
        path = "/" + unquote(encoded, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(f"{uri!r}: the path's escapes are not UTF-8") from None
    _check_path(path, uri)
    return SandboxUri(id, path)


def _check_id(id: str, where: str) -> None:
    if not _ID.fullmatch(id):
        raise ValueError(f"{where!r}: {id!r} is not a session or sandbox id")


def _check_path(path: str, where: str) -> None:
    if "\x00" in path:
        raise ValueError(f"{where!r}: a sandbox path holds no NUL")
    if ".." in path.split("/"):
        raise ValueError(f"{where!r}: a '..' segment leaves the directory it names")

"""The protocol's version, and the client's check of the one a server speaks.

Grants (PROTOCOL.md 2.1, the 2.9 alias and the 2.10 bootstrap object) carry
``protocol_version`` as ``MAJOR.MINOR``. A minor version only adds (fields a
client ignores); a major version may change what the fields mean, so a client
refuses an answer of another major version before it uses it. No imports
beyond the error table: the SDK loads this module.
"""

from __future__ import annotations

from sandlot.protocol.errors import ProtocolVersionError

PROTOCOL_VERSION = "1.0"
API_VERSION = "1"


def major_of(version: str) -> int | None:
    """The major number of ``MAJOR[.MINOR…]``; ``None`` if it is not one."""
    head = version.strip().split(".", 1)[0]
    if not (head.isascii() and head.isdigit()):
        return None
    return int(head)


def check_protocol_version(version: object, supported: str = PROTOCOL_VERSION) -> None:
    """Accept an absent version or one of the ``supported`` major; raise otherwise."""
    if version is None:
        return
    ours = major_of(supported)
    theirs = major_of(version) if isinstance(version, str) else None
    if theirs is not None and theirs == ours:
        return
    shown = version if isinstance(version, str) else repr(version)
    raise ProtocolVersionError(str(shown), supported)

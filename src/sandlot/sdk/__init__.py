"""The sandlot SDK: an async client and its generated sync twin.

Broker (control plane): :class:`AsyncSandlot` / :class:`Sandlot`.
Dataplane of one sandbox: :class:`AsyncSandbox` / :class:`Sandbox`, built
by ``ensure`` or from a grant in hand (the bootstrap object of PROTOCOL.md 2.10).
Errors come from the one table of :mod:`sandlot.protocol.errors` and are
re-exported here, and so are the result types of :mod:`sandlot.sdk.types`
(the objects nested in them live there). See ``docs/SDK.md``.

The sync twin is loaded on first use: async code (and the CLI) does not pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sandlot.protocol.errors import (
    CapabilityDenied,
    CommandExitError,
    ConnectError,
    ConnectionLost,
    FileNotFound,
    Forbidden,
    NotFound,
    PreconditionFailed,
    ProtocolVersionError,
    RequestTimeout,
    SandboxStarting,
    SandlotError,
    SessionExpired,
    SessionNotFound,
    SocketClosed,
    TokenExpired,
    TransportError,
    Unauthenticated,
)
from sandlot.sdk._async.client import AsyncSandlot
from sandlot.sdk._async.commands import AsyncCommand
from sandlot.sdk._async.events import AsyncEventStream
from sandlot.sdk._async.sandbox import AsyncSandbox
from sandlot.sdk._async.shells import AsyncShell
from sandlot.sdk.types import (
    ArchiveResult,
    AuditEntry,
    CommandResult,
    EditResult,
    Event,
    ExecSnapshot,
    FileEntry,
    FileStat,
    Grant,
    GrepAnswer,
    GrepMatch,
    HeartbeatResult,
    Listing,
    OutputChunk,
    Pool,
    ReadResult,
    RefreshResult,
    SandboxSnapshot,
    SessionSnapshot,
    ShellSnapshot,
    Template,
    UploadResult,
    Volume,
)

if TYPE_CHECKING:
    from sandlot.sdk._sync.client import Sandlot
    from sandlot.sdk._sync.commands import Command
    from sandlot.sdk._sync.events import EventStream
    from sandlot.sdk._sync.sandbox import Sandbox
    from sandlot.sdk._sync.shells import Shell

_SYNC = {
    "Sandlot": "client",
    "Command": "commands",
    "EventStream": "events",
    "Sandbox": "sandbox",
    "Shell": "shells",
}


def __getattr__(name: str) -> Any:
    module = _SYNC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"sandlot.sdk._sync.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ArchiveResult",
    "AsyncCommand",
    "AsyncEventStream",
    "AsyncSandbox",
    "AsyncSandlot",
    "AsyncShell",
    "AuditEntry",
    "CapabilityDenied",
    "Command",
    "CommandExitError",
    "CommandResult",
    "ConnectError",
    "ConnectionLost",
    "EditResult",
    "Event",
    "EventStream",
    "ExecSnapshot",
    "FileEntry",
    "FileNotFound",
    "FileStat",
    "Forbidden",
    "Grant",
    "GrepAnswer",
    "GrepMatch",
    "HeartbeatResult",
    "Listing",
    "NotFound",
    "OutputChunk",
    "Pool",
    "PreconditionFailed",
    "ProtocolVersionError",
    "ReadResult",
    "RefreshResult",
    "RequestTimeout",
    "Sandbox",
    "SandboxSnapshot",
    "SandboxStarting",
    "Sandlot",
    "SandlotError",
    "SessionExpired",
    "SessionNotFound",
    "SessionSnapshot",
    "Shell",
    "ShellSnapshot",
    "SocketClosed",
    "Template",
    "TokenExpired",
    "TransportError",
    "Unauthenticated",
    "UploadResult",
    "Volume",
]

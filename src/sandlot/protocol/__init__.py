"""The wire contract: models, states, events, token claims, the error table and the
``sandlot://`` URI form (:mod:`~sandlot.protocol.uris`). No I/O.

The names below are loaded on first use: a client that only needs the error
table (the SDK, the CLI) does not pay for building the pydantic models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandlot.protocol.common import (
        API_VERSION,
        PROTOCOL_VERSION,
        Actor,
        ActorType,
        Capability,
        PrincipalType,
        Scope,
        ScopeType,
    )
    from sandlot.protocol.errors import ERROR_TABLE, SandlotError, error_from_wire, exception_for
    from sandlot.protocol.states import ExecState, SandboxState, ShellState

_HOME = {
    "API_VERSION": "common",
    "PROTOCOL_VERSION": "common",
    "Actor": "common",
    "ActorType": "common",
    "Capability": "common",
    "PrincipalType": "common",
    "Scope": "common",
    "ScopeType": "common",
    "ERROR_TABLE": "errors",
    "SandlotError": "errors",
    "error_from_wire": "errors",
    "exception_for": "errors",
    "ExecState": "states",
    "SandboxState": "states",
    "ShellState": "states",
}

__all__ = [
    "API_VERSION",
    "ERROR_TABLE",
    "PROTOCOL_VERSION",
    "Actor",
    "ActorType",
    "Capability",
    "ExecState",
    "PrincipalType",
    "SandboxState",
    "SandlotError",
    "Scope",
    "ScopeType",
    "ShellState",
    "error_from_wire",
    "exception_for",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

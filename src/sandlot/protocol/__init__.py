"""The wire contract: models, states, events, token claims and the error table. No I/O."""

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

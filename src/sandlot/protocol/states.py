"""Lifecycle states with checked transitions (PROTOCOL.md 2.7, 3.3).

Each enum lists the moves it allows; :func:`check_transition` refuses the rest,
so a binding never goes from ``terminated`` back to ``active`` by accident.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow (a bug, not a client mistake)."""


class SandboxState(StrEnum):
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    IDLE = "idle"
    SUSPENDED = "suspended"
    #: Teardown accepted (tokens revoked, binding ended), the provider still deleting.
    TERMINATING = "terminating"
    TERMINATED = "terminated"
    FAILED = "failed"

    @property
    def live(self) -> bool:
        """Whether clients may still use it (a terminating sandbox is already out of use)."""
        return self not in (SandboxState.TERMINATING, SandboxState.TERMINATED, SandboxState.FAILED)

    @property
    def settled(self) -> bool:
        """Whether no further phase event is coming without a new request."""
        return self in (SandboxState.TERMINATED, SandboxState.FAILED)


#: Bindings follow the state of their sandbox (a binding is live while its sandbox is).
BindingState = SandboxState

_ENDING = frozenset({SandboxState.TERMINATING, SandboxState.TERMINATED, SandboxState.FAILED})

_SANDBOX_MOVES: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.PROVISIONING: _ENDING | {SandboxState.ACTIVE},
    SandboxState.ACTIVE: _ENDING | {SandboxState.IDLE, SandboxState.SUSPENDED},
    SandboxState.IDLE: _ENDING | {SandboxState.ACTIVE, SandboxState.SUSPENDED},
    SandboxState.SUSPENDED: _ENDING | {SandboxState.ACTIVE},
    # Only the end of the teardown leaves it: a provider's late report of a failure
    # does not turn a sandbox being deleted back into one to delete.
    SandboxState.TERMINATING: frozenset({SandboxState.TERMINATED}),
    SandboxState.TERMINATED: frozenset(),
    SandboxState.FAILED: frozenset({SandboxState.TERMINATING, SandboxState.TERMINATED}),
}


class ExecState(StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    KILLED = "killed"
    FAILED = "failed"


_EXEC_MOVES: dict[ExecState, frozenset[ExecState]] = {
    ExecState.RUNNING: frozenset({ExecState.EXITED, ExecState.KILLED, ExecState.FAILED}),
    ExecState.EXITED: frozenset(),
    ExecState.KILLED: frozenset(),
    ExecState.FAILED: frozenset(),
}


class ShellState(StrEnum):
    RUNNING = "running"
    EXITED = "exited"


_SHELL_MOVES: dict[ShellState, frozenset[ShellState]] = {
    ShellState.RUNNING: frozenset({ShellState.EXITED}),
    ShellState.EXITED: frozenset(),
}

_S = TypeVar("_S", SandboxState, ExecState, ShellState)

_MOVES: dict[type[StrEnum], dict[object, frozenset[object]]] = {
    SandboxState: _SANDBOX_MOVES,  # type: ignore[dict-item]
    ExecState: _EXEC_MOVES,  # type: ignore[dict-item]
    ShellState: _SHELL_MOVES,  # type: ignore[dict-item]
}


def can_transition(current: _S, target: _S) -> bool:
    if current == target:
        return True
    return target in _MOVES[type(current)][current]


def check_transition(current: _S, target: _S) -> _S:
    """Return ``target`` if the move is allowed (staying put is), else raise."""
    if not can_transition(current, target):
        raise IllegalTransition(f"{type(current).__name__}: {current} → {target} is not allowed")
    return target

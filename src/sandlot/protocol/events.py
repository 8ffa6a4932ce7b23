"""The event envelope shared by sandbox logs (3.7) and binding logs (2.6).

``details`` holds exactly one member; clients dispatch on which one is set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from sandlot.protocol.common import Actor, WireModel

DETAIL_KINDS = ("phase", "exec", "shell", "fs", "service", "binding")

#: The largest cursor (event sequence, audit id): the store keeps them as 64-bit integers.
MAX_SEQUENCE = (1 << 63) - 1


class EventDetails(WireModel):
    model_config = WireModel.model_config | {"extra": "forbid"}
    phase: dict[str, Any] | None = None
    exec: dict[str, Any] | None = None
    shell: dict[str, Any] | None = None
    fs: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    #: Binding logs only: attach, detach, refresh, revocation.
    binding: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> EventDetails:
        present = [k for k in DETAIL_KINDS if getattr(self, k) is not None]
        if len(present) != 1:
            raise ValueError(f"details must hold exactly one of {DETAIL_KINDS}, got {present}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in DETAIL_KINDS if getattr(self, k) is not None)


class Event(WireModel):
    event_id: str
    sequence: int
    event_type: str
    timestamp: str
    details: EventDetails
    actor: Actor | None = None
    #: Sandbox logs.
    sandbox_id: str | None = None
    sandbox_state: str | None = None
    #: Binding logs.
    binding_id: str | None = None
    state: str | None = None


EventKind = Literal["phase", "exec", "shell", "fs", "service", "binding"]

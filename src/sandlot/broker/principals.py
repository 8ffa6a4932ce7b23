"""Who is calling: the principal behind an API key, and the actor it acts as."""

from __future__ import annotations

from dataclasses import dataclass

from sandlot.protocol.common import Actor, ActorType, PrincipalType


@dataclass(frozen=True)
class Principal:
    """An authenticated caller of the control plane."""

    type: PrincipalType
    id: str
    user_id: str
    #: The API key it authenticated with; ``None`` when the platform hosting the broker
    #: authenticated it (a LangGraph server's own auth, :mod:`sandlot.integrations.langgraph`).
    key_id: str | None
    is_admin: bool = False
    #: Set when a service principal acts for a user (``X-Sandlot-On-Behalf-Of``).
    on_behalf_of: str | None = None

    @property
    def effective_user(self) -> str:
        return self.on_behalf_of or self.user_id

    @property
    def actor_type(self) -> ActorType:
        """A service principal acting for a user is recorded as an agent."""
        return ActorType.HUMAN if self.type is PrincipalType.HUMAN else ActorType.AGENT

    @property
    def actor(self) -> Actor:
        return Actor(type=self.actor_type, id=self.id)

    @property
    def lease_holder(self) -> str:
        """Leases are per principal (and per user it acts for)."""
        if self.on_behalf_of:
            return f"{self.id}@{self.on_behalf_of}"
        return self.id

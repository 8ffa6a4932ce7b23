"""The provider contract: where sandboxes come from.

Modelled on JupyterHub's Spawner. The broker is the only caller; it keeps the
authoritative records in its store and asks a provider to make reality match:

- :meth:`Provider.create` is *accepted at once* and completes in the
  background; progress shows up in :meth:`Provider.status` and through the
  listener given to :meth:`Provider.start`.
- :meth:`Provider.status` returns the state and the last event sequence of the
  sandbox's own event log *read together*, so a client can subscribe after it
  without a race.
- :meth:`Provider.load_state` re-adopts sandboxes that survived a broker
  restart; :meth:`Provider.list_sandboxes` says what really runs, so the
  reaper can remove orphans on both sides.
- :meth:`Provider.revoke` pushes token revocations to the dataplane that
  serves the sandbox (within 1 s).

Providers are found through the ``sandlot.providers`` entry-point group; the
entry point names a :class:`Provider` subclass built with ``cls(config)``.
"""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar

from sandlot.protocol.errors import InvalidRequest, SandboxNotFound
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxActivity, Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken

PROVIDER_ENTRY_POINT_GROUP = "sandlot.providers"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxSpec:
    """What the broker asks a provider to create."""

    sandbox_id: str
    generation: int
    template: Template
    owner_user_id: str | None = None
    name: str | None = None
    #: Named volumes, resolved by the broker: volume name → host-independent id.
    volumes: Mapping[str, str] = field(default_factory=dict)
    #: The configured provider chosen for it (``binding.provider``); None: the default.
    provider: str | None = None
    #: The warm pool it is made for (unclaimed), else None.
    pool: str | None = None


@dataclass(frozen=True)
class ProviderStatus:
    state: SandboxState
    last_event_sequence: int
    reason: str | None = None


@dataclass(frozen=True)
class AdoptionRecord:
    """A sandbox the store believes to be live, handed to :meth:`Provider.load_state`."""

    sandbox_id: str
    generation: int
    template: Template
    state: SandboxState
    provider_state: Mapping[str, Any] = field(default_factory=dict)
    #: The configured provider that made it (None: the default).
    provider: str | None = None
    #: The warm pool it waits in (unclaimed), else None.
    pool: str | None = None


#: Called by a provider whenever a sandbox changes state (from any thread of the event loop).
StatusListener = Callable[[str, ProviderStatus], Awaitable[None] | None]


class Provider(abc.ABC):
    """One source of sandboxes. Subclasses document their own config keys."""

    #: Registered name, as in ``sandlot.providers`` and ``binding.provider``.
    name: ClassVar[str]
    #: Whether :meth:`suspend` keeps processes and files (else idle sandboxes are deleted).
    supports_suspend: bool = False
    #: Whether its sandboxes live on the machine of the process that made them, so only
    #: that machine's processes can reach them (:mod:`sandlot.broker.hosts`). A provider
    #: every broker replica reaches alike (a cluster engine, a hosted service) says False.
    host_bound: ClassVar[bool] = True
    #: Whether the provider records pool claims on the sandboxes themselves
    #: (:meth:`claim_pooled`); else the broker's store alone says which are claimed.
    claims_pooled: bool = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})

    async def start(self, listener: StatusListener | None = None) -> None:  # noqa: B027
        """Preflight and clean up leftovers of a crashed server. Called once."""

    async def close(self) -> None:  # noqa: B027
        """Release the provider's own resources (not the sandboxes)."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        """Accept the creation and return at once (state ``provisioning`` or ``active``)."""

    @abc.abstractmethod
    async def status(self, sandbox_id: str) -> ProviderStatus:
        """State and last event sequence, read together. Unknown id → ``SandboxNotFound``."""

    def choose(self, template: Template, preference: str = "auto") -> str:
        """The configured provider a new sandbox of ``template`` goes to: the template's
        pin, else ``preference`` (``auto``: the default). One provider: its own name."""
        wanted = template.provider or (None if preference == "auto" else preference)
        if wanted is not None and wanted != self.name:
            raise InvalidRequest(
                f"provider {wanted!r} is not configured (configured: {self.name})",
                metadata={"provider": wanted, "configured": [self.name]},
            )
        return self.name

    def member(self, name: str) -> Provider:
        """The configured provider called ``name`` (one provider: itself)."""
        if name != self.name:
            raise InvalidRequest(f"provider {name!r} is not configured")
        return self

    def assign(self, sandbox_id: str, provider: str | None) -> Provider:
        """Note that the configured provider ``provider`` runs ``sandbox_id``; that provider.
        (One provider: itself, whatever the name.)"""
        return self

    def can_suspend(self, sandbox_id: str) -> bool:
        """Whether the provider that runs ``sandbox_id`` keeps it across a suspend."""
        return self.supports_suspend

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        raise InvalidRequest(f"provider {self.name} cannot suspend sandboxes")

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        raise InvalidRequest(f"provider {self.name} cannot resume sandboxes")

    async def claim_pooled(self, sandbox_id: str) -> bool:
        """Take the unclaimed pool sandbox ``sandbox_id`` for a new binding, atomically
        against every other claimer; False: someone else has it (or it is gone)."""
        return True

    async def release_pooled(self, sandbox_id: str, pool: str) -> None:  # noqa: B027
        """Give back to ``pool`` a sandbox :meth:`claim_pooled` took but no binding got."""

    @abc.abstractmethod
    async def delete(self, sandbox_id: str) -> None:
        """Tear down every process and resource of the sandbox. Idempotent."""

    @abc.abstractmethod
    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        """Where clients reach the sandbox's dataplane (known before it is active)."""

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:  # noqa: B027
        """Make the sandbox's dataplane refuse these tokens (and close their sockets)."""

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        return SandboxActivity()

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        """Re-adopt sandboxes after a restart; return the ids that could not be adopted."""
        return [r.sandbox_id for r in records]

    @abc.abstractmethod
    async def list_sandboxes(self) -> set[str]:
        """Ids of the sandboxes that exist right now (for orphan removal)."""

    def readiness(self) -> dict[str, Any]:
        """What ``/readyz`` reports for this provider."""
        return {"ok": True}

    async def report_status(self, listener: StatusListener | None, sandbox_id: str) -> None:
        """Give ``listener`` the sandbox's status now (one that is gone is not news; a
        listener that fails is logged, never raised into the provider's own work)."""
        if listener is None:
            return
        try:
            result = listener(sandbox_id, await self.status(sandbox_id))
            if inspect.isawaitable(result):
                await result
        except SandboxNotFound:
            pass
        except Exception:
            log.exception("status listener failed for %s", sandbox_id)


def provider_class(name: str) -> type[Provider]:
    """Look a provider up in the ``sandlot.providers`` entry-point group."""
    for ep in entry_points(group=PROVIDER_ENTRY_POINT_GROUP):
        if ep.name == name:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Provider)):
                raise InvalidRequest(f"entry point {name!r} is not a sandlot Provider")
            return cls
    known = sorted(ep.name for ep in entry_points(group=PROVIDER_ENTRY_POINT_GROUP))
    raise InvalidRequest(f"unknown provider {name!r} (installed: {', '.join(known) or 'none'})")

"""Several configured providers behind the one :class:`~sandlot.providers.base.Provider`
the broker talks to.

``[providers.NAME]`` tables configure them (``docs/PROVIDERS.md``); a new sandbox goes
to the provider its template pins, else to the one its request's
``provider_preference`` names, else to ``default_provider``
(:meth:`MultiProvider.choose`). The broker records the choice in the sandbox's row
(``binding.provider``) and hands it back in every :class:`SandboxSpec` and
:class:`AdoptionRecord`, so each later call reaches the provider that made the sandbox.

Each provider's dataplane app is served at ``/dp`` too: :class:`DataplaneDispatch` sends
``/dp/{sandbox_id}/…`` to the app of the provider that runs that sandbox (the default
provider's app answers for ids it does not know, with its own 404).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sandlot.protocol.errors import InvalidRequest
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxActivity, Template
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import (
    AdoptionRecord,
    Provider,
    ProviderStatus,
    SandboxSpec,
    StatusListener,
)

_SANDBOX_OF_PATH = re.compile(r"^/([A-Za-z0-9_.-]{1,128})(?:/|$)")


def choose_provider(
    configured: Iterable[str], default: str, template: Template, preference: str = "auto"
) -> str:
    """The provider that makes a sandbox of ``template``: the template's pin, else the
    request's preference, else ``default``; a name not configured is the client's mistake."""
    wanted = template.provider or (None if preference == "auto" else preference)
    if wanted is None:
        return default
    names = sorted(configured)
    if wanted not in names:
        raise InvalidRequest(
            f"provider {wanted!r} is not configured (configured: {', '.join(names)})",
            metadata={"provider": wanted, "configured": names},
        )
    return wanted


class MultiProvider(Provider):
    """Configured providers by name, one of them the default."""

    name = "multi"

    def __init__(self, members: Mapping[str, Provider], default: str) -> None:
        super().__init__({})
        if default not in members:
            raise InvalidRequest(f"default provider {default!r} is not configured")
        self.members = dict(members)
        self.default = default
        #: Sandbox id → the name of the provider that runs it.
        self._owner: dict[str, str] = {}
        self.supports_suspend = any(m.supports_suspend for m in self.members.values())
        apps = {n: getattr(m, "app", None) for n, m in self.members.items()}
        self.apps: dict[str, Any] = {n: a for n, a in apps.items() if a is not None}
        #: The ASGI app the embedded server mounts at ``/dp`` (None: no provider serves one).
        self.app: DataplaneDispatch | None = DataplaneDispatch(self) if self.apps else None
        #: The in-process dataplane host, if a provider has one (its figures go to /metrics).
        hosts = (getattr(m, "host", None) for m in self.members.values())
        self.host = next((h for h in hosts if h is not None), None)

    @property
    def host_bound(self) -> bool:  # type: ignore[override]
        return any(m.host_bound for m in self.members.values())

    @property
    def claims_pooled(self) -> bool:  # type: ignore[override]
        return any(m.claims_pooled for m in self.members.values())

    # --- choosing -----------------------------------------------------------------------

    def choose(self, template: Template, preference: str = "auto") -> str:
        return choose_provider(self.members, self.default, template, preference)

    def member(self, name: str) -> Provider:
        try:
            return self.members[name]
        except KeyError:
            raise InvalidRequest(f"provider {name!r} is not configured") from None

    def assign(self, sandbox_id: str, provider: str | None) -> Provider:
        name = provider if provider in self.members else self.default
        assert name is not None
        self._owner[sandbox_id] = name
        return self.members[name]

    def of(self, sandbox_id: str) -> Provider:
        """The provider that runs ``sandbox_id`` (the default for an id it never saw)."""
        return self.members[self._owner.get(sandbox_id, self.default)]

    def name_of(self, sandbox_id: str) -> str:
        return self._owner.get(sandbox_id, self.default)

    # --- the contract -------------------------------------------------------------------

    async def start(self, listener: StatusListener | None = None) -> None:
        for member in self.members.values():
            await member.start(listener)

    async def close(self) -> None:
        for member in self.members.values():
            await member.close()

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        return await self.assign(spec.sandbox_id, spec.provider).create(spec)

    async def status(self, sandbox_id: str) -> ProviderStatus:
        return await self.of(sandbox_id).status(sandbox_id)

    def can_suspend(self, sandbox_id: str) -> bool:
        return self.of(sandbox_id).can_suspend(sandbox_id)

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        return await self.of(sandbox_id).suspend(sandbox_id)

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        return await self.of(sandbox_id).resume(sandbox_id)

    async def delete(self, sandbox_id: str) -> None:
        member = self.of(sandbox_id)
        await member.delete(sandbox_id)
        self._owner.pop(sandbox_id, None)

    async def claim_pooled(self, sandbox_id: str) -> bool:
        return await self.of(sandbox_id).claim_pooled(sandbox_id)

    async def release_pooled(self, sandbox_id: str, pool: str) -> None:
        await self.of(sandbox_id).release_pooled(sandbox_id, pool)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        return self.of(sandbox_id).dataplane(sandbox_id)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        await self.of(sandbox_id).revoke(sandbox_id, tokens)

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        return await self.of(sandbox_id).activity(sandbox_id)

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        by_member: dict[str, list[AdoptionRecord]] = {n: [] for n in self.members}
        lost: list[str] = []
        for rec in records:
            name = rec.provider or self.default
            if name not in self.members:
                lost.append(rec.sandbox_id)  # its provider is no longer configured
                continue
            self._owner[rec.sandbox_id] = name
            by_member[name].append(rec)
        for name, recs in by_member.items():
            lost += await self.members[name].load_state(recs)
        return lost

    async def list_sandboxes(self) -> set[str]:
        found = await asyncio.gather(*(m.list_sandboxes() for m in self.members.values()))
        return set().union(*found)

    def readiness(self) -> dict[str, Any]:
        each = {n: m.readiness() for n, m in self.members.items()}
        default = each[self.default]
        return {
            **default,
            "ok": all(bool(r.get("ok")) for r in each.values()),
            "default": self.default,
            "providers": {n: {"kind": self.members[n].name, **r} for n, r in each.items()},
        }


class DataplaneDispatch:
    """ASGI app at ``/dp``: each sandbox's requests to its provider's dataplane app."""

    def __init__(self, multi: MultiProvider) -> None:
        self.multi = multi
        self.fallback = multi.apps.get(multi.default) or next(iter(multi.apps.values()))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        app = self.fallback
        if scope["type"] in ("http", "websocket"):
            root = scope.get("root_path", "")
            path: str = scope["path"]
            route = path[len(root) :] if root and path.startswith(root) else path
            match = _SANDBOX_OF_PATH.match(route)
            if match is not None:
                app = self.multi.apps.get(self.multi.name_of(match.group(1)), self.fallback)
        await app(scope, receive, send)


__all__ = ["DataplaneDispatch", "MultiProvider"]
